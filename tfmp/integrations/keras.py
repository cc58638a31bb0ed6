"""Keras 3 (TensorFlow backend): where tfmp meets models, trainers and variables."""

from tfmp.integrations import Patch

PACKAGE = "keras"
MODULE = "keras"
TESTED = ("3.12", "3.15")

_HOOKS = "tfmp.strategy.keras_hooks"
_TRAINER = "keras.src.backend.tensorflow.trainer:TensorFlowTrainer"

PATCHES = (
    Patch(
        "keras.src.layers.layer:Layer",
        "__call__",
        f"{_HOOKS}:eager_call",
        "DTensor refuses host arrays next to mesh variables in `model(x)`, and "
        "tfmp's lowerings need to know which mesh a forward pass is traced on.",
    ),
    *(
        Patch(
            _TRAINER,
            name,
            f"{_HOOKS}:on_batch",
            "Host batches must be packed onto the mesh, split over the batch axis.",
            parameters=parameters,
        )
        for name, parameters in (
            ("train_on_batch", ("x", "y", "sample_weight", "class_weight")),
            ("test_on_batch", ("x", "y", "sample_weight")),
            ("predict_on_batch", ("x",)),
        )
    ),
    *(
        Patch(
            _TRAINER,
            name,
            f"{_HOOKS}:prepared",
            "`layout_map='auto'` lays out the model at its first fit; DTensor's "
            "errors become ValueErrors naming the layer.",
        )
        for name in ("fit", "evaluate", "predict")
    ),
    *(
        Patch(
            _TRAINER,
            name,
            "tfmp.pipeline.keras_hooks:pipelined",
            "A pipeline model's steps run stage by stage.",
            parameters=("data",),
        )
        for name in ("train_step", "test_step")
    ),
    Patch(
        "keras.src.backend.tensorflow.trainer",
        "TFEpochIterator",
        "tfmp.strategy.epoch_iterator:read_once",
        "Under a strategy Keras reads a batch to build the model and opens the "
        "epoch again, and the mesh's iterators read ahead: a shuffle would start "
        "another pass, a generator lose a batch, so steps saw other rows than "
        "on one device.",
        parameters=("distribute_strategy",),
    ),
    Patch(
        _TRAINER,
        "_make_function",
        "tfmp.strategy.steps_per_call:steps_per_call",
        "steps_per_execution=k runs k steps in one function call: Keras calls "
        "its one-step function k times for a dataset it cannot loop over in a graph.",
        parameters=("step_function",),
    ),
    *(
        Patch(
            "keras.src.models.model:Model",
            name,
            f"{_HOOKS}:chief_writes",
            "In a multi-client run every client gathers the values, one writes.",
            parameters=("filepath",),
        )
        for name in ("save", "save_weights")
    ),
    Patch(
        "keras.src.backend.tensorflow.core:Variable",
        "_initialize",
        f"{_HOOKS}:announced",
        "The strategy's variable creator learns which Keras variable it makes "
        "(path, layer), to find its layout.",
        parameters=("value",),
    ),
    Patch(
        "keras.src.backend.tensorflow.core:Variable",
        "_value",
        "tfmp.strategy.extended:ModelParallelExtended",
        "A variable moves to a pipeline stage's mesh, or to the layout "
        "layout_map='auto' planned, after Keras made it.",
        kind="instance",
    ),
    Patch(
        "keras.src.backend.tensorflow.optimizer:TFOptimizer",
        "_distribution_strategy",
        "tfmp.strategy.extended:ModelParallelExtended",
        "An optimizer made outside the strategy's scope keeps the strategy "
        "current then, and would make its slots and updates off the mesh.",
        kind="instance",
    ),
    Patch(
        "keras.src.backend.tensorflow.optimizer:TFOptimizer",
        "_all_reduce_sum_gradients",
        "tfmp.callbacks.gradient_norms:GradientNormRecorder",
        "GradientSyncMonitor(grad_norms=True) records the synchronized gradients.",
        parameters=("grads_and_vars",),
        kind="instance",
    ),
    *(
        Patch(
            "keras.src.layers.attention.multi_head_attention:MultiHeadAttention",
            name,
            "tfmp.layers.attention:ParallelMultiHeadAttention",
            "Self-attention projects query, key and value in one all-reduce of "
            "the input's gradient.",
            kind="instance",
        )
        for name in ("_query_dense", "_key_dense", "_value_dense")
    ),
)

# Keras backend functions that run tfmp's rewrite while a forward pass is
# traced on a mesh: a table of their own (`tfmp.lowering`), with its own test.
AFTER_INSTALL = ("tfmp.lowering:install",)
