"""`tfmp.plot_memory`: per-device memory as a picture, so imbalance is seen."""

from __future__ import annotations

import os
import re
from typing import Any

from tfmp.inspect.display import Device, byte_unit, device_ranges

_KEY = re.compile(r"^(?:epoch_)?mem/(?P<device>[^/]+)/(?P<figure>\w+)_bytes$")
_FIGURE_NAMES = {"peak": "measured peak", "param": "parameters + optimizer"}

Series = dict[tuple[str, str], tuple[list, list]]


def plot_memory(history_or_logdir: Any, path: str) -> str:
    """Draws `DeviceMemoryMonitor`'s figures to a PNG.

    Left: each device's memory over epochs (or over training steps when read
    from a log directory that `DeviceMemoryMonitor(log_dir=...)` wrote): the
    measured peak where there is one (GPU, TPU), else the parameter and
    optimizer shard bytes. Devices with the same curve share one line and one
    legend entry (`CPU:0-7`). Right: a bar per device, its parameter and
    optimizer shard bytes stacked. Both show the even share, the total over
    all devices divided by their number, as a dashed line: a device above it
    holds more than its part. Bytes are in KiB, MiB or GiB, whichever reads best.

    Args:
        history_or_logdir: A `keras.callbacks.History`, its `.history` dict, or
            a log directory of `DeviceMemoryMonitor(log_dir=...)` or of
            `keras.callbacks.TensorBoard`.
        path: Where to write the PNG.

    Returns:
        `path`.

    Raises:
        ValueError: If no `mem/...` figures are found.
        ImportError: If matplotlib is missing, or tensorboard for a log
            directory (`pip install "tfmp[plot]"`).

    Examples:
        >>> history = model.fit(x, y, callbacks=[tfmp.callbacks.DeviceMemoryMonitor()], verbose=0)
        >>> tfmp.plot_memory(history, "memory.png")
        'memory.png'
    """
    series, x_label = _memory_series(history_or_logdir)
    if not any(device != "process" for device, _ in series):
        raise ValueError(
            f"No mem/<device>/..._bytes figures in {history_or_logdir!r}: train with "
            "tfmp.callbacks.DeviceMemoryMonitor among the callbacks first."
        )
    _memory_figure(series, x_label).savefig(path)
    return path


def _memory_figure(series: Series, x_label: str) -> Any:
    """The figure `plot_memory` saves, from `(device, figure) -> (steps, values)`.

    A `matplotlib.figure.Figure` made directly, not through `pyplot`: it
    draws with matplotlib's Agg renderer and leaves the backend of the
    caller's own plots (a notebook's, say) as it is.
    """
    try:
        from matplotlib import ticker
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            'tfmp.plot_memory needs matplotlib: pip install "tfmp[plot]".'
        ) from error
    devices = sorted({d for d, _ in series if d != "process"}, key=Device.parse)
    figure = Figure(figsize=(12, 4.5))
    over_time, per_device = figure.subplots(1, 2)

    figure_name = "peak" if all((d, "peak") in series for d in devices) else "param"
    curves = {d: series[d, figure_name] for d in devices if (d, figure_name) in series}
    unit, scale = byte_unit(max(max(values) for _, values in curves.values()))
    same_curve: dict[tuple, list[str]] = {}
    for device, (steps, values) in curves.items():
        same_curve.setdefault((tuple(steps), tuple(values)), []).append(device)
    for (steps, values), members in same_curve.items():
        over_time.plot(
            steps, [v / scale for v in values], marker="o",
            label=f"{device_ranges(members)} ({_FIGURE_NAMES[figure_name]})",
        )
    steps = next(iter(curves.values()))[0]
    if all(curve[0] == steps for curve in curves.values()):
        mean = [sum(c[1][i] for c in curves.values()) / len(curves) for i in range(len(steps))]
        over_time.plot(
            steps, [v / scale for v in mean], linestyle="--", color="gray",
            label=f"even share (total / {len(curves)} devices)",
        )
    over_time.set(xlabel=x_label, ylabel=f"memory ({unit})", title="memory per device")
    over_time.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    _room_for_legend(over_time)

    totals = [_last(series, d, "param") for d in devices]
    optimizer = [_last(series, d, "optimizer") for d in devices]
    unit, scale = byte_unit(max(totals))
    labels = [device_ranges([d]) for d in devices]
    parameters = [(t - o) / scale for t, o in zip(totals, optimizer)]
    per_device.bar(labels, parameters, label="parameters")
    if any(optimizer):
        per_device.bar(labels, [o / scale for o in optimizer], bottom=parameters, label="optimizer")
    per_device.axhline(
        sum(totals) / len(totals) / scale, linestyle="--", color="gray",
        label=f"even share (total / {len(totals)} devices)",
    )
    per_device.set(ylabel=f"shard bytes ({unit})", title="parameter and optimizer shards")
    per_device.tick_params(axis="x", rotation=45)
    _room_for_legend(per_device)
    figure.tight_layout()
    return figure


def _room_for_legend(axes: Any) -> None:
    """From zero, so heights compare as sizes, with the legend above the data."""
    axes.set_ylim(0, axes.get_ylim()[1] * 1.3)
    axes.legend(fontsize="small", loc="upper right", ncol=2)


def _last(series: Series, device: str, figure: str) -> float:
    values = series.get((device, figure), ([], [0.0]))[1]
    return values[-1]


def _memory_series(source: Any) -> tuple[Series, str]:
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
    there is one, else the epoch figures of `TensorBoard`'s `train` run
    (numbered from 1, as in `History`)."""
    for run, x_label, first in (("memory", "step", 0), ("train", "epoch", 1)):
        points = _read_run(os.path.join(logdir, run), first)
        if points:
            return points, x_label
    return {}, "epoch"


def _read_run(run_dir: str, first: int) -> dict[str, dict[int, float]]:
    """`tag -> step -> value` of a run's memory scalars, its steps from `first`."""
    if not os.path.isdir(run_dir):
        return {}
    try:
        from tensorboard.backend.event_processing import event_accumulator
        from tensorboard.util import tensor_util
    except ImportError as error:
        raise ImportError(
            f"tfmp.plot_memory reads the log directory {run_dir!r} with TensorBoard: "
            'pip install "tfmp[plot]" (or pip install tensorboard), or pass the History.'
        ) from error
    # Every reading: by default the accumulator keeps a sample of 10 tensors per tag.
    every_reading = {event_accumulator.TENSORS: 0, event_accumulator.SCALARS: 0}
    run = event_accumulator.EventAccumulator(run_dir, size_guidance=every_reading)
    run.Reload()
    tags = run.Tags()
    points: dict[str, dict[int, float]] = {}
    for tag in filter(_KEY.match, tags[event_accumulator.TENSORS]):
        for event in run.Tensors(tag):
            value = float(tensor_util.make_ndarray(event.tensor_proto))
            points.setdefault(tag, {})[event.step + first] = value
    for tag in filter(_KEY.match, tags[event_accumulator.SCALARS]):
        for event in run.Scalars(tag):
            points.setdefault(tag, {})[event.step + first] = event.value
    return points
