"""An Embedding whose table is split over the vocabulary."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfmp.forward import BACKWARD_SCOPE, batch_spec
from tfmp.layers.declaring import DeclaresLayouts
from tfmp.layout import Axes, declared_layouts


@keras.saving.register_keras_serializable(package="tfmp")
class VocabParallelEmbedding(DeclaresLayouts, keras.layers.Embedding):
    """`keras.layers.Embedding` whose table is split on the vocabulary.

    Each device of `axis` stores `input_dim / axis size` rows of the table (and
    of the optimizer slots). On the mesh the lookup is a product of one-hot
    rows with the table, so each device reads only its rows and one all-reduce
    of the `(batch, ..., output_dim)` output combines them, as in Megatron-LM
    (a plain `Embedding` with a vocabulary-split rule gathers the whole table
    each step instead). This costs `input_dim * output_dim` multiply-adds per
    token. The table's gradient is the rows of the batch, as `Embedding`'s, so
    Keras' optimizers see the same sparse gradient and training matches
    `Embedding`.

    Args:
        input_dim: Vocabulary size, as `keras.layers.Embedding`.
        output_dim: Embedding width.
        axis: The mesh axis to split the vocabulary over.
        **kwargs: Any other `keras.layers.Embedding` argument.

    Examples:
        >>> import tfmp
        >>> embed = tfmp.layers.VocabParallelEmbedding(8192, 512, axis="model")
    """

    def __init__(self, input_dim: int, output_dim: int, axis: str = "model", **kwargs: Any):
        super().__init__(input_dim, output_dim, axis=axis, **kwargs)

    def weight_layouts(self) -> dict[str, Axes]:
        # LoRA's first factor has a row per id, like the table.
        return {"embeddings": (self.axis, None), "lora_embeddings_a": (self.axis, None)}

    def enable_lora(self, *args: Any, **kwargs: Any) -> None:
        """Keras' `Embedding.enable_lora`, with the LoRA rows split like the table."""
        with declared_layouts(self.name, self.weight_layouts()):
            super().enable_lora(*args, **kwargs)

    def call(self, inputs: Any) -> Any:
        # `self.embeddings` is the table plus LoRA's product once LoRA is on.
        layout = getattr(self._embeddings.value, "layout", None)
        if layout is None or self.axis not in layout.sharding_specs:
            return super().call(inputs)
        ids = self._checked_ids(inputs)
        # Split the one-hot rows like the table, so that each device reads only
        # its rows and one all-reduce of the output combines them.
        rank = ids.shape.rank + 1
        specs = [batch_spec(inputs, layout.mesh, self.axis)]
        specs += [dtensor.UNSHARDED] * (rank - 2) + [self.axis]
        one_hot_layout = dtensor.Layout(specs, layout.mesh)
        dims = "abcdefgh"[: rank - 1]
        table = tf.cast(self.embeddings, self.compute_dtype)

        @tf.custom_gradient
        def lookup(table: tf.Tensor):
            one_hot = tf.one_hot(ids, self.input_dim, dtype=table.dtype)
            one_hot = dtensor.relayout(one_hot, one_hot_layout)

            def grad(upstream: tf.Tensor) -> tf.IndexedSlices:
                # The gradient Keras' Embedding has: rows of the batch, by id,
                # which Keras' TF optimizers treat row by row (Adam squares
                # each row before repeated ids are summed).
                with tf.name_scope(BACKWARD_SCOPE):
                    return tf.IndexedSlices(
                        tf.reshape(upstream, [-1, self.output_dim]),
                        tf.reshape(ids, [-1]),
                        tf.shape(table, out_type=tf.int64),
                    )

            return tf.einsum(f"{dims}v,vz->{dims}z", one_hot, table), grad

        return lookup(table)

    def _checked_ids(self, inputs: Any) -> tf.Tensor:
        """`inputs` as Keras' Embedding reads them: a negative id counts from the
        end of the vocabulary, and an id past it fails as `tf.gather` fails on
        the device (an error on CPU) rather than matching no row of the one-hot."""
        ids = tf.cast(inputs, "int32")
        ids = tf.where(ids < 0, ids + self.input_dim, ids)
        return tf.gather(tf.range(self.input_dim), ids)

