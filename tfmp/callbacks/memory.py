"""`DeviceMemoryMonitor`: what each device of the mesh holds, step by step."""

from __future__ import annotations

import os
import resource
import statistics
import warnings

import keras
import tensorflow as tf

from tfmp.inspect.display import device_ranges, format_bytes
from tfmp.inspect.summary import bytes_per_device


class DeviceMemoryMonitor(keras.callbacks.Callback):
    """Logs per-device memory: measured where TensorFlow can, derived always.

    Every `every_n_steps` training steps, and in each epoch's logs (so in
    `History` and `keras.callbacks.TensorBoard`), it records:

    - `mem/<device>/param_bytes` (derived): bytes of the parameter and
      optimizer-slot shards the device holds, from the variables' layouts;
    - `mem/<device>/optimizer_bytes` (derived): the optimizer variables' part
      of `param_bytes`;
    - `mem/<device>/current_bytes`, `mem/<device>/peak_bytes` (measured): from
      `tf.config.experimental.get_memory_info` on GPU and TPU, the peak reset
      after each reading. CPU devices have no per-device allocator, so these
      are absent there;
    - `mem/process/max_rss_bytes` (measured): the process's peak resident size.

    With `log_dir`, every reading is also written as a TensorBoard scalar at
    its training step, to the `memory` run of `log_dir` (the same directory
    as `keras.callbacks.TensorBoard` may be given): per-step curves, where the
    logs only carry one value per epoch.

    `<device>` is the short device name, such as `CPU_3` or `GPU_0`. It warns
    when a device's peak passes `warn_fraction` of its memory limit, or when
    one device holds more than `imbalance_ratio` times the mesh mean.

    Args:
        every_n_steps: Steps between readings.
        warn_fraction: Fraction of a device's memory limit that warns.
        imbalance_ratio: Ratio of a device's bytes to the mesh mean that warns.
        log_dir: A TensorBoard log directory for per-step scalars, or None.

    Examples:
        >>> monitor = tfmp.callbacks.DeviceMemoryMonitor(every_n_steps=10)
        >>> history = model.fit(x, y, callbacks=[monitor], verbose=0)
        >>> history.history["mem/CPU_0/param_bytes"]
        [...]
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        warn_fraction: float = 0.9,
        imbalance_ratio: float = 1.5,
        log_dir: str | os.PathLike | None = None,
    ):
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps}: must be at least 1.")
        self.every_n_steps = every_n_steps
        self.warn_fraction = warn_fraction
        self.imbalance_ratio = imbalance_ratio
        self.log_dir = log_dir
        self._writer: tf.summary.SummaryWriter | None = None
        self.latest: dict[str, float] = {}
        self._steps = 0
        self._param_bytes: dict[str, int] = {}
        self._optimizer_bytes: dict[str, int] = {}
        self._warned: set[str] = set()

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._param_bytes = {}
        if self.log_dir is not None and self._writer is None:
            self._writer = tf.summary.create_file_writer(os.path.join(self.log_dir, "memory"))
        self._read()

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._writer is not None:
            self._writer.flush()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._steps += 1
        if self._steps % self.every_n_steps == 0:
            self._read()
            if logs is not None:
                logs.update(self.latest)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._read()
        if logs is not None:
            logs.update(self.latest)

    def _read(self) -> None:
        optimizer = self.model.optimizer
        if not self._param_bytes and optimizer is not None and optimizer.built:
            # Computed once, from the layouts: they do not change while training.
            per_device = bytes_per_device(self.model)
            self._param_bytes = {device: kinds["total"] for device, kinds in per_device.items()}
            self._optimizer_bytes = {
                device: kinds["optimizer"] for device, kinds in per_device.items()
            }
        for device, size in self._param_bytes.items():
            self.latest[f"mem/{short_name(device)}/param_bytes"] = float(size)
            self.latest[f"mem/{short_name(device)}/optimizer_bytes"] = float(
                self._optimizer_bytes[device]
            )
        for device in self._param_bytes:
            info = _memory_info(device)
            if info is None:
                continue
            name = short_name(device)
            self.latest[f"mem/{name}/current_bytes"] = float(info["current"])
            self.latest[f"mem/{name}/peak_bytes"] = float(info["peak"])
            tf.config.experimental.reset_memory_stats(device)
            self._check_limit(device, info["peak"])
        self.latest["mem/process/max_rss_bytes"] = float(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
        self._check_balance()
        if self._writer is not None:
            with self._writer.as_default(step=self._steps):
                for key, value in self.latest.items():
                    tf.summary.scalar(key, value)

    def _check_limit(self, device: str, peak: int) -> None:
        limit = _memory_limit(device)
        if limit and peak > self.warn_fraction * limit and device not in self._warned:
            self._warned.add(device)
            warnings.warn(
                f"tfmp: {device_ranges([device])} peaked at {format_bytes(peak)}, over "
                f"{self.warn_fraction:.0%} of its {format_bytes(limit)} limit. Split more "
                "weights over the mesh or lower the batch size before it runs out of memory.",
                stacklevel=2,
            )

    def _check_balance(self) -> None:
        if len(self._param_bytes) < 2 or "imbalance" in self._warned:
            return
        mean = statistics.mean(self._param_bytes.values())
        device, largest = max(self._param_bytes.items(), key=lambda item: item[1])
        if mean and largest > self.imbalance_ratio * mean:
            self._warned.add("imbalance")
            warnings.warn(
                f"tfmp: {device_ranges([device])} holds {format_bytes(largest)} of parameters "
                f"and optimizer slots, {largest / mean:.1f}x the mesh mean of "
                f"{format_bytes(mean)}. See tfmp.summary(model) for which variables are "
                "not split.",
                stacklevel=2,
            )


def short_name(device: str) -> str:
    """`/job:localhost/replica:0/task:0/device:CPU:3` -> `CPU_3` (task > 0 kept)."""
    spec = tf.DeviceSpec.from_string(device)
    task = f"task{spec.task}_" if spec.task else ""
    return f"{task}{spec.device_type}_{spec.device_index}"


def _memory_info(device: str) -> dict | None:
    if tf.DeviceSpec.from_string(device).device_type == "CPU":
        return None  # no per-device allocator on CPU
    try:
        return tf.config.experimental.get_memory_info(device)
    except (ValueError, tf.errors.InvalidArgumentError):
        return None


def _memory_limit(device: str) -> int | None:
    """The memory limit given to a logical device, in bytes, if one was set."""
    spec = tf.DeviceSpec.from_string(device)
    physical = tf.config.list_physical_devices(spec.device_type)
    configs = tf.config.get_logical_device_configuration(physical[0]) if physical else None
    if not configs or spec.device_index >= len(configs):
        return None
    limit_mb = configs[spec.device_index].memory_limit
    return limit_mb * 1024 * 1024 if limit_mb else None
