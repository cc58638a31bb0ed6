"""The DTensor-backed `tf.distribute.Strategy` and its parts."""

from tfmp.strategy.strategy import ModelParallelStrategy
from tfmp.strategy.variable import MeshVariable

__all__ = ["MeshVariable", "ModelParallelStrategy"]
