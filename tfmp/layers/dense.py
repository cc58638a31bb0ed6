"""Column- and row-parallel Dense layers (Megatron-LM's split of an MLP)."""

from __future__ import annotations

from typing import Any

import keras

from tfmp.layers.declaring import DeclaresLayouts
from tfmp.layout import Axes


@keras.saving.register_keras_serializable(package="tfmp")
class ColumnParallelDense(DeclaresLayouts, keras.layers.Dense):
    """`keras.layers.Dense` whose kernel is split on its output dimension.

    Each device of `axis` computes a slice of the outputs; no communication
    forward. Follow it with a `RowParallelDense` to consume the split outputs.

    Args:
        units: As `keras.layers.Dense`.
        axis: The mesh axis to split over.
        **kwargs: Any other `keras.layers.Dense` argument.

    Examples:
        >>> import keras, tfmp
        >>> mlp = keras.Sequential([
        ...     keras.Input((16,)),
        ...     tfmp.layers.ColumnParallelDense(64, activation="relu"),
        ...     tfmp.layers.RowParallelDense(16),
        ... ])
    """

    def __init__(self, units: int, axis: str = "model", **kwargs: Any):
        super().__init__(units, axis=axis, **kwargs)

    def weight_layouts(self) -> dict[str, Axes]:
        return {"kernel": (None, self.axis), "bias": (self.axis,)}



@keras.saving.register_keras_serializable(package="tfmp")
class RowParallelDense(DeclaresLayouts, keras.layers.Dense):
    """`keras.layers.Dense` whose kernel is split on its input dimension.

    Each device multiplies its slice of the inputs by its rows of the kernel;
    the partial outputs are summed across `axis` (one all-reduce, inserted by
    DTensor). The bias is replicated and added once.

    Args:
        units: As `keras.layers.Dense`.
        axis: The mesh axis to split over.
        **kwargs: Any other `keras.layers.Dense` argument.

    Examples:
        >>> import tfmp
        >>> layer = tfmp.layers.RowParallelDense(16, axis="model")
    """

    def __init__(self, units: int, axis: str = "model", **kwargs: Any):
        super().__init__(units, axis=axis, **kwargs)

    def weight_layouts(self) -> dict[str, Axes]:
        return {"kernel": (self.axis, None)}

