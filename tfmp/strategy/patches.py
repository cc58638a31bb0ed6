"""What the strategy changes in Keras, TensorFlow, tf_keras and Orbit.

The strategy's patches, declared with `tfmp.integrations` (which applies
them when the first `ModelParallelStrategy` is made, and takes them back
when the last one is gone); `python -m tfmp.integrations.table --markdown`
lists them with everyone else's.
"""

from tfmp import integrations
from tfmp.integrations import Patch
from tfmp.strategy import (
    backups,
    custom_gradients,
    epoch_iterator,
    errors,
    extended,
    grappler,
    keras_distribution,
    keras_hooks,
    orbit_loops,
    saving,
    sparse_division,
    steps_per_call,
    summaries,
    tf_keras_hooks,
    variable,
    variable_handles,
    watchdog,
)

_TRAINER = "keras.src.backend.tensorflow.trainer:TensorFlowTrainer"

KERAS = (
    Patch(
        "keras.src.layers.layer:Layer",
        "__call__",
        keras_hooks.eager_call,
        "DTensor refuses host arrays next to mesh variables in `model(x)`, and "
        "tfmp's lowerings need to know which mesh a forward pass is traced on.",
    ),
    *(
        Patch(
            _TRAINER,
            name,
            keras_hooks.on_batch,
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
            keras_hooks.prepared,
            "`layout_map='auto'` lays out the model at its first fit; DTensor's "
            "errors become ValueErrors naming the layer.",
        )
        for name in ("fit", "evaluate", "predict")
    ),
    Patch(
        "keras.src.optimizers.base_optimizer:BaseOptimizer",
        "build",
        keras_hooks.laid_out_before_slots,
        "With layout_map='auto', an optimizer built before the first step "
        "(load_model of a compiled model, a checkpoint restored into a custom "
        "loop) would index the model's variables and make their slots before "
        "tfmp lays the model out.",
        parameters=("variables",),
    ),
    Patch(
        "keras.src.trainers.trainer:Trainer",
        "compile",
        keras_hooks.compiled_in_its_scope,
        "A model made outside the strategy's scope and compiled inside it "
        "passes compile, and fit stops with 'Need to be inside strategy.scope()', "
        "which does not say the model is the problem.",
        parameters=("optimizer", "loss"),
    ),
    Patch(
        "keras.src.trainers.trainer:Trainer",
        "_symbolic_build",
        keras_hooks.built_without_call,
        "Under any strategy Keras builds a model by calling `call()`, which a "
        "GAN or VAE with its own `train_step` does not have: fit stops.",
        parameters=("iterator", "data_batch"),
    ),
    Patch(
        "keras.src.backend.tensorflow.trainer",
        "TFEpochIterator",
        epoch_iterator.read_once,
        "Under a strategy Keras reads a batch to build the model and opens the "
        "epoch again, and the mesh's iterators read ahead: a shuffle would start "
        "another pass, a generator lose a batch, so steps saw other rows than "
        "on one device.",
        parameters=("distribute_strategy",),
    ),
    Patch(
        "keras.src.trainers.compile_utils:CompileLoss",
        "call",
        epoch_iterator.loss_trackers_weighted_as_on_one_device,
        "Each output's loss is logged weighed by the static batch size of the "
        "step's trace, which on a mesh is known for whole batches and unknown "
        "for a last one that does not divide the batch axis: other logs than "
        "on one device.",
        parameters=("y_true", "y_pred", "sample_weight"),
    ),
    Patch(
        _TRAINER,
        "_make_function",
        steps_per_call.steps_per_call,
        "steps_per_execution=k runs k steps in one function call: Keras calls "
        "its one-step function k times for a dataset it cannot loop over in a graph.",
        parameters=("step_function",),
    ),
    *(
        Patch(
            "keras.src.models.model:Model",
            name,
            saving.chief_writes,
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
        saving.verified_load_weights,
        "A damaged file loads silently, and a load that fails partway leaves "
        "the layers before the failure overwritten.",
        parameters=("filepath",),
    ),
    *(
        Patch(
            module,
            "load_model",
            saving.verified_load_model,
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
            wrapper,
            "Keras writes the backup's weights, then its epoch, each over the "
            "previous one: a kill between them resumes at the wrong epoch, a "
            "kill inside the weights leaves no backup.",
        )
        for name, wrapper in (("_save_model", backups.versioned_save), ("_load_model", backups.newest_complete_load))
    ),
    *(
        Patch(
            "keras.src.callbacks.backup_and_restore:BackupAndRestore",
            name,
            wrapper,
            why,
            parameters=parameters,
        )
        for name, wrapper, why, parameters in (
            (
                "on_train_begin",
                backups.armed_for_preemption,
                "A preemption notice (SIGTERM) kills the run with the work since the "
                "last backup; a backup taken mid-epoch restarts its epoch from the "
                "first batch, training on those batches twice.",
                ("logs",),
            ),
            (
                "on_epoch_begin",
                backups.resumed_epoch_begin,
                "A resumed run records its mid-epoch backups as epoch 0, and the "
                "resumed epoch's metrics would count only its last batches.",
                ("epoch", "logs"),
            ),
            (
                "on_train_batch_end",
                backups.saved_on_preemption,
                "After a SIGTERM the backup must be saved at a batch end, by every "
                "client at the same batch.",
                ("batch", "logs"),
            ),
            (
                "on_train_end",
                backups.disarmed,
                "The SIGTERM handler of fit must not outlive it.",
                ("logs",),
            ),
        )
    ),
    Patch(
        _TRAINER,
        "__init__",
        extended.made_in_scope,
        "With layout_map='auto', a custom training loop's models are laid out "
        "at the first strategy.run; the strategy learns which models it holds.",
    ),
    Patch(
        "keras.src.backend.tensorflow.numpy",
        "divide",
        sparse_division.whole_sparse_division,
        "RMSprop and Adagrad divide an embedding's sparse gradient "
        "by a slot in Keras' sparse division, whose tf.cond DTensor lays out "
        "differently in its two branches when the table is split: the first "
        "step stops.",
        parameters=("x1", "x2"),
    ),
    Patch(
        "keras.src.backend.tensorflow.core:Variable",
        "_initialize",
        keras_hooks.announced,
        "The strategy's variable creator learns which Keras variable it makes "
        "(path, layer), to find its layout.",
        parameters=("value",),
    ),
    Patch(
        "keras.src.backend.tensorflow.core:Variable",
        "_value",
        extended.ModelParallelExtended,
        "A variable moves to a pipeline stage's mesh, or to the layout "
        "layout_map='auto' planned, after Keras made it.",
        kind="instance",
    ),
    Patch(
        "keras.src.backend.tensorflow.optimizer:TFOptimizer",
        "_distribution_strategy",
        extended.ModelParallelExtended,
        "An optimizer made outside the strategy's scope keeps the strategy "
        "current then, and would make its slots and updates off the mesh.",
        kind="instance",
    ),
)


# Applied as tfmp is imported: a program written for `keras.distribution`
# sets its distribution before it makes any model (or strategy).
_BACKEND_DISTRIBUTION = "keras.src.backend.tensorflow.distribution_lib"

KERAS_ON_IMPORT = (
    *(
        Patch(
            module,
            "set_distribution",
            keras_distribution.set_distribution_on_mesh,
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
            addition.__name__,
            addition,
            f"keras.distribution.{addition.__name__} calls the backend's "
            f"{addition.__name__}, which the TensorFlow backend lacks (AttributeError).",
            kind="addition",
        )
        for addition in (
            keras_distribution.distribute_tensor,
            keras_distribution.get_device_count,
            keras_distribution.initialize,
        )
    ),
    Patch(
        "keras.src.distribution.distribution_lib:ModelParallel",
        "get_tensor_layout",
        keras_distribution.record_tensor_layout_lookups,
        "A rule that lays out a layer's output matches no variable, and would "
        "be reported as a rule that matched nothing.",
        parameters=("path",),
        kind="instance",
    ),
)

TENSORFLOW = (
    *(
        Patch(
            "tensorflow.python.ops.gen_summary_ops",
            name,
            summaries.written_from_host,
            "DTensor queues an eager op on the mesh, and a host summary writer's "
            "flush and deletion run at once: a scalar of a mesh loss written just "
            "before Orbit or Keras dropped its writer failed ('SummaryWriterInterface "
            "does not exist') and poisoned every later op.",
            parameters=("writer", "step", "tensor"),
        )
        for name in ("write_summary", "write_raw_proto_summary")
    ),
    *(
        Patch(
            "tensorflow.summary",
            name,
            summaries.computed_from_host,
            "TensorBoard computes a histogram, image or audio summary from its "
            "data next to host tensors, which DTensor refuses for mesh data: "
            "Keras' TensorBoard(histogram_freq=1) stopped at the first epoch's end.",
            parameters=("name", "data"),
        )
        for name in ("histogram", "image", "audio")
    ),
    Patch(
        "tensorflow.python.eager.context:Context",
        "call_function",
        watchdog.watched_function_call,
        "A custom loop's steps are calls of the user's tf.function, which no "
        "callback sees: a client stuck between them would hang the others "
        "without a word.",
        parameters=("name", "tensor_inputs", "num_outputs"),
    ),
    Patch(
        "tensorflow.python.framework.ops:_gradient_registry",
        "Relayout",
        variable.sparse_passing_relayout_gradient,
        "DTensor's Relayout gradient makes an embedding's sparse gradient dense, "
        "and Keras' optimizers update only a sparse gradient's rows.",
        parameters=("op", "grad"),
        kind="gradient",
    ),
    Patch(
        "tensorflow.python.ops.gen_resource_variable_ops",
        "var_handle_op",
        variable_handles.shared_mesh_handle_ops,
        "DTensor lays out each eager op anew for another debug_name attribute, which "
        "TensorFlow sets to the variable's name: every variable and optimizer slot "
        "made on a mesh was laid out anew (2.3 s of a ResNet's first step for its Adam slots).",
        parameters=("debug_name",),
    ),
    Patch(
        "tensorflow.python.eager.polymorphic_function.atomic_function:AtomicFunction",
        "call_flat",
        grappler.mesh_calls_without_grappler,
        "DTensor leaves a whole variable's shape on each device's shard, and "
        "Grappler rewrites the per-device graphs by it: a masked SimpleRNN's "
        "zeros_like was folded 4 times too wide and its step stopped ('Matrix "
        "size-incompatible'), where a broadcast would have computed wrong values.",
    ),
    Patch(
        "tensorflow.python.ops.gen_math_ops",
        "unsorted_segment_sum",
        sparse_division.whole_rows_segment_sum,
        "Adadelta, RMSprop with momentum and Adafactor sum the rows of Keras' "
        "sparse division (a number known only at run time) into a split "
        "table-sized tensor, whose split DTensor pushes back onto those rows "
        "and cannot cut: the first step stops.",
        parameters=("data", "segment_ids", "num_segments", "name"),
    ),
    Patch(
        "tensorflow.python.framework.error_interpolation",
        "parse_message",
        errors.tags_found_in_one_pass,
        "TensorFlow parses every function error's message in time quadratic in "
        "its length before anyone sees the error: a DTensor expansion error "
        "carrying a 421,000-character module held fit silent for over 15 minutes.",
        parameters=("message",),
    ),
    Patch(
        "tensorflow.python.ops.custom_gradient",
        "_graph_mode_decorator",
        custom_gradients.released_with_graph,
        "A traced tf.custom_gradient stays in TensorFlow's gradient registry "
        "for good, with the graph it closes over: tfmp's lowerings put custom "
        "gradients in every step on a mesh, so each model trained kept its "
        "steps' graphs after it was gone (the test suite's workers reached 13 GB).",
        parameters=("f", "args", "kwargs"),
    ),
    Patch(
        "tensorflow.python.framework.func_graph:FuncGraph",
        "capture",
        keras_hooks.mesh_captures,
        "A step that uses a host tensor made outside it (a constant a model "
        "holds) gets it as an input, and DTensor refuses host inputs.",
        parameters=("tensor", "name", "shape"),
    ),
)

TF_KERAS = (
    *(
        Patch(
            "tf_keras:Model",
            name,
            tf_keras_hooks.fed_batches,
            "tf_keras reads batches inside its step function, where tfmp's "
            "host-read batches would be traced once as constants.",
            parameters=("force",),
        )
        for name in ("make_train_function", "make_test_function", "make_predict_function")
    ),
    Patch(
        "tf_keras.optimizers.legacy:Optimizer",
        "apply_gradients",
        tf_keras_hooks.dense_gradients,
        "Legacy optimizers apply sparse gradients with scatters and sparse "
        "kernels DTensor cannot lay out.",
        parameters=("grads_and_vars",),
    ),
)

ORBIT = tuple(
    Patch(
        f"orbit:{runner}",
        factory,
        wrapper,
        "Orbit reads batches inside its compiled step or tf.while_loop, where "
        "tfmp's host-read batches would be traced once as constants.",
    )
    for runner, factory, wrapper in (
        ("StandardTrainer", "create_train_loop_fn", orbit_loops.fed_train_loop),
        ("StandardEvaluator", "create_eval_loop_fn", orbit_loops.fed_eval_loop),
    )
)

integrations.declare(__name__, (*TENSORFLOW, *KERAS, *TF_KERAS, *ORBIT))
integrations.declare(__name__, KERAS_ON_IMPORT, on_import=True)
