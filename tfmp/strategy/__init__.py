"""The DTensor-backed `tf.distribute.Strategy` and its parts."""

from tfmp.strategy import patches  # noqa: F401  (declares the strategy's patches)
from tfmp.strategy.strategy import ModelParallelStrategy
from tfmp.strategy.variable import MeshVariable

__all__ = ["MeshVariable", "ModelParallelStrategy"]
