"""`Sharded`: give any Keras layer's weights layouts by weight name."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import keras

from tfmp.layers.declaring import DeclaresLayouts
from tfmp.layout import Axes


@keras.saving.register_keras_serializable(package="tfmp")
class Sharded(DeclaresLayouts, keras.layers.Wrapper):
    """Wraps a Keras layer and declares the layouts of its weights.

    The layer is built with one input shape (`keras.layers.Wrapper`), so use
    `ParallelMultiHeadAttention` rather than wrapping a `MultiHeadAttention`.

    Args:
        layer: An unbuilt Keras layer.
        layouts: Weight path relative to the layer (`"kernel"`, `"bias"`,
            `"query/kernel"`) -> one entry per dimension: None (whole), a mesh
            axis name, or True for `axis`.
        axis: The mesh axis that True entries stand for.
        **kwargs: Base `keras.layers.Layer` arguments (`name`, ...).

    Raises:
        ValueError: If `layer` is already built, or, once built, a key of
            `layouts` names no weight of the layer.

    Examples:
        >>> import keras, tfmp
        >>> dense = tfmp.layers.Sharded(keras.layers.Dense(64), {"kernel": (None, "model")})
        >>> same = tfmp.layers.Sharded(keras.layers.Dense(64), {"kernel": (None, True)})
    """

    def __init__(
        self,
        layer: keras.layers.Layer,
        layouts: Mapping[str, Sequence[Any]],
        axis: str = "model",
        **kwargs: Any,
    ):
        if layer.built:
            raise ValueError(
                f"Sharded({layer.name!r}) got a layer that is already built, so its "
                "weights exist and can no longer be laid out. Pass an unbuilt layer."
            )
        for key, axes in layouts.items():
            if isinstance(axes, str) or not isinstance(axes, (tuple, list)):
                raise TypeError(
                    f"Sharded layouts[{key!r}] = {axes!r}: give one entry per "
                    "dimension, such as (None, 'model') or (None, True)."
                )
        super().__init__(layer, axis=axis, **kwargs)
        self.layouts = {key: tuple(axes) for key, axes in layouts.items()}

    def weight_layouts(self) -> dict[str, Axes]:
        return {
            key: tuple(self.axis if entry is True else entry for entry in axes)
            for key, axes in self.layouts.items()
        }

    def build(self, input_shape: Any = None) -> None:
        super().build(input_shape)
        self._check_layout_keys()

    def _check_layout_keys(self) -> None:
        paths = [weight.path for weight in self.layer.weights]
        for key in self.layouts:
            if not any(path == key or path.endswith("/" + key) for path in paths):
                raise ValueError(
                    f"Sharded({self.layer.name!r}) declares a layout for {key!r}, but "
                    f"the layer has no such weight; its weights are {paths}."
                )

    def call(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return self.layer(inputs, *args, **kwargs)

    def compute_output_shape(self, input_shape: Any) -> Any:
        return self.layer.compute_output_shape(input_shape)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        # The inner layer is built by this wrapper, under its layouts: loading
        # must not build it first.
        config["layer"] = {
            key: value for key, value in config["layer"].items() if key != "build_config"
        }
        layouts = {key: list(axes) for key, axes in self.layouts.items()}
        return {**config, "layouts": layouts}
