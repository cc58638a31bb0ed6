"""How tfmp's reports write sizes, devices and tables, for people to read."""

from __future__ import annotations

import io
import itertools
import re
from typing import Iterable, NamedTuple, Sequence

import rich.box
import rich.console
import rich.table
import rich.text
import tensorflow as tf

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
# "CPU_3", "task1_GPU_0": the device part of DeviceMemoryMonitor's figure names.
_TAG_DEVICE = re.compile(r"^(?:task(?P<task>\d+)_)?(?P<kind>[A-Za-z]+)_(?P<index>\d+)$")


def byte_unit(size: float) -> tuple[str, int]:
    """The unit `size` bytes read best in, and its size: `("KiB", 1024)`."""
    power = 0
    while abs(size) >= 1024 ** (power + 1) and power < len(_UNITS) - 1:
        power += 1
    return _UNITS[power], 1024**power


def format_bytes(size: float) -> str:
    """`768` -> `"768 B"`, `39_852` -> `"38.9 KiB"`, `3 * 2**20` -> `"3.0 MiB"`."""
    unit, scale = byte_unit(size)
    return f"{size:,.0f} B" if scale == 1 else f"{size / scale:.1f} {unit}"


class Device(NamedTuple):
    """A device as reports name it: `CPU:3`, or `task1/CPU:3` on another task."""

    task: int
    kind: str
    index: int

    @classmethod
    def parse(cls, device: str) -> "Device":
        """From a full TensorFlow device name (`/job:localhost/.../device:CPU:3`)
        or from the short name in DeviceMemoryMonitor's figures (`CPU_3`)."""
        match = _TAG_DEVICE.match(device)
        if match:
            return cls(int(match["task"] or 0), match["kind"], int(match["index"]))
        spec = tf.DeviceSpec.from_string(device)
        return cls(spec.task or 0, spec.device_type, spec.device_index)


def device_ranges(devices: Iterable[str | Device]) -> str:
    """Devices in few words: `CPU:0-7`, `CPU:0-3,6`, `CPU:0-3, task1/CPU:0-3`."""
    parsed = sorted({d if isinstance(d, Device) else Device.parse(d) for d in devices})
    groups = []
    for (task, kind), members in itertools.groupby(parsed, key=lambda d: (d.task, d.kind)):
        indices = [d.index for d in members]
        runs = []
        for _, run in itertools.groupby(enumerate(indices), key=lambda pair: pair[1] - pair[0]):
            numbers = [index for _, index in run]
            runs.append(str(numbers[0]) if len(numbers) == 1 else f"{numbers[0]}-{numbers[-1]}")
        groups.append(f"{f'task{task}/' if task else ''}{kind}:{','.join(runs)}")
    return ", ".join(groups)


def render_table(
    header: Sequence[str], rows: Iterable[Sequence[str]], right: Sequence[str] = ()
) -> str:
    """A table in plain text (no colour codes, never cut short), drawn by rich.

    Args:
        header: The column titles.
        rows: One sequence of cell texts per row.
        right: The titles of the columns to right-align (numbers).
    """
    table = rich.table.Table(box=rich.box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for title in header:
        table.add_column(title, justify="right" if title in right else "left", no_wrap=True)
    for row in rows:
        # Text, not markup: a cell such as "['wide']" is shown as written.
        table.add_row(*(rich.text.Text(cell) for cell in row))
    console = rich.console.Console(
        file=io.StringIO(), width=100_000, color_system=None, force_terminal=False,
        force_jupyter=False, force_interactive=False,
    )
    console.print(table)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines())
