"""Lowerings: Keras backend ops rewritten into ops DTensor can lay out.

DTensor expands each TensorFlow op by a rule of its own, and some ops that
ordinary Keras layers use have none (`DepthwiseConv2dNativeBackpropFilter`,
`ReverseV2`, TensorList ops of `tf.while_loop`) or refuse split operands
(`Conv2D` with a split kernel). While a layer's forward pass is traced on a
tfmp mesh, the Keras backend functions listed in each family's `LOWERINGS` run tfmp's
rewrite instead (a loss's lowering, in the whole step a strategy traces:
`Lowering.outside_layers`); anywhere else they are Keras' own. Importing the package
declares them (and the TensorFlow functions some families patch) with
`tfmp.integrations`. Ops without a rule that
no rewrite runs faster run replicated, on inputs gathered first
(`tfmp.lowering.replicated`). Each entry names the Keras versions it was
tested with (see `tfmp.lowering.registry`).
"""

from tfmp import integrations
from tfmp.lowering import (
    arrays,
    attention,
    conv,
    elementwise,
    hub_attention,
    image,
    indexing,
    joins,
    loops,
    losses,
    pooling,
    random,
    reduction,
    replicated,
    rnn,
    slicing,
)
from tfmp.lowering.registry import Lowering

# Each module holds the lowerings of one op family, as a tuple `LOWERINGS`,
# and the TensorFlow functions it patches with its code, `PATCHES`.
FAMILIES = (conv, rnn, random, indexing, image, joins, slicing, pooling, reduction, elementwise, arrays, losses, attention, hub_attention, loops, replicated)


def lowerings() -> tuple[Lowering, ...]:
    """Every lowering, family by family."""
    return tuple(lowering for family in FAMILIES for lowering in getattr(family, "LOWERINGS", ()))


for _family in FAMILIES:
    integrations.declare(_family.__name__, (*getattr(_family, "LOWERINGS", ()), *getattr(_family, "PATCHES", ())))
del _family

__all__ = ["FAMILIES", "Lowering", "lowerings"]
