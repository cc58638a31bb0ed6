"""The first step's note on ops DTensor has no layout rule for that got a
split input, and so gather it onto every device each step.

`tfmp.lowering.replicated` gathers such an op's inputs under a name scope
that names the op; DTensor names the collectives it inserts for those
relayouts after them. The per-device graphs of the first step
(`tfmp.strategy.graph_capture`) then tell which layers' ops gathered, once
per op and layer in a process.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Iterable

from tfmp.forward import REPLICATED_SCOPE
from tfmp.strategy.errors import layer_path

_COLLECTIVE_OPS = ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveAllToAllV2")
_noted: set[tuple[str, str]] = set()


def replicated_op_gathers(function_graphs: Iterable[Any]) -> set[tuple[str, str]]:
    """(op, layer path) of each op that gathered a split input, in the
    collectives of `function_graphs` (run metadata's per-device graphs)."""
    found = set()
    for function in function_graphs:
        for partition in function.partition_graphs:
            for node in partition.node:
                if node.op not in _COLLECTIVE_OPS:
                    continue
                names = node.experimental_debug_info.original_node_names
                parts = (names[0] if names else node.name).split("/")
                for index, part in enumerate(parts):
                    if part.startswith(REPLICATED_SCOPE):
                        # Without TensorFlow's uniquifying suffix of the scope.
                        op = re.sub(r"_\d+$", "", part[len(REPLICATED_SCOPE) :])
                        found.add((op, layer_path("/".join(parts[: index + 1]))))
    return found


def note_replicated_ops(function_graphs: Iterable[Any]) -> None:
    """Warns once per op and layer that gathered a split input."""
    for op, layer in sorted(replicated_op_gathers(function_graphs) - _noted):
        _noted.add((op, layer))
        warnings.warn(
            f"tfmp: layer {layer or '?'!r} runs TensorFlow's {op}, which DTensor has no "
            "layout rule for, on every device: its split input is gathered whole each "
            "step (tfmp.comm_report(model) counts it under 'replicated-ops'). To avoid "
            "the gather, give the layers before it rules that leave that input whole.",
            stacklevel=2,
        )
