"""tf_keras (Keras 2, under TF Model Garden): step functions and legacy optimizers."""

from tfmp.integrations import Patch

PACKAGE = "tf-keras"
MODULE = "tf_keras"
TESTED = ("2.21", "2.21")

_HOOKS = "tfmp.strategy.tf_keras_hooks"

PATCHES = (
    *(
        Patch(
            "tf_keras:Model",
            name,
            f"{_HOOKS}:fed_batches",
            "tf_keras reads batches inside its step function, where tfmp's "
            "host-read batches would be traced once as constants.",
            parameters=("force",),
        )
        for name in ("make_train_function", "make_test_function", "make_predict_function")
    ),
    Patch(
        "tf_keras.optimizers.legacy:Optimizer",
        "apply_gradients",
        f"{_HOOKS}:dense_gradients",
        "Legacy optimizers apply sparse gradients with scatters and sparse "
        "kernels DTensor cannot lay out.",
        parameters=("grads_and_vars",),
    ),
)
