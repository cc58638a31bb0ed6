"""Keras callbacks that watch a parallel model: memory and gradient sync."""

from tfmp.callbacks.gradient_sync import GradientSyncMonitor
from tfmp.callbacks.memory import DeviceMemoryMonitor

__all__ = ["DeviceMemoryMonitor", "GradientSyncMonitor"]
