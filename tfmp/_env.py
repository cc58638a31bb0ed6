"""Process-wide settings tfmp needs before TensorFlow loads or runs any DTensor function."""

import contextlib
import os
import re
import sys
import tempfile
import warnings
from typing import Iterator

# DTensor's pass that combines all-reduces reorders variable reads and writes within
# one step: with it, Adam training silently drifts from single-device Keras.
COMBINE_ALL_REDUCES = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"
# Without it, DTensor lowers an all-gather as an all-reduce of a zero-filled
# buffer: twice the bytes. Its real gather (TensorFlow's gather collective) is
# exact for a relayout that gathers one mesh axis, and tfmp gathers one axis
# per relayout (`tfmp.layout.replicated`). DTensor reads it each time it
# compiles a function, and takes any value, "0" too, as set.
REAL_GATHERS = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"
# 128 + SIGTERM, what a shell reports for a process SIGTERM stopped: the
# status schedulers expect of a preempted job, with which a preempted client
# exits (`tfmp.strategy.preemption`). `tfmp launch` tells it from a failure
# (and a process killed by an unhandled SIGTERM shows -15 to its parent, not
# 143); it is here so that the launcher needs no TensorFlow.
PREEMPTED_EXIT_CODE = 143
# TensorFlow's C++ log threshold: 0 logs everything, 3 only fatal errors.
TF_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
QUIET_LOG_LEVEL = "3"
# The lines TensorFlow's native libraries write with absl before absl reads
# TF_CPP_MIN_LOG_LEVEL ("I0000 00:00:... cudart_stub.cc:31] Could not find cuda
# drivers..."), and absl's note that they bypass any threshold.
_EARLY_NATIVE_LOG = re.compile(
    r"^([IWE]\d{4} \d\d:\d\d:[\d.]+ +\d+ [\w./-]+:\d+\] |"
    r"WARNING: All log messages before absl::InitializeLog\(\) is called)"
)

# TensorFlow ops DTensor has no layout rule for ("does not implement layout
# propagation"), which it runs replicated (inputs gathered, the whole result
# on every device) once `DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF.<OP IN
# CAPITALS>` is set, to anything. DTensor has no switch for every op at once
# (its registry looks the op's name up), so each op is named here, with why a
# model runs it. Measured: DTensor reads a switch when it compiles the op, and
# once one compile had it the op stays enrolled for the process; so
# `tests/test_canaries.py` checks in a fresh process that each op still needs
# it. A first step in which `tfmp.lowering.replicated` gathers a split input
# for one of them says so once (`tfmp.strategy.replicated_ops`), and
# `tfmp.comm_report` counts the gather.
REPLICATED_OPS = (
    # The stateless draws of `tf.random` (`stateless_gamma`, `stateless_poisson`,
    # `stateless_binomial`, `stateless_categorical`,
    # `stateless_parameterized_truncated_normal`) and Keras' `random.gamma`,
    # `beta`, `binomial` and `categorical` then draw the whole tensor from the
    # same seed on every device: one device's numbers.
    "StatelessRandomGammaV3",
    "StatelessRandomPoisson",
    "StatelessRandomBinomial",
    "StatelessMultinomial",
    "StatelessParameterizedTruncatedNormal",
    # TensorFlow's stateful Poisson kernel, seeded alike on every device by
    # `tfmp.lowering.random`, and a `tf.random.Generator`'s binomial, whose
    # state variable is replicated, draw the same numbers on every device too.
    "RandomPoissonV2",
    "StatefulRandomBinomial",
    # Run by `tfmp.lowering.replicated` on inputs gathered one mesh axis at a
    # time: `keras.ops.roll`, `flip`, `fliplr` and `flipud`, and Keras' image
    # warps (RandomRotation, RandomZoom, RandomTranslation, RandomShear,
    # RandomPerspective), with `MatrixInverse` for the warp's gradient and
    # `MatrixSolve` for RandomPerspective's homography (`tf.linalg.solve`).
    # As fast or faster than tfmp's former rewrites on 2x4 CPU devices
    # (`bench/generic_path.py`, docs/layouts.md).
    "Roll",
    "ReverseV2",
    "ImageProjectiveTransformV3",
    "MatrixInverse",
    "MatrixSolve",
    # The gradients of `keras.ops.average_pool` (AveragePooling1D/2D/3D), run
    # by `tfmp.lowering.replicated` too: faster than tfmp's former sum over
    # the window's taps.
    "AvgPoolGrad",
    "AvgPool3DGrad",
    # The gradients of `keras.ops.depthwise_conv` and `separable_conv`
    # (DepthwiseConv1D/2D, SeparableConv1D/2D), run by `tfmp.lowering.replicated`:
    # as fast as DTensor's own batch-split forward, and 3.5-27x faster than
    # tfmp's former sum over kernel taps (bench/generic_path.py).
    "DepthwiseConv2dNativeBackpropFilter",
    "DepthwiseConv2dNativeBackpropInput",
    # A dilated depthwise convolution runs between these (TensorFlow's
    # `with_space_to_batch`), each the other's gradient.
    "SpaceToBatchND",
    "BatchToSpaceND",
    # User code's `tf.linalg.band_part` (`keras.ops.tril` and `triu` have
    # tfmp's faster rewrite, `tfmp.lowering.arrays`).
    "MatrixBandPart",
    # `keras.ops.eye`, which has no tensor input to gather (Qwen 3.5's gated
    # delta net adds `ops.eye(chunk_size)`).
    "MatrixDiagV3",
    # Shape arithmetic where a dimension is known only at run time (sequences
    # of any length): a tensor's number of elements (the gradient of a gather
    # along such a dimension: a recurrence run backwards) and where each part
    # of a concatenation starts (its gradient: Bidirectional's outputs). Small
    # integer vectors, the same on every device.
    "Size",
    "ConcatOffset",
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


def import_tensorflow() -> None:
    """Imports TensorFlow; under `TF_CPP_MIN_LOG_LEVEL=3`, without the log
    lines its native libraries write before they read that setting.

    Those lines (such as `cudart_stub.cc:31] Could not find cuda drivers`)
    pass any threshold, so a program that asked TensorFlow for no logs gets
    them anyway; anything else written meanwhile is written as it was."""
    if "tensorflow" in sys.modules or os.environ.get(TF_LOG_LEVEL) != QUIET_LOG_LEVEL:
        import tensorflow  # noqa: F401

        return
    with _native_stderr_without_early_logs():
        import tensorflow  # noqa: F401


@contextlib.contextmanager
def _native_stderr_without_early_logs() -> Iterator[None]:
    """Holds back what is written to file descriptor 2 in the block (native
    code writes there directly), and writes it back without the early absl
    log lines when the block ends."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (a daemon): nothing to hold back
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [
                line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                if not _EARLY_NATIVE_LOG.match(line)
            ]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def started_as_command() -> bool:
    """Whether this process is the `tfmp` command line (its console script, or
    `python -m tfmp`), which imports the library only when a command needs
    it."""
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    if script in ("tfmp", "tfmp.exe", "tfmp-script.py"):
        return True
    # While `python -m X` imports X's packages, argv[0] is "-m".
    command = getattr(sys, "orig_argv", [])
    if sys.argv[:1] != ["-m"] or "-m" not in command:
        return False
    return command[command.index("-m") + 1 :][:1] == ["tfmp"]
