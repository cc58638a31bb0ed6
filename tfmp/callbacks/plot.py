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

    Left: each device's memory (measured peaks where present, else the
    parameter and slot shard bytes) over epochs, or over training steps when
    read from a log directory that `DeviceMemoryMonitor(log_dir=...)` wrote. Right: a bar per device of its
    parameter and slot shard bytes, so one overloaded device stands out.

    Args:
        history_or_logdir: A `keras.callbacks.History`, its `.history` dict, or
            a log directory of `DeviceMemoryMonitor(log_dir=...)` or of
            `keras.callbacks.TensorBoard`.
        path: Where to write the PNG.

    Returns:
        `path`.

    Raises:
        ValueError: If no `mem/...` figures are found.
        ImportError: If matplotlib is missing (`pip install "tfmp[plot]"`).

    Examples:
        >>> history = model.fit(x, y, callbacks=[tfmp.callbacks.DeviceMemoryMonitor()], verbose=0)
        >>> tfmp.plot_memory(history, "memory.png")
        'memory.png'
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError as error:
        raise ImportError(
            'tfmp.plot_memory needs matplotlib: pip install "tfmp[plot]".'
        ) from error
    series, x_label = _memory_series(history_or_logdir)
    if not series:
        raise ValueError(
            f"No mem/<device>/..._bytes figures in {history_or_logdir!r}: train with "
            "tfmp.callbacks.DeviceMemoryMonitor among the callbacks first."
        )
    devices = sorted({device for device, _ in series if device != "process"})
    figure, (over_time, per_device) = pyplot.subplots(1, 2, figsize=(12, 4.5))
    for device in devices:
        figure_name = "peak" if (device, "peak") in series else "param"
        steps, values = series[device, figure_name]
        over_time.plot(steps, values, marker="o", label=f"{device} ({figure_name})")
    over_time.set(xlabel=x_label, ylabel="bytes", title="memory per device")
    over_time.legend(fontsize="small")
    shard_bytes = [series.get((device, "param"), ([], [0]))[1][-1] for device in devices]
    per_device.bar(devices, shard_bytes)
    per_device.set(ylabel="bytes", title="parameter + optimizer shard bytes")
    per_device.tick_params(axis="x", rotation=45)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
    return path


def _memory_series(source: Any) -> tuple[dict[tuple[str, str], tuple[list, list]], str]:
    """(device, figure) -> (steps, values), and what the steps count."""
    if isinstance(source, (str, os.PathLike)):
        points, x_label = _read_logdir(str(source))
    else:
        history = getattr(source, "history", source)
        points = {key: dict(enumerate(values, start=1)) for key, values in history.items()}
        x_label = "epoch"
    series = {}
    for key, by_step in points.items():
        match = _KEY.match(key)
        if match:
            steps = sorted(by_step)
            series[match["device"], match["figure"]] = (steps, [float(by_step[s]) for s in steps])
    return series, x_label


def _read_logdir(logdir: str) -> tuple[dict[str, dict[int, float]], str]:
    """Memory scalars by tag and step: the monitor's per-step `memory` run if
    there is one, else the epoch figures of `TensorBoard`'s `train` run."""
    for run, x_label in (("memory", "step"), ("train", "epoch")):
        points = _read_run(os.path.join(logdir, run))
        if points:
            return points, x_label
    return {}, "epoch"


def _read_run(run_dir: str) -> dict[str, dict[int, float]]:
    points: dict[str, dict[int, float]] = {}
    for event_file in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
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
    return points
