"""TensorFlow and its DTensor."""

from tfmp.integrations import Patch

PACKAGE = "tensorflow"
MODULE = "tensorflow"
TESTED = ("2.21", "2.21")

PATCHES = (
    Patch(
        "tensorflow.python.eager.context:Context",
        "call_function",
        "tfmp.strategy.watchdog:watched_function_call",
        "A custom loop's steps are calls of the user's tf.function, which no "
        "callback sees: a client stuck between them would hang the others "
        "without a word.",
        parameters=("name", "tensor_inputs", "num_outputs"),
    ),
    Patch(
        "tensorflow.python.framework.ops:_gradient_registry",
        "Relayout",
        "tfmp.strategy.variable:sparse_passing_relayout_gradient",
        "DTensor's Relayout gradient makes an embedding's sparse gradient dense, "
        "and Keras' optimizers update only a sparse gradient's rows.",
        parameters=("op", "grad"),
        kind="gradient",
    ),
    Patch(
        "tensorflow.python.ops.gen_math_ops",
        "unsorted_segment_sum",
        "tfmp.strategy.sparse_division:whole_rows_segment_sum",
        "Adadelta, RMSprop with momentum and Adafactor sum the rows of Keras' "
        "sparse division (a number known only at run time) into a split "
        "table-sized tensor, whose split DTensor pushes back onto those rows "
        "and cannot cut: the first step stops.",
        parameters=("data", "segment_ids", "num_segments", "name"),
    ),
    Patch(
        "tensorflow.python.framework.func_graph:FuncGraph",
        "capture",
        "tfmp.strategy.keras_hooks:mesh_captures",
        "A step that uses a host tensor made outside it (a constant a model "
        "holds) gets it as an input, and DTensor refuses host inputs.",
        parameters=("tensor", "name", "shape"),
    ),
    Patch(
        "tensorflow.python.ops.tensor_array_ops:TensorArray",
        "__init__",
        "tfmp.lowering.rnn:list_backed_tensor_arrays",
        "A TensorArray filled in a Python loop (RWKV-7) runs TensorList ops, "
        "which DTensor cannot lay out.",
        parameters=("dtype", "size", "dynamic_size", "handle", "flow"),
    ),
    Patch(
        "tensorflow",
        "gather_nd",
        "tfmp.lowering.indexing:gather_nd_on_index_lists",
        "Indices of rank 7 (SAM3's ROI align) crash the process in the "
        "gradient of the step's gather on a mesh.",
        parameters=("params", "indices", "batch_dims", "name"),
    ),
    Patch(
        "tensorflow",
        "gather",
        "tfmp.lowering.indexing:gather_with_batch_dims_from_the_front",
        "A negative batch_dims crashes the process when DTensor expands "
        "the step's gather.",
        parameters=("params", "indices", "validate_indices", "axis", "batch_dims", "name"),
    ),
    Patch(
        "tensorflow",
        "one_hot",
        "tfmp.lowering.indexing:one_hot_by_comparison",
        "DTensor's OneHot expansion fails when layout propagation splits the "
        "class dimension (a one-hot mask multiplied with a split activation).",
        parameters=("indices", "depth", "on_value", "off_value", "axis", "dtype", "name"),
    ),
    Patch(
        "tensorflow",
        "concat",
        "tfmp.lowering.joins:concat_kept_whole_on_axis",
        "DTensor concatenates shards when layout propagation splits the "
        "joined dimension: wrong values silently for axis=-1 "
        "(keras.layers.Concatenate before a row-parallel Dense).",
        parameters=("values", "axis", "name"),
    ),
    Patch(
        "tensorflow",
        "stack",
        "tfmp.lowering.joins:stack_kept_whole_on_axis",
        "DTensor's Pack gives shards of the wrong size when layout "
        "propagation splits the new dimension (a loop over the batch).",
        parameters=("values", "axis", "name"),
    ),
    Patch(
        "tensorflow",
        "unstack",
        "tfmp.lowering.joins:unstack_whole_axis",
        "DTensor's Unpack gives shards of the wrong size when the unstacked "
        "dimension is split (SAM3's box coordinates).",
        parameters=("value", "num", "axis", "name"),
    ),
    *(
        Patch(
            "tensorflow.python.ops.gen_random_ops",
            kernel,
            f"tfmp.lowering.random:{wrapper}",
            "DTensor refuses stateful random ops (tf.random.normal in a VAE's "
            "sampling layer, a GAN's latent vectors in its train_step): on a "
            f"mesh they draw from stateless ops, {matching}.",
            parameters=parameters,
        )
        for kernel, wrapper, matching, parameters in (
            *(
                (
                    kernel,
                    "stateless_on_mesh",
                    "the numbers one device draws",
                    ("shape", "dtype", "seed", "seed2", "name"),
                )
                for kernel in ("random_standard_normal", "random_uniform", "truncated_normal")
            ),
            (
                "random_uniform_int",
                "stateless_int_on_mesh",
                "the numbers one device draws",
                ("shape", "minval", "maxval", "seed", "seed2", "name"),
            ),
            (
                "random_gamma",
                "stateless_gamma_on_mesh",
                "the numbers one device draws",
                ("shape", "alpha", "seed", "seed2", "name"),
            ),
            (
                "random_poisson_v2",
                "replicated_poisson_on_mesh",
                "the same numbers on every device, like one device's in distribution",
                ("shape", "rate", "seed", "seed2", "dtype", "name"),
            ),
            (
                "random_shuffle",
                "shuffled_on_mesh",
                "a permutation like one device's in distribution",
                ("value", "seed", "seed2", "name"),
            ),
            (
                "multinomial",
                "gumbel_categorical_on_mesh",
                "samples like one device's in distribution",
                ("logits", "num_samples", "seed", "seed2", "output_dtype", "name"),
            ),
        )
    ),
)
