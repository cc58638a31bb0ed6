"""Time spent in collectives over a window of steps, from the TF profiler."""

from __future__ import annotations

import glob
import os
import tempfile
import time
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

COLLECTIVE_OP_TYPES = ("Collective", "NcclAllReduce", "AllReduce", "AllToAll")


class CollectiveTimer:
    """Profiles training steps `first..last` (1-based, counted across epochs).

    Args:
        steps: `(first, last)`, both included.
        profile_dir: Where the profile is written (a fresh temporary directory
            if None); TensorBoard's profile plugin can open it.
    """

    def __init__(self, steps: tuple[int, int], profile_dir: str | None = None):
        if (
            not isinstance(steps, (tuple, list))
            or len(steps) != 2
            or not all(isinstance(s, int) for s in steps)
            or not 1 <= steps[0] <= steps[1]
        ):
            raise ValueError(
                f"profile_steps={steps!r}: give (first, last) training steps, "
                "1 <= first <= last, e.g. (10, 20)."
            )
        self.first, self.last = steps
        self.profile_dir = profile_dir or tempfile.mkdtemp(prefix="tfmp_profile_")
        self.result: dict[str, float] | None = None
        self._step = 0
        self._started_at = 0.0

    def batch_begin(self) -> None:
        self._step += 1
        if self._step == self.first:
            tf.profiler.experimental.start(self.profile_dir)
            self._started_at = time.perf_counter()

    def batch_end(self, logs: dict | None) -> None:
        if self._step == self.last:
            for value in (logs or {}).values():
                np.asarray(value)  # waits for the step to finish before timing it
            self._finish()

    def train_end(self) -> None:
        """Ends a window that training stopped inside of."""
        if self.first <= self._step < self.last:
            self._finish()

    def _finish(self) -> None:
        wall = time.perf_counter() - self._started_at
        tf.profiler.experimental.stop()
        steps = self._step - self.first + 1
        collective, ops = collective_and_op_seconds(self.profile_dir)
        self.result = {
            "sync/profiled_step_seconds": wall / steps,
            "sync/collective_seconds": collective / steps,
            "sync/collective_fraction": collective / wall if wall else 0.0,
            "sync/op_seconds": ops / steps,
        }
        self._step = self.last + 1  # one window per monitor


def collective_and_op_seconds(profile_dir: str) -> tuple[float, float]:
    """Wall time covered by collective ops, and by any op, in the latest profile.

    Events of all devices are merged on one time line, so concurrent
    collectives of several devices count once. TensorFlow's own reading of the
    trace, the op statistics behind TensorBoard's profile plugin
    (`framework_op_stats`, through a private binding), sums each op's time
    over devices instead: on 8 CPU devices it gives 2.4x this collective time
    and 14x this op time (idle time included), so the trace is read here.
    """
    files = glob.glob(os.path.join(profile_dir, "plugins", "profile", "*", "*.xplane.pb"))
    if not files:
        raise RuntimeError(f"The TF profiler wrote no trace under {profile_dir!r}.")
    space = xplane_pb2.XSpace()
    with open(max(files, key=os.path.getmtime), "rb") as trace:
        space.ParseFromString(trace.read())
    collective, ops = [], []
    for plane in space.planes:
        for line in plane.lines:
            start_ps = line.timestamp_ns * 1000
            for event in line.events:
                # Kernel events carry their op type as display name; other
                # trace events have none.
                op_type = plane.event_metadata[event.metadata_id].display_name
                if not op_type:
                    continue
                interval = (start_ps + event.offset_ps, start_ps + event.offset_ps + event.duration_ps)
                ops.append(interval)
                if op_type.startswith(COLLECTIVE_OP_TYPES):
                    collective.append(interval)
    return _covered_ps(collective) / 1e12, _covered_ps(ops) / 1e12


def _covered_ps(intervals: list[Any]) -> int:
    covered, end = 0, -1
    for start, stop in sorted(intervals):
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return covered
