"""Process-wide settings tfmp needs before TensorFlow runs any DTensor function."""

import os
import warnings

# DTensor's pass that combines all-reduces reorders variable reads and writes within
# one step: with it, Adam training silently drifts from single-device Keras.
COMBINE_ALL_REDUCES = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"


def configure_dtensor_environment() -> None:
    """Turns off DTensor settings that make Keras training silently wrong."""
    current = os.environ.get(COMBINE_ALL_REDUCES)
    if current not in (None, "0"):
        warnings.warn(
            f"tfmp: {COMBINE_ALL_REDUCES}={current} was set; tfmp sets it to 0 because "
            "that optimization reorders variable reads and updates in a train step "
            "and trains wrong. Unset it to silence this warning.",
            stacklevel=3,
        )
    os.environ[COMBINE_ALL_REDUCES] = "0"
