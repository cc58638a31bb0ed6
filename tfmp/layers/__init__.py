"""Keras layers that know how their weights are split over a mesh axis."""

from tfmp.layers.attention import ParallelMultiHeadAttention
from tfmp.layers.conv import ParallelConv2D
from tfmp.layers.dense import ColumnParallelDense, RowParallelDense
from tfmp.layers.embedding import VocabParallelEmbedding
from tfmp.layers.experts import MixtureOfExperts
from tfmp.layers.sharded import Sharded
from tfmp.pipeline.layer_group import LayerGroup

__all__ = [
    "ColumnParallelDense",
    "LayerGroup",
    "MixtureOfExperts",
    "ParallelConv2D",
    "ParallelMultiHeadAttention",
    "RowParallelDense",
    "Sharded",
    "VocabParallelEmbedding",
]
