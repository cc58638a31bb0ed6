"""Multi-head attention split over heads."""

from __future__ import annotations

from typing import Any

import keras

from tfmp.layers.declaring import DeclaresLayouts
from tfmp.layout import Axes


@keras.saving.register_keras_serializable(package="tfmp")
class ParallelMultiHeadAttention(DeclaresLayouts, keras.layers.MultiHeadAttention):
    """`keras.layers.MultiHeadAttention` with its heads split over a mesh axis.

    The query, key and value projections are split on heads (column-parallel),
    so each device attends with its own heads; the output projection is split
    on heads too (row-parallel), so one all-reduce forms the output. `num_heads`
    must divide by the size of `axis` to be split.

    Args:
        num_heads: As `keras.layers.MultiHeadAttention`.
        key_dim: As `keras.layers.MultiHeadAttention`.
        axis: The mesh axis to split heads over.
        **kwargs: Any other `keras.layers.MultiHeadAttention` argument.

    Example:

    >>> import tfmp
    >>> attention = tfmp.layers.ParallelMultiHeadAttention(8, 64, axis="model")
    """

    def __init__(self, num_heads: int, key_dim: int, axis: str = "model", **kwargs: Any):
        super().__init__(num_heads, key_dim, **kwargs)
        self.axis = axis

    def weight_layouts(self) -> dict[str, Axes]:
        heads = (None, self.axis, None)
        head_biases = (self.axis, None)
        return {
            "query/kernel": heads,
            "key/kernel": heads,
            "value/kernel": heads,
            "query/bias": head_biases,
            "key/bias": head_biases,
            "value/bias": head_biases,
            "attention_output/kernel": (self.axis, None, None),
        }

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "axis": self.axis}
