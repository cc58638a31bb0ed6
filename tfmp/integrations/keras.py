"""Keras 3 (TensorFlow backend): where tfmp meets models, trainers and variables."""

from tfmp.integrations import Patch

PACKAGE = "keras"
MODULE = "keras"
TESTED = ("3.12", "3.15")

_HOOKS = "tfmp.strategy.keras_hooks"
_SAVING = "tfmp.strategy.saving"
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
        "keras.src.optimizers.base_optimizer:BaseOptimizer",
        "build",
        f"{_HOOKS}:laid_out_before_slots",
        "With layout_map='auto', an optimizer built before the first step "
        "(load_model of a compiled model, a checkpoint restored into a custom "
        "loop) would index the model's variables and make their slots before "
        "tfmp lays the model out.",
        parameters=("variables",),
    ),
    Patch(
        "keras.src.trainers.trainer:Trainer",
        "compile",
        f"{_HOOKS}:compiled_in_its_scope",
        "A model made outside the strategy's scope and compiled inside it "
        "passes compile, and fit stops with 'Need to be inside strategy.scope()', "
        "which does not say the model is the problem.",
        parameters=("optimizer", "loss"),
    ),
    Patch(
        "keras.src.trainers.trainer:Trainer",
        "_symbolic_build",
        f"{_HOOKS}:built_without_call",
        "Under any strategy Keras builds a model by calling `call()`, which a "
        "GAN or VAE with its own `train_step` does not have: fit stops.",
        parameters=("iterator", "data_batch"),
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
        "keras.src.trainers.compile_utils:CompileLoss",
        "call",
        "tfmp.strategy.epoch_iterator:loss_trackers_weighted_as_on_one_device",
        "Each output's loss is logged weighed by the static batch size of the "
        "step's trace, which on a mesh is known for whole batches and unknown "
        "for a last one that does not divide the batch axis: other logs than "
        "on one device.",
        parameters=("y_true", "y_pred", "sample_weight"),
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
            f"{_SAVING}:chief_writes",
            "Keras truncates the target first, so a kill mid-save destroys the "
            "previous file; in a multi-client run every client gathers the "
            "values and one writes.",
            parameters=("filepath", "overwrite", option),
        )
        for name, option in (("save", "zipped"), ("save_weights", "max_shard_size"))
    ),
    Patch(
        "keras.src.models.model:Model",
        "load_weights",
        f"{_SAVING}:verified_load_weights",
        "A damaged file loads silently, and a load that fails partway leaves "
        "the layers before the failure overwritten.",
        parameters=("filepath",),
    ),
    *(
        Patch(
            module,
            "load_model",
            f"{_SAVING}:verified_load_model",
            "A damaged file loads silently; a cut-short .keras file is "
            "reported as 'File not found'.",
            parameters=("filepath",),
        )
        for module in ("keras.models", "keras.saving")
    ),
    *(
        Patch(
            "keras.src.callbacks.backup_and_restore:BackupAndRestore",
            name,
            f"tfmp.strategy.backups:{wrapper}",
            "Keras writes the backup's weights, then its epoch, each over the "
            "previous one: a kill between them resumes at the wrong epoch, a "
            "kill inside the weights leaves no backup.",
        )
        for name, wrapper in (("_save_model", "versioned_save"), ("_load_model", "newest_complete_load"))
    ),
    *(
        Patch(
            "keras.src.callbacks.backup_and_restore:BackupAndRestore",
            name,
            f"tfmp.strategy.backups:{wrapper}",
            why,
            parameters=parameters,
        )
        for name, wrapper, why, parameters in (
            (
                "on_train_begin",
                "armed_for_preemption",
                "A preemption notice (SIGTERM) kills the run with the work since the "
                "last backup; a backup taken mid-epoch restarts its epoch from the "
                "first batch, training on those batches twice.",
                ("logs",),
            ),
            (
                "on_epoch_begin",
                "resumed_epoch_begin",
                "A resumed run records its mid-epoch backups as epoch 0, and the "
                "resumed epoch's metrics would count only its last batches.",
                ("epoch", "logs"),
            ),
            (
                "on_train_batch_end",
                "saved_on_preemption",
                "After a SIGTERM the backup must be saved at a batch end, by every "
                "client at the same batch.",
                ("batch", "logs"),
            ),
            (
                "on_train_end",
                "disarmed",
                "The SIGTERM handler of fit must not outlive it.",
                ("logs",),
            ),
        )
    ),
    Patch(
        _TRAINER,
        "__init__",
        "tfmp.strategy.extended:made_in_scope",
        "With layout_map='auto', a custom training loop's models are laid out "
        "at the first strategy.run; the strategy learns which models it holds.",
    ),
    Patch(
        "keras.src.backend.tensorflow.numpy",
        "divide",
        "tfmp.strategy.sparse_division:whole_sparse_division",
        "RMSprop and Adagrad divide an embedding's sparse gradient "
        "by a slot in Keras' sparse division, whose tf.cond DTensor lays out "
        "differently in its two branches when the table is split: the first "
        "step stops.",
        parameters=("x1", "x2"),
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

_DISTRIBUTION = "tfmp.strategy.keras_distribution"
_BACKEND_DISTRIBUTION = "keras.src.backend.tensorflow.distribution_lib"

# Applied as tfmp is imported: a program written for `keras.distribution`
# sets its distribution before it makes any model (or strategy).
ON_IMPORT = (
    *(
        Patch(
            module,
            "set_distribution",
            f"{_DISTRIBUTION}:set_distribution_on_mesh",
            "Keras' TensorFlow backend ignores the distribution: the program "
            "would train on one device with every variable whole. The "
            "distribution's ModelParallelStrategy becomes the current strategy.",
            parameters=("value",),
        )
        # The module `Distribution.scope()` calls it from, and the public binding.
        for module in ("keras.src.distribution.distribution_lib", "keras.distribution")
    ),
    *(
        Patch(
            _BACKEND_DISTRIBUTION,
            name,
            f"{_DISTRIBUTION}:{name}",
            f"keras.distribution.{name} calls the backend's {name}, which "
            "the TensorFlow backend lacks (AttributeError).",
            kind="addition",
        )
        for name in ("distribute_tensor", "get_device_count", "initialize")
    ),
    Patch(
        "keras.src.distribution.distribution_lib:ModelParallel",
        "get_tensor_layout",
        f"{_DISTRIBUTION}:record_tensor_layout_lookups",
        "A rule that lays out a layer's output matches no variable, and would "
        "be reported as a rule that matched nothing.",
        parameters=("path",),
        kind="instance",
    ),
)

# Keras backend functions that run tfmp's rewrite while a forward pass is
# traced on a mesh: `Patch`es of kind "lowering", declared by op family in
# `tfmp.lowering` and listed with these by `tfmp.integrations.table`.
AFTER_INSTALL = ("tfmp.lowering:install",)
