"""A Conv2D split by output filters, by input channels, or spatially."""

from __future__ import annotations

import warnings
from typing import Any

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.forward import batch_spec, relayout_with_gradient
from tfmp.layers.declaring import DeclaresLayouts
from tfmp.layout import Axes
from tfmp.lowering.conv import conv

SPLITS = ("filters", "channels", "spatial")


@keras.saving.register_keras_serializable(package="tfmp")
class ParallelConv2D(DeclaresLayouts, keras.layers.Conv2D):
    """`keras.layers.Conv2D` split over a mesh axis.

    - `split="filters"`: the kernel is split on output filters (column-parallel);
      each device computes its filters, no communication forward, one
      all-reduce of the input gradient backward.
    - `split="channels"`: the kernel is split on input channels (row-parallel,
      e.g. after a filter-split conv); one all-reduce of the output forward.
    - `split="spatial"`: the kernel is replicated and the activations' height is
      split over `axis` between layers. DTensor exchanges borders between
      neighbouring devices only on TPU, and tfmp does not use that yet: this
      layer gathers its input's height over `axis` before convolving (warned
      once) and splits the output again when its height divides by the axis
      size. That keeps activations split between layers; each device still
      convolves the whole height, so it saves memory, not compute.

    On a mesh these run as a sum over kernel taps of channel matmuls (DTensor's
    own Conv2D refuses split kernels); off the mesh this is `keras.layers.Conv2D`.
    Only `data_format="channels_last"` and `groups=1` are supported.

    Args:
        filters: As `keras.layers.Conv2D`.
        kernel_size: As `keras.layers.Conv2D`.
        split: `"filters"`, `"channels"` or `"spatial"`.
        axis: The mesh axis to split over.
        **kwargs: Any other `keras.layers.Conv2D` argument.

    Examples:
        >>> import keras, tfmp
        >>> cnn = keras.Sequential([
        ...     keras.Input((32, 32, 3)),
        ...     tfmp.layers.ParallelConv2D(64, 3, padding="same", split="filters"),
        ...     tfmp.layers.ParallelConv2D(64, 3, padding="same", split="channels"),
        ... ])
    """

    def __init__(
        self,
        filters: int,
        kernel_size: Any,
        split: str = "filters",
        axis: str = "model",
        **kwargs: Any,
    ):
        super().__init__(filters, kernel_size, axis=axis, **kwargs)
        if split not in SPLITS:
            raise ValueError(
                f"ParallelConv2D(split={split!r}) is not a split; use one of {SPLITS}."
            )
        if self.padding not in ("valid", "same"):
            raise ValueError(
                f"ParallelConv2D supports padding 'valid' or 'same', got {self.padding!r}."
            )
        if self.data_format != "channels_last" or self.groups != 1:
            raise ValueError(
                f"ParallelConv2D supports data_format='channels_last' and groups=1, got "
                f"data_format={self.data_format!r}, groups={self.groups}."
            )
        self.split = split
        self._warned_gather = False

    def weight_layouts(self) -> dict[str, Axes]:
        if self.split == "filters":
            return {"kernel": (None, None, None, self.axis), "bias": (self.axis,)}
        if self.split == "channels":
            return {"kernel": (None, None, self.axis, None)}
        return {}

    def convolution_op(self, inputs: Any, kernel: Any) -> Any:
        layout = getattr(getattr(kernel, "value", None), "layout", None)
        if layout is None:
            return super().convolution_op(inputs, kernel)
        mesh = layout.mesh
        if self.axis not in mesh.dim_names:
            # Nothing of this layer's to split: Keras' own path, which tfmp
            # lowers on a mesh all the same.
            return super().convolution_op(inputs, kernel)
        if self.split == "spatial":
            self._warn_gather()  # the tap-wise convolution gathers the height
        outputs = conv(inputs, kernel, self.strides, self.padding, self.data_format, self.dilation_rate)
        if self.split == "spatial" and outputs.shape[1] % mesh.dim_size(self.axis) == 0:
            batch = batch_spec(inputs, mesh, self.axis)
            outputs = relayout_with_gradient(outputs, _layout(mesh, batch, self.axis), _layout(mesh, batch))
        return outputs

    def _warn_gather(self) -> None:
        if self._warned_gather:
            return
        self._warned_gather = True
        warnings.warn(
            f"tfmp: ParallelConv2D {self.name!r} (split='spatial') gathers its "
            f"input's height over mesh axis {self.axis!r} before convolving: DTensor "
            "exchanges borders between devices only on TPU. Activations stay split "
            "between layers; each conv holds its whole input briefly.",
            stacklevel=3,
        )

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "split": self.split}


def _layout(mesh: dtensor.Mesh, batch: str, height: str = dtensor.UNSHARDED) -> dtensor.Layout:
    specs = [batch, height, dtensor.UNSHARDED, dtensor.UNSHARDED]
    return dtensor.Layout(specs, mesh)


