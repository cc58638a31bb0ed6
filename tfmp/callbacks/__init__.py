"""Keras callbacks that watch a parallel model: memory, gradient sync and input order."""

from tfmp.callbacks.gradient_sync import GradientSyncMonitor
from tfmp.callbacks.input_order import InputOrderCheck
from tfmp.callbacks.memory import DeviceMemoryMonitor
from tfmp.callbacks.plot import plot_memory

__all__ = ["DeviceMemoryMonitor", "GradientSyncMonitor", "InputOrderCheck", "plot_memory"]
