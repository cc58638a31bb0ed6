"""Process-wide settings tfmp needs before TensorFlow runs any DTensor function."""

import os
import warnings

# DTensor's pass that combines all-reduces reorders variable reads and writes within
# one step: with it, Adam training silently drifts from single-device Keras.
COMBINE_ALL_REDUCES = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"
# Without it, DTensor lowers an all-gather as an all-reduce of a zero-filled
# buffer: twice the bytes. Its real gather (TensorFlow's gather collective) is
# exact for a relayout that gathers one mesh axis, and tfmp gathers one axis
# per relayout (`tfmp.layout.replicated`). DTensor reads it each time it
# compiles a function, and takes any value, "0" too, as set.
REAL_GATHERS = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"

# TensorFlow ops DTensor has no layout rule for ("does not implement layout
# propagation"), which it runs replicated (inputs gathered, the whole result
# on every device) once `DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF.<OP IN
# CAPITALS>` is set, to anything. The stateless draws of `tf.random`
# (`stateless_gamma`, `stateless_poisson`, `stateless_binomial`,
# `stateless_categorical`, `stateless_parameterized_truncated_normal`) and
# Keras' `random.gamma`, `beta`, `binomial` and `categorical` then draw the
# whole tensor from the same seed on every device: one device's numbers.
# TensorFlow's stateful Poisson kernel, seeded alike on every device by
# `tfmp.lowering.random`, and a `tf.random.Generator`'s binomial, whose state
# variable is replicated, draw the same numbers on every device too.
# Measured: DTensor reads a switch when it compiles the op, and once one
# compile had it the op stays enrolled for the process; so
# `tests/test_user_tf_ops.py` checks in a fresh process that each op still
# needs it.
REPLICATED_OPS = (
    "StatelessRandomGammaV3",
    "StatelessRandomPoisson",
    "StatelessRandomBinomial",
    "StatelessMultinomial",
    "StatelessParameterizedTruncatedNormal",
    "RandomPoissonV2",
    "StatefulRandomBinomial",
)
REPLICATED_BY_DEFAULT = "DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF."


def configure_dtensor_environment() -> None:
    """Turns off DTensor settings that make Keras training silently wrong,
    has it lower all-gathers as gathers, and run the `REPLICATED_OPS`
    replicated."""
    current = os.environ.get(COMBINE_ALL_REDUCES)
    if current not in (None, "0"):
        warnings.warn(
            f"tfmp: {COMBINE_ALL_REDUCES}={current} was set; tfmp sets it to 0 because "
            "that optimization reorders variable reads and updates in a train step "
            "and trains wrong. Unset it to silence this warning.",
            stacklevel=3,
        )
    os.environ[COMBINE_ALL_REDUCES] = "0"
    os.environ.setdefault(REAL_GATHERS, "1")
    for op in REPLICATED_OPS:
        os.environ.setdefault(REPLICATED_BY_DEFAULT + op.upper(), "1")
