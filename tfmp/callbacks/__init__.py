"""Keras callbacks that watch a parallel model: memory and gradient sync."""

from tfmp.callbacks.gradient_sync import GradientSyncMonitor
from tfmp.callbacks.memory import DeviceMemoryMonitor
from tfmp.callbacks.plot import plot_memory

__all__ = ["DeviceMemoryMonitor", "GradientSyncMonitor", "plot_memory"]
