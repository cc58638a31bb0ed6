"""Finding devices and splitting one physical device into several logical ones."""

from __future__ import annotations

import os

import tensorflow as tf

_PREFERRED_TYPES = ("TPU", "GPU", "CPU")


def simulate_devices(
    n: int, device_type: str = "CPU", memory_limit_mb: int | None = None
) -> list[str]:
    """Splits the first physical device of a type into `n` logical devices.

    This lets every mesh shape up to `n` devices run on one machine: a laptop CPU
    or one GPU. It must be called before TensorFlow initializes its devices, that
    is before any tensor is created or any Keras model is built.

    Splitting the CPU also gives each op its share of the cores: unless the
    program set TensorFlow's intra-op threads itself
    (`tf.config.threading.set_intra_op_parallelism_threads` or
    `TF_NUM_INTRAOP_THREADS`), they become `max(1, cores // n)` instead of
    TensorFlow's default of all the cores. The n devices run their ops side by
    side, so splitting each op over every core too only adds hand-offs between
    threads (docs/performance.md measures it; the losses stayed identical).
    The setting holds for the whole process, ops outside the mesh too.

    Args:
        n: Number of logical devices to create.
        device_type: `"CPU"` or `"GPU"`.
        memory_limit_mb: Memory of each logical GPU in MiB (GPU only; defaults
            to 1024).

    Returns:
        The names of the logical devices of that type.

    Raises:
        RuntimeError: If TensorFlow has already initialized its devices with a
            different split.
        ValueError: For a bad `n` or `device_type`.

    Examples:
        >>> import tfmp
        >>> tfmp.simulate_devices(8)
        ['/device:CPU:0', ..., '/device:CPU:7']
    """
    device_type = device_type.upper()
    if device_type not in ("CPU", "GPU"):
        raise ValueError(
            f"simulate_devices(device_type={device_type!r}) is not supported: "
            "use 'CPU' or 'GPU'."
        )
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"simulate_devices(n={n!r}): n must be a positive integer.")
    physical = tf.config.list_physical_devices(device_type)
    if not physical:
        raise ValueError(
            f"simulate_devices(device_type={device_type!r}): this machine has no "
            f"{device_type}. Use device_type='CPU'."
        )
    current = tf.config.get_logical_device_configuration(physical[0]) or []
    if len(current) == n:
        return _logical_names(device_type)
    if device_type == "GPU":
        limit = memory_limit_mb or 1024
        configs = [tf.config.LogicalDeviceConfiguration(memory_limit=limit)] * n
    else:
        configs = [tf.config.LogicalDeviceConfiguration()] * n
    try:
        tf.config.set_logical_device_configuration(physical[0], configs)
    except RuntimeError as error:
        have = len(tf.config.list_logical_devices(device_type))
        raise RuntimeError(
            f"tfmp.simulate_devices({n}) was called after TensorFlow had initialized "
            f"its devices (it now has {have} logical {device_type} device(s), which "
            "can no longer change). Call tfmp.simulate_devices() first in your "
            "program, before creating any tensor, model or mesh."
        ) from error
    if device_type == "CPU":
        _share_cores(n)
    return _logical_names(device_type)


def _share_cores(n: int) -> None:
    """Sets TensorFlow's intra-op threads to `max(1, cores // n)`, unless the
    program chose a number (or TensorFlow has started: then it stays)."""
    if os.environ.get("TF_NUM_INTRAOP_THREADS"):
        return
    if tf.config.threading.get_intra_op_parallelism_threads():
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // n)
    if threads >= (cores or 1):
        return  # TensorFlow's default: every core
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    except RuntimeError:
        pass  # TensorFlow has started; its threads can no longer change


def is_simulated(device_type: str) -> bool:
    """Whether this machine's first physical device of `device_type` is split
    into several logical devices (`simulate_devices`)."""
    physical = tf.config.list_physical_devices(device_type)
    return bool(physical) and len(tf.config.get_logical_device_configuration(physical[0]) or []) > 1


def devices_for(count: int) -> list[str]:
    """`count` devices for a mesh: TPU cores or GPUs when there are that many,
    else CPU devices (split with `simulate_devices` first).

    Args:
        count: How many devices the mesh needs.

    Returns:
        Device names, as `list_devices` gives them.

    Examples:
        >>> import tfmp
        >>> tfmp.simulate_devices(8)
        ['/device:CPU:0', ..., '/device:CPU:7']
        >>> mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"), tfmp.devices.devices_for(8))
    """
    preferred = list_devices()
    return (preferred if len(preferred) >= count else list_devices("CPU"))[:count]


def _client_order(name: str) -> tuple[int, int]:
    # A multi-client run lists its own devices first; a mesh wants client 0's.
    spec = tf.DeviceSpec.from_string(name)
    return spec.task or 0, spec.device_index or 0


def _logical_names(device_type: str) -> list[str]:
    return [d.name for d in tf.config.list_logical_devices(device_type)]


def all_logical_devices() -> list[str]:
    """The names of every logical device TensorFlow has, of every type."""
    return [device.name for device in tf.config.list_logical_devices()]


def list_devices(device_type: str | None = None) -> list[str]:
    """Returns the logical devices of a type, or of the preferred type.

    The preferred type is TPU, then GPU, then CPU: the first one present.

    Args:
        device_type: `"CPU"`, `"GPU"`, `"TPU"`, or `None` for the preferred type.

    Returns:
        Device names such as `"/device:CPU:0"`; in a multi-client run (see
        `tfmp.initialize`), every client's, such as
        `"/job:worker/replica:0/task:1/device:CPU:0"`, client 0's first.
    """
    types = (device_type.upper(),) if device_type else _PREFERRED_TYPES
    for kind in types:
        names = _logical_names(kind)
        if names:
            return sorted(names, key=_client_order)
    return []
