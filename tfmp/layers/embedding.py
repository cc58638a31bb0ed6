"""An Embedding whose table is split over the vocabulary."""

from __future__ import annotations

from typing import Any

import keras

from tfmp.layers.declaring import DeclaresLayouts
from tfmp.layout import Axes


@keras.saving.register_keras_serializable(package="tfmp")
class VocabParallelEmbedding(DeclaresLayouts, keras.layers.Embedding):
    """`keras.layers.Embedding` whose table is split on the vocabulary.

    Each device of `axis` stores `input_dim / axis size` rows of the table (and
    of the optimizer slots).

    Args:
        input_dim: Vocabulary size, as `keras.layers.Embedding`.
        output_dim: Embedding width.
        axis: The mesh axis to split the vocabulary over.
        **kwargs: Any other `keras.layers.Embedding` argument.

    Example:

    >>> import tfmp
    >>> embed = tfmp.layers.VocabParallelEmbedding(8192, 512, axis="model")
    """

    def __init__(self, input_dim: int, output_dim: int, axis: str = "model", **kwargs: Any):
        super().__init__(input_dim, output_dim, **kwargs)
        self.axis = axis

    def weight_layouts(self) -> dict[str, Axes]:
        return {"embeddings": (self.axis, None)}

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "axis": self.axis}
