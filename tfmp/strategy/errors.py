"""DTensor's internal errors, told to the user as the layer and op that caused them.

DTensor lays out a step's ops when the step first runs, and an op it cannot
expand stops `fit` with MLIR text that names neither the layer nor a fix.
tfmp finds the failing op's nodes in the step's function library (their
names are Keras' layer paths) and raises a `ValueError` that names the
layer, its variables' layouts and what to do.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator

import tensorflow as tf

from tfmp.integrations.internals import eager_context as context
from tfmp.integrations.internals import tf_error_interpolation
from tfmp.layout import layout_axes

# Words only DTensor's SPMD expansion and layout propagation use.
_DTENSOR_MARKERS = (
    "layout propagation",
    "SPMD expansion",
    "sharding_specs",
    "dtensor",
    "DTensor",
    "fully replicated layout",
    "must be replicated",
)
_OP = re.compile(r"'tf\.(\w+)' op|\"tf\.(\w+)\"\(")
_FUNCTION = re.compile(r"\[Op:(__inference_\w+)\]")
_UNDIVIDED = re.compile(
    r"requires dimension (\d+) to be divisible by sharding.*?dimension size=(\d+) is not "
    r"divisible by number of shards in layout for this dimension=(\d+)"
)


# One `{{type name}}` tag of a function's error message.
_TAG = re.compile(tf_error_interpolation._TAG_REGEX, re.DOTALL)  # noqa: SLF001


def tags_found_in_one_pass(parse_message: Callable) -> Callable:
    """TensorFlow's `parse_message`, with the same results, in time linear in
    the message's length.

    TensorFlow runs it on the message of every error a function raises,
    before any handler sees the error. Its pattern starts with a lazy `.*?`
    that `finditer` tries again from every position of a stretch without a
    tag: quadratic. A DTensor expansion error carries the whole module it
    failed on, and one of 421,000 characters (a recurrence's layout) took
    over 15 minutes there, with nothing printed, before tfmp could name the
    layer. Searching for the tags alone finds the same matches: the first
    tag at or after the end of the last one.
    """

    def parse(message: str) -> tuple[str, list, list]:
        kept, function_tags, node_tags = [], [], []
        position = 0
        for match in _TAG.finditer(message):
            tag = tf_error_interpolation._ParseTag(match.group("type"), match.group("name"))  # noqa: SLF001
            kept.append(message[position : match.start()])
            if tag.type == "function_node":
                function_tags.append(tag)
            else:
                kept.append(match.group())
                node_tags.append(tag)
            position = match.end()
        kept.append(message[position:])
        return "".join(kept), function_tags, node_tags

    return parse


def is_dtensor_error(error: BaseException) -> bool:
    """Whether `error` comes from DTensor's expansion of a step."""
    return isinstance(error, tf.errors.OpError) and any(
        marker in str(error) for marker in _DTENSOR_MARKERS
    )


def is_cancellation(error: BaseException) -> bool:
    """Whether `error` is a step cancelled on this device because another
    device of the mesh failed (an op's own error, not a layout)."""
    return isinstance(error, tf.errors.CancelledError) or "was cancelled" in str(error)


def explain_cancellation(error: tf.errors.OpError, model: Any) -> tf.errors.CancelledError:
    """A `CancelledError` saying where the failing device's own error is."""
    return tf.errors.CancelledError(
        error.node_def,
        error.op,
        f"tfmp: the step of model {model.name!r} stopped on the mesh: another of its devices failed, "
        "which cancelled this one's part of the step (which device's error TensorFlow reports first "
        "is a race). TensorFlow logged the failing device's own error as a warning, on a line with "
        "'Local rendezvous is aborting with status:' (with TF_CPP_MIN_LOG_LEVEL at 1 or less); "
        "a label or an id outside its range is the usual cause; to see the error itself, run the same "
        "batch on one device. TensorFlow keeps the collectives of a failed step aborted: restart the "
        "process (or the notebook's kernel) before training on the mesh again.\n"
        f"TensorFlow's words: {error.message.splitlines()[0] if error.message else ''}",
    )


def explain(error: tf.errors.OpError, model: Any) -> ValueError:
    """A `ValueError` naming the op, the layer and its variables' layouts."""
    text = str(error)
    found = _OP.search(text)
    op = next((group for group in found.groups() if group), "?") if found else "?"
    cause = next((line.strip() for line in text.splitlines() if "error:" in line), text.splitlines()[0])
    cause = cause.split("error:", 1)[-1].strip()
    function = _FUNCTION.search(text)
    layers = sorted({layer_path(name) for name in _nodes_of_type(function.group(1), op)}) if function else []
    where = f"in layer {', '.join(map(repr, layers))}" if layers else "in the step"
    batch = _undivided_batch(cause, model)
    if batch is not None:
        return ValueError(_batch_message(op, where, model, cause, *batch))
    variables = _variables_of(model, layers)
    listed = "".join(f"\n  {path}: {axes}" for path, axes in variables)
    return ValueError(
        f"tfmp: DTensor cannot run op {op!r} {where} of model {model.name!r} on the "
        f"mesh: {cause}{chr(10) + 'Its variables and their layouts:' + listed if listed else ''}\n"
        f"{_sequence_split_fix(model)}{_fix(cause)}"
    )


def _sequence_split_fix(model: Any) -> str:
    """Where the model's strategy splits sequences, the first thing to try:
    the models context parallelism cannot yet split fail at their first
    step with DTensor's errors on ops that no variable's rule decides."""
    strategy = getattr(model, "distribute_strategy", None)
    for option in ("context_parallel", "sequence_parallel"):
        axis = getattr(strategy, f"{option}_axis", None)
        if axis is not None:
            return (
                f"Fix first: {option} splits this model's sequences over mesh axis {axis!r}, "
                "and DTensor cannot yet follow that split through every model (docs/tensor-parallel.md "
                f"names those known): train with {option}=False, and if the model then trains, tell "
                "tfmp's issue tracker which model it is. Else:\n"
            )
    return ""


def _undivided_batch(cause: str, model: Any) -> tuple[int, str, int] | None:
    """(rows, batch axis, its size) when `cause` is a layout that splits a
    batch's rows over the batch axis, which that batch does not divide; else None.

    Such a batch is one the strategy runs whole (a partial last batch); the
    layout was pinned by an op written for split batches, not by a variable's
    rule (variables are never split on a dimension the axis does not divide).
    """
    found = _UNDIVIDED.search(cause)
    strategy = getattr(model, "distribute_strategy", None)
    placer = getattr(getattr(strategy, "extended", None), "placer", None)
    if found is None or placer is None or placer.batch_axis is None:
        return None
    dimension, rows, shards = map(int, found.groups())
    if dimension != 0 or shards != placer.batch_parts:
        return None
    return rows, placer.batch_axis, shards


def _batch_message(op: str, where: str, model: Any, cause: str, rows: int, axis: str, size: int) -> str:
    return (
        f"tfmp: a batch of {rows} rows does not divide by mesh axis {axis!r} of size "
        f"{size}, so tfmp runs it whole on every device of that axis (exact, as one "
        f"device), but op {op!r} {where} of model {model.name!r} lays its rows out "
        f"split over {axis!r}: {cause}\n"
        f"Fix: use a batch size, and a number of samples, that are multiples of {size} "
        "(or drop the short last batch: Dataset.batch(..., drop_remainder=True)). In "
        "a layer of your own, do not relayout activations to a batch-split layout "
        "(dtensor.relayout): tfmp's batch placer decides the batch's layout. If "
        "no layer of yours does, tell tfmp's issue tracker which Keras layer it is."
    )


def _fix(cause: str) -> str:
    if "CollectiveAllToAllV2" in cause and "xi1>" in cause:
        return (
            "Fix: DTensor moves a boolean tensor (a mask) from one split dimension "
            "to another with an all-to-all, which takes no booleans; another layout "
            "map may not help (XLNet fails so with the batch split alone). Keep the "
            "mask as integers or floats until the op that uses it, or leave the "
            "model on one device."
        )
    if "TransposeOp SPMD needs communication" in cause:
        return (
            "Fix: DTensor's Transpose cannot move a split: the transposed tensor's "
            "consumer asks for a layout that is not the permuted one (a (batch, batch) "
            "matrix such as CLIP's logits, whose rows are split, transposed and split "
            "again). The variables' rules do not decide it. Transpose with "
            "keras.ops.transpose, which tfmp runs as an einsum DTensor lays out, in "
            "place of tf.transpose."
        )
    if "TensorList" in cause:
        return (
            "Fix: a tf.while_loop (keras.ops.while_loop, or a fori_loop, scan or map "
            "whose trip count is known only in the step) keeps each iteration's values "
            "for the gradient in TensorLists, which DTensor cannot lay out. Give the "
            "loop a trip count known when tracing (fori_loop with Python bounds, scan "
            "or map over a dimension of fixed length): tfmp then unrolls it."
        )
    if "layout propagation" in cause:
        return (
            "Fix: DTensor has no rule for this op. If the layer calls TensorFlow "
            "directly, write it with keras.ops (tfmp rewrites the Keras ops DTensor "
            "cannot run; see docs/supported-layers.md), or tell tfmp's issue tracker "
            "which Keras layer uses it."
        )
    return (
        "Fix: change the LayoutMap rules of this layer's variables (split another "
        "dimension, or leave them replicated); tfmp.summary(model) lists every "
        "variable's layout."
    )


def _nodes_of_type(function_name: str, op: str) -> Iterator[str]:
    """Names of the `op` nodes in a function and the functions it calls."""
    pending, seen = [function_name], set()
    ctx = context.context()
    while pending:
        name = pending.pop()
        if name in seen or not ctx.has_function(name):
            continue
        seen.add(name)
        for node in ctx.get_function_def(name).node_def:
            if node.op == op:
                yield node.name
            for value in node.attr.values():
                if value.func.name:
                    pending.append(value.func.name)


def layer_path(node_name: str) -> str:
    """`"sequential_1/my_reverse_1/ReverseV2"` -> `"sequential/my_reverse"`:
    the layer's path, without TensorFlow's uniquifying suffixes."""
    parts = [p for p in node_name.split("/")[:-1] if p not in ("gradient_tape", "StatefulPartitionedCall")]
    return "/".join(re.sub(r"_\d+$", "", part) for part in parts)


def _variables_of(model: Any, layers: list[str]) -> list[tuple[str, Any]]:
    found = []
    for variable in model.variables:
        layout = getattr(getattr(variable, "value", None), "layout", None)
        if layout is not None and any(_within(variable.path, layer) for layer in layers):
            found.append((variable.path, layout_axes(layout)))
    return found


def _within(path: str, layer: str) -> bool:
    """Whether variable `path` belongs to `layer` (node paths carry the model
    name, which Keras 3 leaves out of functional models' variable paths)."""
    parts = layer.split("/")
    return any(path.startswith("/".join(parts[i:]) + "/") for i in range(len(parts)))
