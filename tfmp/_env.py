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


def configure_dtensor_environment() -> None:
    """Turns off DTensor settings that make Keras training silently wrong, and
    has it lower all-gathers as gathers."""
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
