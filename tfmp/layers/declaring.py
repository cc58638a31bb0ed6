"""The one mechanism by which tfmp layers say how their weights are split."""

from __future__ import annotations

import functools
from typing import Any

from tfmp.layout import Axes, declare_deferred, declared_layouts


class DeclaresLayouts:
    """Mixin for Keras layers that declare the layouts of their weights.

    It takes the `axis` argument (the mesh axis to split over) of every tfmp
    layer. A subclass implements `weight_layouts()`: weight path relative to the layer
    (`"kernel"`, `"query/kernel"`) -> mesh axes. In a `ModelParallelStrategy`
    scope the weights get those layouts, winning over the strategy's LayoutMap
    (a rule that disagrees is an error). Outside a scope, or on a mesh without
    the axis, the layer is its plain Keras counterpart.
    """

    def __init__(self, *args: Any, axis: str = "model", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.axis = axis
        # Wrap the instance's build (Keras' own per-instance wrapper, which
        # keeps the build signature Keras reads the input shapes from), so that
        # every path to it (first call, Sequential, loading) declares layouts.
        build = self.build

        @functools.wraps(build)
        def build_with_layouts(*build_args: Any, **build_kwargs: Any) -> None:
            layouts = self.weight_layouts()
            with declared_layouts(self.name, layouts):
                build(*build_args, **build_kwargs)
            declare_deferred(self.name, layouts, self.weights)

        self.build = build_with_layouts

    def weight_layouts(self) -> dict[str, Axes]:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "axis": self.axis}
