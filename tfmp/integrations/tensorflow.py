"""TensorFlow and its DTensor."""

from tfmp.integrations import Patch

PACKAGE = "tensorflow"
MODULE = "tensorflow"
TESTED = ("2.21", "2.21")

PATCHES = (
    Patch(
        "tensorflow.python.framework.ops:_gradient_registry",
        "Relayout",
        "tfmp.strategy.variable:sparse_passing_relayout_gradient",
        "DTensor's Relayout gradient makes an embedding's sparse gradient dense, "
        "and Keras' optimizers update only a sparse gradient's rows.",
        parameters=("op", "grad"),
        kind="gradient",
    ),
)
