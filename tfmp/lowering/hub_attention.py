"""KerasHub's attention layers under context parallelism: through
`keras.ops.dot_product_attention`, which tfmp computes a block of keys at a
time (`tfmp.lowering.attention`).

Llama, Mistral, Qwen, Gemma and most of KerasHub's language models compute
attention in one of two ways. Where KerasHub finds a fused attention op (JAX,
torch) they call `ops.dot_product_attention`; on TensorFlow they compute the
scores with `einsum` and take their own softmax. Under context parallelism
that own softmax keeps each device's queries' scores against every key for
the backward pass, `queries / N x keys` per layer, as Keras' attention did
before it was lowered. So while a layer's `_compute_attention` is traced
under context parallelism, tfmp answers its question "is a fused op there?"
with yes, where the fused path computes what the layer's own path does:

- no logit soft cap (Keras' op takes one on JAX's TPUs only);
- no dropout of the scores, where the layer's own path drops them out and
  the fused path does not (Gemma, GPT-NeoX);
- no sliding window narrower than the keys, where the layer's own path
  alone applies it (Qwen: the fused path ignores the window);
- flash attention not turned off (`keras.config.disable_flash_attention()`).

The masks are the layer's own (padding, causal, Mistral's window), handed to
the op as KerasHub's fused path hands them. The fused path's softmax masks
with Keras' large negative number where the layer's `Softmax` adds it: a
query whose keys are all masked (a left-padded position) attends to every
key evenly in both; every other query's numbers differ from one device's in
the float order only.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import keras

from tfmp.forward import forward_mesh
from tfmp.integrations import Patch
from tfmp.tracing import context, scoped

_MODELS = "keras_hub.src.models"
# KerasHub's question, asked by a module function or by a layer's method.
_MODULE_GATE = "fused_attention_op_available"
_LAYER_GATE = "_use_fused_attention_op"


@dataclasses.dataclass(frozen=True)
class HubAttention:
    """One KerasHub attention layer that takes `ops.dot_product_attention`
    where KerasHub finds a fused op.

    Attributes:
        module: Its module under `keras_hub.src.models`.
        layer: Its class.
        gate: What asks whether a fused op is there: the module's
            `fused_attention_op_available` or the layer's
            `_use_fused_attention_op`.
        key: The name of `_compute_attention`'s key parameter.
        drops_out_scores: Whether the layer's own path drops out its
            scores (the fused path does not).
        own_window: Whether the layer's own path alone applies its sliding
            window (`sliding_window_size`, where `use_sliding_window_attention`
            is on or absent).

    Examples:
        >>> from tfmp.lowering.hub_attention import HUB_ATTENTION
        >>> llama = HUB_ATTENTION[0]
        >>> llama.target, llama.gate
        ('keras_hub.src.models.llama.llama_attention:LlamaAttention', 'fused_attention_op_available')
    """

    module: str
    layer: str
    gate: str = _MODULE_GATE
    key: str = "key"
    drops_out_scores: bool = False
    own_window: bool = False

    @property
    def target(self) -> str:
        return f"{_MODELS}.{self.module}:{self.layer}"


HUB_ATTENTION = (
    HubAttention("llama.llama_attention", "LlamaAttention"),
    HubAttention("mistral.mistral_attention", "CachedMistralAttention"),
    HubAttention("phi3.phi3_attention", "Phi3Attention"),
    HubAttention("gpt_neo_x.gpt_neo_x_attention", "GPTNeoXAttention", drops_out_scores=True),
    HubAttention("gemma.gemma_attention", "CachedGemmaAttention", _LAYER_GATE, key="k", drops_out_scores=True),
    HubAttention("gemma4.gemma4_attention", "Gemma4TextAttention", _LAYER_GATE, key="k", drops_out_scores=True),
    HubAttention("smollm3.smollm3_layers", "SmolLM3Attention"),
    HubAttention("qwen.qwen_attention", "QwenAttention", own_window=True),
    HubAttention("qwen_moe.qwen_moe_attention", "QwenMoeAttention", _LAYER_GATE, own_window=True),
    HubAttention("qwen3.qwen3_attention", "Qwen3Attention", own_window=True),
    HubAttention("qwen3_moe.qwen3_moe_attention", "Qwen3MoeAttention", own_window=True),
    HubAttention("qwen3_5.qwen3_5_attention", "Qwen3_5Attention", own_window=True),
)


def takes_the_fused_path(attention: HubAttention) -> Callable[[Callable], Callable]:
    """The wrapper of `attention`'s `_compute_attention`: under context
    parallelism, where the fused path computes what the layer's own does,
    its gate answers yes for this call."""

    def wrap(compute_attention: Callable) -> Callable:
        key_position = list(inspect.signature(compute_attention).parameters).index(attention.key)

        @functools.wraps(compute_attention)
        def wrapper(layer: Any, *args: Any, **kwargs: Any) -> Any:
            key = args[key_position - 1] if len(args) >= key_position else kwargs.get(attention.key)
            with scoped(fused_attention=_fused_path_is_exact(attention, layer, key)):
                return compute_attention(layer, *args, **kwargs)

        return wrapper

    return wrap


def _fused_path_is_exact(attention: HubAttention, layer: Any, key: Any) -> bool:
    """Whether `layer`, called with `key` under context parallelism, computes
    through the fused path what its own path does."""
    if forward_mesh() is None or context.sequences_split_by != "context_parallel":
        return False
    if keras.config.is_flash_attention_enabled() is False or getattr(layer, "logit_soft_cap", None) is not None:
        return False
    if attention.drops_out_scores and layer.dropout:
        return False
    if attention.own_window and getattr(layer, "use_sliding_window_attention", True):
        window = layer.sliding_window_size
        keys = getattr(key, "shape", (None, None))[1]
        return not window or (keys is not None and window >= keys)
    return True


def fused_op_under_context_parallelism(gate: Callable) -> Callable:
    """KerasHub's `fused_attention_op_available()`, or a layer's
    `_use_fused_attention_op()`: yes inside a `_compute_attention` that
    `takes_the_fused_path` lets take it."""

    @functools.wraps(gate)
    def wrapper(*args: Any) -> bool:
        return context.fused_attention or gate(*args)

    return wrapper


_WHY = (
    "On TensorFlow the layer takes its own softmax, and under context parallelism keeps each "
    "device's queries' scores against every key: it takes `ops.dot_product_attention` (a block "
    "of keys at a time) where that computes what its own path does"
)
_WHY_GATE = "KerasHub finds no fused attention op on TensorFlow: yes where `_compute_attention` lets it"

PATCHES = tuple(
    patch
    for attention in HUB_ATTENTION
    for patch in (
        Patch(
            attention.target,
            "_compute_attention",
            takes_the_fused_path(attention),
            _WHY,
            parameters=(attention.key,),
        ),
        Patch(
            attention.target if attention.gate == _LAYER_GATE else f"{_MODELS}.{attention.module}",
            attention.gate,
            fused_op_under_context_parallelism,
            _WHY_GATE,
        ),
    )
)
