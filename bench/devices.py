"""`--devices cpu|gpu` for the benchmarks: which devices a benchmark's meshes use.

Shared by the scripts in bench/ (they run as `python bench/<script>.py`, so
this folder is on `sys.path`: `import devices as bench_devices`). It imports
TensorFlow only inside `setup()`, which must run before TensorFlow initializes
its devices (before any tensor, model or mesh is made).

- `cpu`: the host CPU split into `n` logical CPU devices
  (`tfmp.simulate_devices(n)`).
- `gpu`: `n` real GPUs when the machine has that many, each one logical GPU
  (optionally capped at `memory_limit_mb`), and DTensor's collectives on NCCL
  (`DTENSOR_GPU_USE_NCCL_COMMUNICATION=1`). With fewer GPUs, the first GPU is
  split into `n` logical GPUs of `memory_limit_mb` each (default: its memory
  / n, less 10%); DTensor's NCCL path needs one logical GPU per physical GPU
  (shared/notes/dtensor-keras-findings.md item 27), so split GPUs communicate
  through TensorFlow's own collective ops, not NCCL.

Usage in a benchmark:

    import devices as bench_devices
    parser = argparse.ArgumentParser()
    bench_devices.add_argument(parser)
    args = parser.parse_args()
    names = bench_devices.setup(args.devices, 8)   # before any TensorFlow op
    mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"), names)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess

NCCL_VARIABLE = "DTENSOR_GPU_USE_NCCL_COMMUNICATION"
CHOICES = ("cpu", "gpu")

# What setup() chose, for describe().
_chosen: dict[str, object] = {}


def add_argument(parser: argparse.ArgumentParser) -> None:
    """Adds `--devices cpu|gpu` (default cpu) to a benchmark's parser."""
    parser.add_argument(
        "--devices", choices=CHOICES, default="cpu",
        help="cpu: the host split into logical CPU devices (default); gpu: real GPUs, "
        "or the first GPU split into logical GPUs",
    )


def gpu_memory_mb() -> int | None:
    """The first GPU's memory in MiB (from nvidia-smi), or None if unknown."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30,
        ).stdout.split()
        return int(out[0]) if out else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def setup(kind: str, n: int, memory_limit_mb: int | None = None) -> list[str]:
    """Makes `n` devices of `kind` ("cpu" or "gpu") and returns their names.

    Must be called before TensorFlow initializes its devices. For "gpu",
    `memory_limit_mb` caps each device's memory (a real limit: an allocation
    beyond it fails with an out-of-memory error).
    """
    import tensorflow as tf

    import tfmp

    kind = kind.lower()
    if kind not in CHOICES:
        raise ValueError(f"--devices {kind!r}: choose from {CHOICES}")
    if kind == "cpu":
        names = tfmp.simulate_devices(n)[:n]
        _chosen.update(kind="cpu", how=f"{n} logical CPU devices", nccl=False)
        return names
    physical = tf.config.list_physical_devices("GPU")
    if not physical:
        raise SystemExit("--devices gpu: TensorFlow sees no GPU on this machine.")
    if len(physical) >= n:
        if memory_limit_mb:
            for gpu in physical[:n]:
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)]
                )
        # One logical GPU per physical GPU: DTensor may use NCCL.
        os.environ[NCCL_VARIABLE] = "1"
        names = tfmp.list_devices("GPU")[:n]
        limit = f", {memory_limit_mb} MiB each" if memory_limit_mb else ""
        _chosen.update(kind="gpu", how=f"{n} GPUs{limit}", nccl=True, split=False)
        return names
    if memory_limit_mb is None:
        total = gpu_memory_mb()
        memory_limit_mb = int(total * 0.9 / n) if total else 1024
    os.environ.pop(NCCL_VARIABLE, None)  # DTensor's NCCL path refuses split GPUs
    names = tfmp.simulate_devices(n, "GPU", memory_limit_mb=memory_limit_mb)[:n]
    _chosen.update(
        kind="gpu", nccl=False, split=True,
        how=f"the first GPU split into {n} logical GPUs of {memory_limit_mb} MiB",
    )
    return names


def split_gpu() -> bool:
    """Whether setup() split one GPU into several logical GPUs."""
    return bool(_chosen.get("split"))


def mirrored_cross_device_ops():
    """The all-reduce for `tf.distribute.MirroredStrategy` on setup()'s devices:
    its default (NCCL on GPUs) except on logical GPUs that share one physical
    GPU, which NCCL cannot put in one communicator: there the gradients are
    summed on the host CPU (summing on the first GPU would put every replica's
    gradients on it, a memory cost the other strategies do not pay)."""
    import tensorflow as tf

    if _chosen.get("kind") == "gpu" and split_gpu():
        return tf.distribute.ReductionToOneDevice(reduce_to_device="/device:CPU:0")
    return None


def describe() -> str:
    """One line: the devices setup() made and how they communicate."""
    if not _chosen:
        return "devices not set up"
    if _chosen["kind"] == "cpu":
        return str(_chosen["how"])
    comm = "DTensor collectives on NCCL" if _chosen["nccl"] else (
        "DTensor collectives on TensorFlow's collective ops (no NCCL: split GPU)"
    )
    return f"{_chosen['how']}; {comm}"
