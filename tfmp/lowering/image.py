"""Keras' image functions that cannot run on a mesh.

RandomElasticTransform draws its displacement field with
`tf.random.stateless_normal` directly, which DTensor draws shard by shard:
on a mesh `image.elastic_transform` raises an error that says to apply it
in the `tf.data` pipeline.
"""

from __future__ import annotations

from typing import Any, NoReturn

from keras.src.backend.common.name_scope import current_path

from tfmp.lowering.registry import Lowering

_KERAS_IMAGE = "keras.src.backend.tensorflow.image"


def elastic_transform(
    images: Any,
    alpha: Any = 20.0,
    sigma: Any = 5.0,
    interpolation: str = "bilinear",
    fill_mode: str = "reflect",
    fill_value: Any = 0.0,
    seed: Any = None,
    data_format: Any = None,
) -> NoReturn:
    """Keras' `image.elastic_transform` on a mesh: an error that says where to run it."""
    raise ValueError(
        f"Layer {current_path() or '?'!r} calls keras.ops.image.elastic_transform "
        "(RandomElasticTransform) in its forward pass on a tfmp mesh, where it cannot "
        "give one device's numbers: it draws its displacement field with TensorFlow's "
        "stateless_normal directly, which DTensor draws shard by shard. Apply it in "
        "the tf.data pipeline instead."
    )


LOWERINGS = (
    Lowering(
        _KERAS_IMAGE,
        "elastic_transform",
        elastic_transform,
        "it draws with tf.random directly, per shard under DTensor",
    ),
)
