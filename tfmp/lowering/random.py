"""Random draws that equal one device's for the whole tensor, however it is split.

DTensor expands a stateless random op per device, with the shard's local
shape and a seed mixed with the device's position, so a draw laid out like a
split activation (Dropout's mask after a column-parallel Dense, GaussianNoise,
a batch of augmentation factors) holds other numbers on each device than one
device draws for the whole tensor. On a mesh, the Keras TensorFlow random
functions below draw the whole tensor, with Keras' own seeds and ops,
replicated on every device, and DTensor slices the draw to its consumer's
layout locally. The draws are bitwise one device's, so a model with random
layers trains as closely to one device as one without them.

Cost: each device draws the whole tensor rather than its shard, so a dropout
mask costs every device the random numbers (and transient memory) of the
whole activation it masks: the mesh size times the work of a split draw. The
draws add no communication; a tensor parameter of a draw (a broadcast
`minval`, say) is gathered first.

`keras.random.shuffle` needs no lowering: its sort keys form one dimension,
which the sort keeps whole. DTensor has no layout rule for the ops of
`categorical`, `gamma`, `binomial` and `beta` (AugMix, MixUp and CutMix draw
with the last three), whose numbers nothing else reproduces, so on a mesh
those raise an error that says so instead of DTensor's at compile time.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn

import tensorflow as tf
from keras.src.backend.tensorflow import random as keras_random
from tensorflow.experimental import dtensor

from tfmp.forward import forward_mesh
from tfmp.lowering.registry import Lowering, keras_original


def _replicated(value: Any) -> Any:
    """`value` whole on every device of the forward pass' mesh; Python
    numbers are left alone (they are whole already)."""
    if not isinstance(value, tf.Tensor):
        return value
    return dtensor.relayout(value, dtensor.Layout.replicated(forward_mesh(), value.shape.rank))


def _keras(name: str) -> Callable:
    """Keras' own function `name`, past tfmp's wrapper around it."""
    return keras_original(_MODULE, name)


def normal(
    shape: Any, mean: Any = 0.0, stddev: Any = 1.0, dtype: Any = None, seed: Any = None
) -> tf.Tensor:
    """Keras' `random.normal`, drawn whole on every device."""
    return _replicated(_keras("normal")(shape, _replicated(mean), _replicated(stddev), dtype, seed))


def uniform(
    shape: Any, minval: Any = 0.0, maxval: Any = 1.0, dtype: Any = None, seed: Any = None
) -> tf.Tensor:
    """Keras' `random.uniform`, drawn whole on every device."""
    return _replicated(
        _keras("uniform")(shape, _replicated(minval), _replicated(maxval), dtype, seed)
    )


def truncated_normal(
    shape: Any, mean: Any = 0.0, stddev: Any = 1.0, dtype: Any = None, seed: Any = None
) -> tf.Tensor:
    """Keras' `random.truncated_normal`, drawn whole on every device."""
    return _replicated(
        _keras("truncated_normal")(shape, _replicated(mean), _replicated(stddev), dtype, seed)
    )


def randint(
    shape: Any, minval: Any, maxval: Any, dtype: Any = "int32", seed: Any = None
) -> tf.Tensor:
    """Keras' `random.randint`, drawn whole on every device."""
    return _replicated(
        _keras("randint")(shape, _replicated(minval), _replicated(maxval), dtype, seed)
    )


def dropout(inputs: Any, rate: float, noise_shape: Any = None, seed: Any = None) -> tf.Tensor:
    """Keras' `random.dropout`: the keep mask is drawn whole on every device,
    and each device keeps its shard of `inputs` by its slice of the mask."""
    if rate in (0.0, 1.0):
        return _keras("dropout")(inputs, rate, noise_shape, seed)
    # Keras' own steps, in its order: the seed is drawn before the shape.
    seed = keras_random._cast_seed(keras_random.draw_seed(seed))  # noqa: SLF001
    noise_shape = keras_random._get_concrete_noise_shape(inputs, noise_shape)  # noqa: SLF001

    def sampler(shape: Any, dtype: tf.DType) -> tf.Tensor:
        # The sampler of `tf.nn.experimental.stateless_dropout`, which Keras calls.
        return _replicated(tf.random.stateless_uniform(shape, seed=seed, dtype=dtype))

    return tf.nn.experimental.general_dropout(
        inputs, rate=rate, uniform_sampler=sampler, noise_shape=noise_shape
    )


# The op each draw DTensor cannot lay out is made with.
_NO_LAYOUT_RULE = {
    "categorical": "StatelessMultinomial",
    "gamma": "StatelessRandomGammaV3",
    "binomial": "StatelessRandomBinomial",
    "beta": "StatelessRandomGammaV3",
}


def _declining(name: str) -> Callable[..., NoReturn]:
    """Keras' `random.<name>` on a mesh: a ValueError that says where to draw."""

    def decline(*args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(
            f"keras.random.{name} cannot run in a layer's forward pass on a tfmp mesh: "
            f"DTensor has no layout rule for TensorFlow's {_NO_LAYOUT_RULE[name]}. Draw "
            "it outside the model, e.g. in the tf.data pipeline (where AugMix, MixUp "
            "and CutMix belong)."
        )

    decline.__name__ = name
    return decline


categorical = _declining("categorical")
gamma = _declining("gamma")
binomial = _declining("binomial")
beta = _declining("beta")  # a ratio of gamma draws


_MODULE = "keras.src.backend.tensorflow.random"
_SPLIT_DRAW = "DTensor draws each shard with its local shape and a per-device seed"

LOWERINGS: tuple[Lowering, ...] = tuple(
    Lowering(_MODULE, name, f"{__name__}:{name}", _SPLIT_DRAW)
    for name in ("normal", "uniform", "truncated_normal", "randint", "dropout")
) + tuple(
    Lowering(_MODULE, name, f"{__name__}:{name}", f"DTensor has no layout rule for {op}")
    for name, op in _NO_LAYOUT_RULE.items()
)
