"""The N-D device mesh: named axes over a grid of devices."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp import devices as devices_lib


class DeviceMesh:
    """A grid of devices with named axes, as `keras.distribution.DeviceMesh`.

    Each axis is one way of splitting work: a `"batch"` axis splits the data,
    a `"model"` axis splits the kernels of layers.

    Args:
        shape: Number of devices along each axis, e.g. `(2, 4)`.
        axis_names: One name per axis, e.g. `("batch", "model")`.
        devices: Devices to lay out row-major over the grid (names such as
            `"cpu:0"` or `"/device:GPU:1"`). Defaults to the first
            `prod(shape)` devices of the preferred type (TPU, GPU, then CPU).

    Examples:
        >>> import tfmp
        >>> tfmp.simulate_devices(8)
        ['/device:CPU:0', ..., '/device:CPU:7']
        >>> mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
        >>> mesh.axis_size("model")
        4
    """

    def __init__(
        self,
        shape: Sequence[int],
        axis_names: Sequence[str],
        devices: Sequence[Any] | None = None,
    ):
        shape = _checked_shape(shape)
        axis_names = _checked_axis_names(axis_names)
        if len(shape) != len(axis_names):
            raise ValueError(
                f"DeviceMesh shape {shape} has {len(shape)} axes but axis_names "
                f"{axis_names} has {len(axis_names)}: give one name per axis."
            )
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(
                f"DeviceMesh axis_names {axis_names} repeat a name: give each axis "
                "its own name, such as ('batch', 'model')."
            )
        if any(size < 1 for size in shape):
            raise ValueError(f"DeviceMesh shape {shape} has an axis of size < 1.")
        needed = math.prod(shape)
        if devices is None:
            available = devices_lib.list_devices()
            if needed > len(available):
                raise ValueError(
                    f"DeviceMesh shape {shape} needs {needed} devices but only "
                    f"{len(available)} exist ({', '.join(available)}). Use a mesh "
                    f"with at most {len(available)} devices, or split the host "
                    f"with tfmp.simulate_devices({needed}) before TensorFlow starts."
                )
            devices = available[:needed]
        devices = [_device_name(device) for device in np.asarray(devices).flatten()]
        if len(devices) != needed:
            raise ValueError(
                f"DeviceMesh shape {shape} holds {needed} devices but {len(devices)} "
                f"were given: pass exactly {needed} devices or change the shape."
            )
        if len(set(devices)) != len(devices):
            raise ValueError(f"DeviceMesh devices {devices} repeat a device.")
        _check_devices_exist(devices)
        self._shape = shape
        self._axis_names = axis_names
        self._devices = np.array(devices, dtype=object).reshape(shape)
        self._dtensor_mesh = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._axis_names

    @property
    def devices(self) -> np.ndarray:
        """Device names in a numpy array of the mesh's shape."""
        return self._devices

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    def axis_size(self, axis_name: str) -> int:
        """Number of devices along `axis_name`."""
        self.check_axis(axis_name)
        return self._shape[self._axis_names.index(axis_name)]

    def client_positions(self, axis_name: str) -> dict[int, tuple[int, ...]]:
        """The positions along `axis_name` that each client's devices hold
        (a client is the task of a device's name; 0 when the name has none)."""
        axis = self._axis_names.index(axis_name)
        positions: dict[int, set[int]] = {}
        for index, device in np.ndenumerate(self._devices):
            client = tf.DeviceSpec.from_string(device).task or 0
            positions.setdefault(client, set()).add(index[axis])
        return {client: tuple(sorted(held)) for client, held in positions.items()}

    def check_axis(self, axis_name: str, what: str = "axis") -> None:
        """Raises a ValueError naming `axis_name` if the mesh has no such axis."""
        if axis_name not in self._axis_names:
            raise ValueError(
                f"{what} {axis_name!r} is not an axis of the mesh "
                f"{dict(zip(self._axis_names, self._shape))}. Use one of "
                f"{list(self._axis_names)}, or add the axis to the mesh."
            )

    @property
    def dtensor_mesh(self) -> dtensor.Mesh:
        """The `tf.experimental.dtensor.Mesh` for these devices."""
        if self._dtensor_mesh is None:
            devices = list(self._devices.flatten())
            if dtensor.num_clients() == 1:
                self._dtensor_mesh = dtensor.create_mesh(
                    list(zip(self._axis_names, self._shape)), devices=devices
                )
            else:
                self._dtensor_mesh = _multi_client_mesh(self._axis_names, self._shape, devices)
        return self._dtensor_mesh

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DeviceMesh)
            and self._shape == other._shape
            and self._axis_names == other._axis_names
            and list(self._devices.flatten()) == list(other._devices.flatten())
        )

    def __hash__(self) -> int:
        return hash((self._shape, self._axis_names, tuple(self._devices.flatten())))

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self._axis_names, self._shape))
        return f"DeviceMesh({axes}; {self.size} x {_device_type(self._devices.flat[0])})"


def as_device_mesh(mesh: Any) -> DeviceMesh:
    """Returns a tfmp `DeviceMesh` for a tfmp, Keras or DTensor mesh."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, dtensor.Mesh):
        names = list(mesh.dim_names)
        converted = DeviceMesh(
            [mesh.dim_size(n) for n in names], names, mesh.local_devices()
        )
        converted._dtensor_mesh = mesh
        return converted
    if all(hasattr(mesh, a) for a in ("shape", "axis_names", "devices")):
        return DeviceMesh(mesh.shape, mesh.axis_names, mesh.devices)
    raise TypeError(
        f"Expected a tfmp.DeviceMesh or keras.distribution.DeviceMesh, got "
        f"{type(mesh).__name__}: {mesh!r}."
    )


def _multi_client_mesh(
    axis_names: Sequence[str], shape: Sequence[int], devices: list[str]
) -> dtensor.Mesh:
    """A mesh over the devices of several clients; this client owns its own."""
    client = dtensor.client_id()
    local_ids = [i for i, d in enumerate(devices) if tf.DeviceSpec.from_string(d).task == client]
    if not local_ids:
        raise ValueError(
            f"A DeviceMesh of shape {tuple(shape)} over {devices} holds none of the "
            f"devices of this client ({client}): in a multi-client run every mesh "
            "spans all clients. Use a mesh of all their devices."
        )
    return dtensor.Mesh(
        list(axis_names),
        np.arange(len(devices)).reshape(shape),
        local_ids,
        [devices[i] for i in local_ids],
    )


def _checked_shape(shape: Any) -> tuple[int, ...]:
    """The mesh shape as ints; a lone number, floats, bools or strings are
    refused rather than rounded or parsed."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        raise TypeError(
            f"DeviceMesh shape must be a sequence of axis sizes, got the number {shape!r}: "
            f"for a 1-D mesh of {shape} devices write shape=({shape},)."
        )
    if not _is_sequence(shape):
        raise TypeError(
            f"DeviceMesh shape must be a sequence of axis sizes such as (2, 4), got {shape!r}."
        )
    for size in shape:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise TypeError(
                f"DeviceMesh shape {tuple(shape)!r} has the size {size!r} "
                f"({type(size).__name__}): every axis size must be a whole number of "
                "devices (an int), such as (2, 4)."
            )
    return tuple(int(size) for size in shape)


def _checked_axis_names(axis_names: Any) -> tuple[str, ...]:
    """The axis names; a single string (which would split into letters) and
    names that are not non-empty strings are refused."""
    if isinstance(axis_names, str):
        raise TypeError(
            f"DeviceMesh axis_names must be a sequence of names, got the string "
            f"{axis_names!r} (read as {tuple(axis_names)!r}): write "
            f"axis_names=({axis_names!r},) for one axis, or ('batch', 'model') for two."
        )
    if not _is_sequence(axis_names):
        raise TypeError(
            f"DeviceMesh axis_names must be a sequence of names such as ('batch', 'model'), "
            f"got {axis_names!r}."
        )
    for name in axis_names:
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"DeviceMesh axis_names {tuple(axis_names)!r} has the name {name!r}: "
                "every axis name must be a non-empty string such as 'batch'."
            )
    return tuple(axis_names)


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, (str, bytes))


def _check_devices_exist(devices: list[str]) -> None:
    """Refuses a device of this client that TensorFlow does not have; devices
    named with a job or task belong to a cluster and are checked when the
    clients connect."""
    local = {
        tf.DeviceSpec.from_string(name).replace(job=None, replica=None, task=None).to_string()
        for name in devices_lib.all_logical_devices()
    }
    for device in devices:
        spec = tf.DeviceSpec.from_string(device)
        if spec.job is None and spec.task is None and device not in local:
            raise ValueError(
                f"DeviceMesh device {device!r} does not exist on this machine, which has "
                f"{', '.join(sorted(local)) or 'no devices'}. Use existing devices, or "
                "split the host with tfmp.simulate_devices(n) before TensorFlow starts."
            )


def _device_name(device: Any) -> str:
    name = getattr(device, "name", device)
    spec = tf.DeviceSpec.from_string(str(name))
    if spec.device_type is None or spec.device_index is None:
        raise ValueError(
            f"Device {device!r} is not a device name such as 'cpu:0' or '/device:GPU:1'."
        )
    return spec.replace(device_type=spec.device_type.upper()).to_string()


def _device_type(name: str) -> str:
    return tf.DeviceSpec.from_string(name).device_type
