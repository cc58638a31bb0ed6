"""Fits the demo LM on a batch with one label outside the vocabulary.

Usage: bad_label.py MESH LABEL, MESH one of "2x4" (vocabulary split over
"model"), "8x1" (batch split only), "2x2x2" (context parallel). Prints one
JSON line: the error's class and message, and whether the weights are still
the initial ones (the failed step applied no update on any device). In a process of its own: TensorFlow keeps the collectives
of a failed step aborted for the rest of the process.
"""

import json
import sys

import tfmp

tfmp.simulate_devices(8)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp.demo import build_transformer_lm, megatron_layout_map, next_token_data  # noqa: E402

shape = tuple(int(size) for size in sys.argv[1].split("x"))
axes, options = (("batch", "sequence", "model"), {"context_parallel": True}) if len(shape) == 3 else (("batch", "model"), {})
mesh = tfmp.DeviceMesh(shape, axes)
strategy = tfmp.ModelParallelStrategy(mesh, megatron_layout_map(mesh), **options)
with strategy.scope():
    model = build_transformer_lm(seq_len=8)
    model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x, y = next_token_data(8, 8, 64)  # one step
y[3, 5] = int(sys.argv[2])
before = model.get_weights()
try:
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    raised = None
except tf.errors.OpError as error:
    raised = error
after = model.get_weights()
print(json.dumps({
    "error": type(raised).__name__ if raised else None,
    "message": raised.message if raised else "",
    "weights_kept": all(np.array_equal(a, b) for a, b in zip(before, after)),
}))
