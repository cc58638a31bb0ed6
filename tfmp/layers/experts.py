"""A mixture-of-experts feed-forward layer whose experts are split over a mesh axis."""

from __future__ import annotations

import math
from typing import Any

import keras
import tensorflow as tf
from keras import ops
from tensorflow.experimental import dtensor

from tfmp.forward import batch_spec, forward_mesh
from tfmp.layers.declaring import DeclaresLayouts
from tfmp.layout import Axes, split_on_use


@keras.saving.register_keras_serializable(package="tfmp")
class MixtureOfExperts(DeclaresLayouts, keras.layers.Layer):
    """Feed-forward experts with top-k routing and a capacity per example (GShard, Switch).

    Takes `(batch, sequence, features)` and returns the same shape. A router
    (a `features -> num_experts` kernel and a softmax, in float32 under any
    dtype policy) sends each token to its
    `top_k` most probable experts, each a two-layer network `features ->
    hidden_dim (activation) -> features`. The output is the chosen experts'
    outputs weighted by the router's probabilities, renormalized over the
    chosen experts when `top_k > 1` (with `top_k=1`, Switch Transformer's
    raw probability). An expert takes at most `capacity` tokens of each
    example, `ceil(top_k * sequence * capacity_factor / num_experts)`;
    tokens are counted by choice (every first choice before any second one)
    then by position, and a token past the capacity is dropped by that
    expert (its weight there is 0; the block's residual connection carries
    it). With `aux_loss_weight > 0` the layer adds Switch Transformer's
    load-balancing loss, `num_experts * sum(fraction of first choices *
    mean probability)` per expert, times the weight.

    On a mesh with `axis`, the experts' weights are split over that axis:
    each device holds `num_experts / axis size` whole experts and their
    optimizer slots. With `axis` the axis that splits the batch (the default
    "batch", the strategy's batch axis), each device routes its own tokens,
    which go to their experts' devices and come back by one all-to-all each
    way (GShard's expert parallelism). Over another axis, the devices of
    that axis route the same tokens, each through its own experts, and the
    outputs are summed over the axis. Routing is per example, so the mesh
    routes, keeps and drops exactly the tokens one device does. Off a mesh,
    or on a mesh without `axis`, it is the same layer on one device.

    Args:
        num_experts: Number of experts; must divide by the size of `axis`.
        hidden_dim: Width of each expert's hidden layer.
        top_k: Experts per token.
        capacity_factor: Slack of each expert's capacity over an even share.
        activation: Of the experts' hidden layer.
        aux_loss_weight: Weight of the load-balancing loss (0: none).
        axis: The mesh axis to split the experts over.
        kernel_initializer: For the router's and the experts' kernels.
        **kwargs: Any other `keras.layers.Layer` argument.

    Examples:
        >>> import keras, tfmp
        >>> tokens = keras.Input((16, 32))
        >>> moe = tfmp.layers.MixtureOfExperts(num_experts=8, hidden_dim=64, top_k=2)
        >>> moe(tokens).shape
        (None, 16, 32)
    """

    def __init__(
        self,
        num_experts: int,
        hidden_dim: int,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        activation: Any = "gelu",
        aux_loss_weight: float = 0.0,
        axis: str = "batch",
        kernel_initializer: Any = "glorot_uniform",
        **kwargs: Any,
    ):
        super().__init__(axis=axis, **kwargs)
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"MixtureOfExperts: top_k={top_k} must be between 1 and num_experts={num_experts}."
            )
        if capacity_factor <= 0:
            raise ValueError(f"MixtureOfExperts: capacity_factor={capacity_factor} must be positive.")
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.activation = keras.activations.get(activation)
        self.aux_loss_weight = aux_loss_weight
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def weight_layouts(self) -> dict[str, Axes]:
        return {
            "router_kernel": (None, None),
            "expert_kernel_in": split_on_use((self.axis, None, None)),
            "expert_bias_in": split_on_use((self.axis, None)),
            "expert_kernel_out": split_on_use((self.axis, None, None)),
            "expert_bias_out": split_on_use((self.axis, None)),
        }

    def build(self, input_shape: Any) -> None:
        if len(input_shape) != 3 or input_shape[1] is None or input_shape[2] is None:
            raise ValueError(
                "MixtureOfExperts takes (batch, sequence, features) inputs with a known "
                f"sequence length and feature count; got shape {tuple(input_shape)}. Give "
                "the model's keras.Input a full shape, e.g. keras.Input((128, 512))."
            )
        features, experts, hidden = int(input_shape[2]), self.num_experts, self.hidden_dim
        # Routing in float32 whatever the compute dtype (Switch Transformer's
        # selective precision): a bfloat16 router would tie and flip choices.
        self.router_kernel = self.add_weight(
            name="router_kernel",
            shape=(features, experts),
            initializer=self.kernel_initializer,
            dtype="float32",
            autocast=False,
        )
        self.expert_kernel_in = self.add_weight(
            name="expert_kernel_in", shape=(experts, features, hidden), initializer=self.kernel_initializer
        )
        self.expert_bias_in = self.add_weight(name="expert_bias_in", shape=(experts, hidden), initializer="zeros")
        self.expert_kernel_out = self.add_weight(
            name="expert_kernel_out", shape=(experts, hidden, features), initializer=self.kernel_initializer
        )
        self.expert_bias_out = self.add_weight(name="expert_bias_out", shape=(experts, features), initializer="zeros")

    def capacity(self, sequence: int) -> int:
        """Tokens each expert takes from one example of `sequence` tokens."""
        return max(1, math.ceil(self.top_k * sequence * self.capacity_factor / self.num_experts))

    def call(self, inputs: Any) -> Any:
        mesh = forward_mesh()
        if mesh is not None and self.axis in mesh.dim_names and self.num_experts % mesh.dim_size(self.axis):
            raise ValueError(
                f"MixtureOfExperts '{self.name}': num_experts={self.num_experts} does not divide "
                f"by the size of mesh axis '{self.axis}' ({mesh.dim_size(self.axis)}). Choose "
                "a number of experts that does, or another axis."
            )
        logits = ops.einsum("gsm,me->gse", ops.cast(inputs, "float32"), self.router_kernel)
        probabilities = ops.softmax(logits, axis=-1)
        dispatch, combine, first_choices = self._routes(probabilities, self.capacity(inputs.shape[1]))
        if self.aux_loss_weight:
            self._add_balance_loss(probabilities, first_choices)
        expert_inputs = ops.einsum("gsec,gsm->egcm", ops.cast(dispatch, inputs.dtype), inputs)
        expert_inputs = _to_experts(expert_inputs, mesh, self.axis, inputs)
        kernel_in, bias_in, kernel_out, bias_out = (
            ops.cast(weight, inputs.dtype)
            for weight in (self.expert_kernel_in, self.expert_bias_in, self.expert_kernel_out, self.expert_bias_out)
        )
        hidden = ops.einsum("egcm,emh->egch", expert_inputs, kernel_in) + bias_in[:, None, None, :]
        outputs = ops.einsum("egch,ehm->egcm", self.activation(hidden), kernel_out) + bias_out[:, None, None, :]
        outputs = _to_tokens(outputs, mesh, self.axis, inputs)
        return ops.einsum("gsec,egcm->gsm", ops.cast(combine, inputs.dtype), outputs)

    def _routes(self, probabilities: Any, capacity: int) -> tuple[Any, Any, Any]:
        """`(dispatch, combine, first choices)`: the first two `(batch,
        sequence, experts, capacity)`, 1 where a token takes a slot of an
        expert and its weight there; the last each token's first expert,
        one-hot `(batch, sequence, experts)`."""
        remaining = probabilities
        taken = ops.zeros_like(probabilities[:, 0, :])  # slots filled per example and expert
        choices, gates = [], []
        for _ in range(self.top_k):
            chosen = ops.one_hot(ops.argmax(remaining, axis=-1), self.num_experts, dtype="float32")
            if not choices:
                first_choices = chosen
            slot = ops.cumsum(chosen, axis=1) - chosen + taken[:, None, :]  # 0-based, in order
            taken = taken + ops.sum(chosen, axis=1)
            kept = chosen * ops.cast(slot < capacity, "float32")
            choices.append(kept[..., None] * ops.one_hot(ops.cast(slot, "int32"), capacity, dtype="float32"))
            gates.append(ops.sum(probabilities * chosen, axis=-1))
            remaining = ops.where(chosen > 0, -1.0, remaining)
        total = sum(gates) if self.top_k > 1 else 1.0
        dispatch = sum(choices)
        combine = sum((gate / total)[:, :, None, None] * choice for gate, choice in zip(gates, choices))
        return dispatch, combine, first_choices

    def _add_balance_loss(self, probabilities: Any, first_choices: Any) -> None:
        share = ops.mean(first_choices, axis=(0, 1))
        mean_probability = ops.mean(probabilities, axis=(0, 1))
        self.add_loss(self.aux_loss_weight * self.num_experts * ops.sum(share * mean_probability))

    def compute_output_shape(self, input_shape: Any) -> Any:
        return input_shape

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "num_experts": self.num_experts,
            "hidden_dim": self.hidden_dim,
            "top_k": self.top_k,
            "capacity_factor": self.capacity_factor,
            "activation": keras.activations.serialize(self.activation),
            "aux_loss_weight": self.aux_loss_weight,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
        }


def _to_experts(tokens: Any, mesh: dtensor.Mesh | None, axis: str, inputs: Any) -> Any:
    """`(experts, batch, capacity, features)` dispatched tokens split over
    `axis` by expert: from the batch's split over `axis`, an all-to-all;
    from a whole batch (one that does not divide) or one split over another
    axis, a slice. In an eager call (no strategy step) DTensor places them."""
    tokens_batch = _tokens_batch(mesh, axis, inputs)
    if tokens_batch is None:
        return tokens
    unsharded = dtensor.UNSHARDED
    return _exchanged(
        tokens,
        dtensor.Layout([unsharded, tokens_batch, unsharded, unsharded], mesh),
        dtensor.Layout([axis, unsharded if tokens_batch == axis else tokens_batch, unsharded, unsharded], mesh),
    )


def _to_tokens(outputs: Any, mesh: dtensor.Mesh | None, axis: str, inputs: Any) -> Any:
    """The experts' outputs back with their tokens where `axis` splits the
    batch (an all-to-all). Elsewhere they stay split by expert, and
    combining them sums over `axis`."""
    if _tokens_batch(mesh, axis, inputs) != axis:
        return outputs
    unsharded = dtensor.UNSHARDED
    return _exchanged(
        outputs,
        dtensor.Layout([axis, unsharded, unsharded, unsharded], mesh),
        dtensor.Layout([unsharded, axis, unsharded, unsharded], mesh),
    )


def _tokens_batch(mesh: dtensor.Mesh | None, axis: str, inputs: Any) -> str | None:
    """How the strategy's step splits the tokens' batch (a mesh axis, or
    UNSHARDED), where the layer moves the tokens itself; None on no mesh,
    a mesh without `axis`, or outside a strategy's step (an eager call,
    whose tokens DTensor places: there the layer's relayouts met DTensor's
    all-to-all bug)."""
    if mesh is None or axis not in mesh.dim_names:
        return None
    if getattr(tf.distribute.get_strategy(), "batch_axis", None) is None:
        return None
    return batch_spec(inputs, mesh, other_axis="")


def _exchanged(value: Any, before: dtensor.Layout, after: dtensor.Layout) -> Any:
    """`value` moved from `before` to `after`, which differ in one
    dimension's split (an all-to-all where one mesh axis moves between
    dimensions, else a slice), in both passes. DTensor
    lowers a relayout that also gathers another dimension (the features,
    split where the layers around are tensor-parallel) to an all-to-all of
    the wrong shape ("'tf.Reshape' op requires 'output' number of elements
    to match"), so the gathers come first: `before` here, and in the
    gradient the last relayout to `after` (a relayout's gradient goes to the
    layout of its input)."""
    value = dtensor.relayout(value, before)
    return dtensor.relayout(dtensor.relayout(value, after), after)
