"""`tfmp.plot_memory`: per-device memory as a picture, so imbalance is seen."""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import tensorflow as tf

_KEY = re.compile(r"^(?:epoch_)?mem/(?P<device>[^/]+)/(?P<figure>\w+)_bytes$")


def plot_memory(history_or_logdir: Any, path: str) -> str:
    """Draws `DeviceMemoryMonitor`'s figures to a PNG.

    Left: each device's memory over epochs (measured peaks where present,
    else the parameter and slot shard bytes). Right: a bar per device of its
    parameter and slot shard bytes, so one overloaded device stands out.

    Args:
        history_or_logdir: A `keras.callbacks.History`, its `.history` dict, or
            a `keras.callbacks.TensorBoard` log directory.
        path: Where to write the PNG.

    Returns:
        `path`.

    Raises:
        ValueError: If no `mem/...` figures are found.
        ImportError: If matplotlib is missing (`pip install "tfmp[plot]"`).

    Example:

    >>> history = model.fit(x, y, callbacks=[tfmp.callbacks.DeviceMemoryMonitor()])  # doctest: +SKIP
    >>> tfmp.plot_memory(history, "memory.png")  # doctest: +SKIP
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError as error:
        raise ImportError(
            'tfmp.plot_memory needs matplotlib: pip install "tfmp[plot]".'
        ) from error
    series = _memory_series(history_or_logdir)
    if not series:
        raise ValueError(
            f"No mem/<device>/..._bytes figures in {history_or_logdir!r}: train with "
            "tfmp.callbacks.DeviceMemoryMonitor among the callbacks first."
        )
    devices = sorted({device for device, _ in series if device != "process"})
    figure, (over_time, per_device) = pyplot.subplots(1, 2, figsize=(12, 4.5))
    for device in devices:
        figure_name = "peak" if (device, "peak") in series else "param"
        values = series[device, figure_name]
        over_time.plot(
            range(1, len(values) + 1), values, marker="o", label=f"{device} ({figure_name})"
        )
    over_time.set(xlabel="epoch", ylabel="bytes", title="memory per device")
    over_time.legend(fontsize="small")
    shard_bytes = [series.get((device, "param"), [0])[-1] for device in devices]
    per_device.bar(devices, shard_bytes)
    per_device.set(ylabel="bytes", title="parameter + optimizer shard bytes")
    per_device.tick_params(axis="x", rotation=45)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
    return path


def _memory_series(source: Any) -> dict[tuple[str, str], list[float]]:
    if isinstance(source, (str, os.PathLike)):
        history = _read_logdir(str(source))
    else:
        history = getattr(source, "history", source)
    series = {}
    for key, values in history.items():
        match = _KEY.match(key)
        if match:
            series[match["device"], match["figure"]] = [float(v) for v in values]
    return series


def _read_logdir(logdir: str) -> dict[str, list[float]]:
    """The memory scalars of a TensorBoard log directory's train run, in step order."""
    points: dict[str, dict[int, float]] = {}
    pattern = os.path.join(logdir, "train", "events.out.tfevents.*")
    for event_file in sorted(glob.glob(pattern)):
        for record in tf.data.TFRecordDataset(event_file):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if not _KEY.match(value.tag):
                    continue
                number = (
                    tf.make_ndarray(value.tensor)
                    if value.HasField("tensor")
                    else value.simple_value
                )
                points.setdefault(value.tag, {})[event.step] = float(number)
    return {tag: [steps[s] for s in sorted(steps)] for tag, steps in points.items()}
