"""A layer's forward pass on a mesh: which mesh it runs on, and how it reads weights.

A variable's layout (from a rule or a layer's declaration) is its storage
layout: where its shards live between steps. A layer's forward pass reads it
in its compute layout: the storage layout with the batch axis gathered, since
the activations a weight meets are split over that axis already (DTensor
refuses a contraction split over two mesh axes, and a dimension split over
the axis that splits the batch). Gathering on use, and DTensor reducing the
gradient back to the stored layout, is fully sharded data parallelism
(ZeRO-3); it is also what GSPMD does on JAX with the same rules.

While a layer's forward pass is traced on a mesh, `forward_mesh()` names that
mesh: tfmp's lowerings of ops DTensor cannot expand (`tfmp.lowering`) use it
to decide whether to run, and where.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor

# Name scope of the relayouts that gather weights on use: `tfmp.comm_report`
# tells their collectives from the others by it.
GATHER_SCOPE = "tfmp_gather_on_use"

_forward = threading.local()


@contextlib.contextmanager
def forward_on(mesh: dtensor.Mesh | None) -> Iterator[None]:
    """A layer's forward pass on `mesh` is traced in the block (None: on no mesh)."""
    previous = getattr(_forward, "mesh", None)
    _forward.mesh = mesh
    try:
        yield
    finally:
        _forward.mesh = previous


def forward_mesh() -> dtensor.Mesh | None:
    """The mesh of the layer whose forward pass is being traced, or None
    (also when running eagerly: DTensor lays out only traced functions)."""
    if tf.executing_eagerly():
        return None
    return getattr(_forward, "mesh", None)


def compute_layout(layout: dtensor.Layout, gathered_axes: tuple[str, ...]) -> dtensor.Layout:
    """`layout` with every dimension split over one of `gathered_axes` made whole."""
    specs = [
        dtensor.UNSHARDED if spec in gathered_axes else spec for spec in layout.sharding_specs
    ]
    return dtensor.Layout(specs, layout.mesh)
