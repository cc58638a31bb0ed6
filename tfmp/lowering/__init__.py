"""Lowerings: Keras backend ops rewritten into ops DTensor can lay out.

DTensor expands each TensorFlow op by a rule of its own, and some ops that
ordinary Keras layers use have none (`DepthwiseConv2dNativeBackpropFilter`,
`ReverseV2`, TensorList ops of `tf.while_loop`) or refuse split operands
(`Conv2D` with a split kernel). While a layer's forward pass is traced on a
tfmp mesh, the Keras backend functions listed in each family's `LOWERINGS` run tfmp's
rewrite instead; anywhere else they are Keras' own. Ops without a rule that
no rewrite runs faster run replicated, on inputs gathered first
(`tfmp.lowering.replicated`). Each entry names the Keras versions it was
tested with (see `tfmp.lowering.registry`).
"""

from tfmp.lowering.registry import Lowering, install, lowerings

__all__ = ["Lowering", "install", "lowerings"]
