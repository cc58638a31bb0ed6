"""Multi-head attention split over heads."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tfmp import integrations
from tfmp.forward import BACKWARD_SCOPE
from tfmp.integrations import Patch
from tfmp.layers.declaring import DeclaresLayouts
from tfmp.layout import Axes


@keras.saving.register_keras_serializable(package="tfmp")
class ParallelMultiHeadAttention(DeclaresLayouts, keras.layers.MultiHeadAttention):
    """`keras.layers.MultiHeadAttention` with its heads split over a mesh axis.

    The query, key and value projections are split on heads (column-parallel),
    so each device attends with its own heads; the output projection is split
    on heads too (row-parallel), so one all-reduce forms the output. `num_heads`
    must divide by the size of `axis` to be split.

    Args:
        num_heads: As `keras.layers.MultiHeadAttention`.
        key_dim: As `keras.layers.MultiHeadAttention`.
        axis: The mesh axis to split heads over.
        **kwargs: Any other `keras.layers.MultiHeadAttention` argument.

    Examples:
        >>> import tfmp
        >>> attention = tfmp.layers.ParallelMultiHeadAttention(8, 64, axis="model")
    """

    def __init__(self, num_heads: int, key_dim: int, axis: str = "model", **kwargs: Any):
        super().__init__(num_heads, key_dim, axis=axis, **kwargs)

    def weight_layouts(self) -> dict[str, Axes]:
        heads = (None, self.axis, None)
        head_biases = (self.axis, None)
        return {
            "query/kernel": heads,
            "key/kernel": heads,
            "value/kernel": heads,
            "query/bias": head_biases,
            "key/bias": head_biases,
            "value/bias": head_biases,
            "attention_output/kernel": (self.axis, None, None),
        }

    def call(self, query: Any, value: Any, key: Any = None, **kwargs: Any) -> Any:
        projections = (self._query_dense, self._key_dense, self._value_dense)
        layout = getattr(self._query_dense.kernel.value, "layout", None)
        if (
            layout is None
            or self.axis not in layout.sharding_specs
            or value is not query
            or (key is not None and key is not query)
            or not all(map(_plain_einsum_dense, projections))
        ):
            return super().call(query, value, key, **kwargs)
        # Self-attention: project once with a gradient that sums the three
        # input gradients before DTensor reduces them over the heads axis,
        # one all-reduce as with Megatron's fused QKV, instead of three.
        outputs = _self_attention_projections(query, projections)
        saved = {}
        try:
            for name, output in zip(("_query_dense", "_key_dense", "_value_dense"), outputs):
                saved[name] = getattr(self, name)
                object.__setattr__(self, name, lambda _, output=output: output)
            return super().call(query, value, key, **kwargs)
        finally:
            for name, layer in saved.items():
                object.__setattr__(self, name, layer)



def _plain_einsum_dense(layer: Any) -> bool:
    return (
        layer.activation in (None, keras.activations.linear)
        and not getattr(layer, "lora_enabled", False)
        and "..." not in layer.equation
    )


def _self_attention_projections(x: Any, layers: tuple) -> list:
    """The query, key and value projections of `x`, with one summed input gradient."""
    equations = [layer.equation for layer in layers]
    kernels = [tf.convert_to_tensor(layer.kernel) for layer in layers]
    biases = [None if layer.bias is None else tf.convert_to_tensor(layer.bias) for layer in layers]
    weights = kernels + [b for b in biases if b is not None]

    @tf.custom_gradient
    def project(x, *unused_weights):
        outputs = []
        for equation, kernel, bias in zip(equations, kernels, biases):
            y = tf.einsum(equation, x, kernel)
            outputs.append(y if bias is None else y + bias)

        def grad(*upstreams):
            with tf.name_scope(BACKWARD_SCOPE):
                return _projection_grads(upstreams)

        def _projection_grads(upstreams):
            input_grads, kernel_grads, bias_grads = [], [], []
            for layer, equation, kernel, bias, dy in zip(
                layers, equations, kernels, biases, upstreams
            ):
                inputs, rest = equation.split(",")
                kernel_dims, output_dims = rest.split("->")
                input_grads.append(tf.einsum(f"{output_dims},{kernel_dims}->{inputs}", dy, kernel))
                kernel_grads.append(tf.einsum(f"{inputs},{output_dims}->{kernel_dims}", x, dy))
                if bias is not None:
                    bias_grads.append(tf.einsum(f"{output_dims}->{layer.bias_axes}", dy))
            return [tf.add_n(input_grads)] + kernel_grads + bias_grads

        return outputs, grad

    return project(x, *weights)


integrations.declare(
    __name__,
    (
        Patch(
            "keras.src.layers.attention.multi_head_attention:MultiHeadAttention",
            name,
            ParallelMultiHeadAttention,
            "Self-attention projects query, key and value in one all-reduce of "
            "the input's gradient.",
            kind="instance",
        )
        for name in ("_query_dense", "_key_dense", "_value_dense")
    ),
)
