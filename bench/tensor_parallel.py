"""Memory, communication and step time of a tensor-parallel GPT-style model.

A GPT-style LM (default 4 layers, width 512, 8 heads, FFN 2048, vocabulary
8192, sequence 64) built from `tfmp.layers` is trained for a few steps with
Adam on 1x1, 1x2, 1x4 and 1x8 ("batch" x "model") meshes of simulated CPU
devices, in one run. For each mesh it prints:

- memory: per-device bytes of parameters + optimizer slots (as
  `tfmp.summary` counts them) / the ideal, one-device total / N. Target <= 1.05.
- communication: bytes per device per step of the collectives over "model"
  (from `tfmp.comm_report`) / the Megatron-LM minimum
  `(2L + 1) * b*s*h` forward (embedding, attention and FFN outputs) +
  `(2L + 1) * b*s*h` backward (attention and FFN inputs, the head's input)
  + `3 * b*s` (the vocabulary-split cross entropy), in float32. Target 1.00.
- step time: median step time / the 1x1 median, measured side by side.
  On one 2-core CPU split into devices there is no parallel speed-up to see.

Then the same model fully sharded (`fully_shard=True`) on 8x1 (ZeRO-3 alone)
and on 2x4 (with the tensor split on "model"):

- memory: per-device bytes / (the one-device total / 8). Target <= 1.05.
- communication over "batch": the bytes each device sends per step for
  weight gathers, gradient reductions and the optimizer (`tfmp.comm_report`'s
  collectives over "batch" but the loss's; ring algorithms over k devices:
  2(k-1)/k of an all-reduced tensor, (k-1)/k of a gathered tensor, of a
  reduce-scattered one's input and of an all-to-all's buffer) / the ZeRO-3
  minimum, 3(k-1)/k of the weights as layers read them (gathered forward,
  again backward, gradients reduce-scattered). Target <= 1.10. tfmp gathers
  once per step (the backward pass reuses the forward's gather), and on CPU
  DTensor lowers a reduce-scatter as an all-reduce and, by default, an
  all-gather as an all-reduce of a zero-filled buffer, each twice the bytes
  of what it stands for: dense weights cost 2/3 + 2/3 of the minimum, 1/3 +
  2/3 with real gathers; an embedding's sparse gradient costs less than a
  reduce-scatter of its table. Each mesh runs twice:
  with `LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2` set (real gathers,
  tfmp's default: exact because tfmp gathers one mesh axis per relayout),
  and without it (DTensor's own default, for comparison).

Usage (from the repository root):

    python bench/tensor_parallel.py            # the model above
    python bench/tensor_parallel.py --quick    # a tiny model, a CI smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfmp  # noqa: E402

import argparse  # noqa: E402

import devices as bench_devices  # noqa: E402  (bench/devices.py)

# --devices cpu|gpu is read here: the devices must be made before any TensorFlow op.
_flags = argparse.ArgumentParser(add_help=False)
bench_devices.add_argument(_flags)
DEVICES = bench_devices.setup(_flags.parse_known_args()[0].devices, 8)

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp.inspect.summary import bytes_per_device  # noqa: E402

MODEL_AXIS_SIZES = (1, 2, 4, 8)
FULLY_SHARDED_MESHES = ((8, 1), (2, 4))  # ("batch", "model")
GATHER_LOWERING = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"
WARMUP_STEPS = 2


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int
    width: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int
    steps: int


FULL = Config(layers=4, width=512, heads=8, ffn=2048, vocab=8192, seq=64, batch=8, steps=5)
QUICK = Config(layers=2, width=64, heads=8, ffn=128, vocab=512, seq=16, batch=8, steps=3)


def build_gpt(c: Config) -> keras.Model:
    """A pre-built GPT-style LM made of tfmp's tensor-parallel layers."""
    tokens = keras.Input((c.seq,), dtype="int32")
    x = tfmp.layers.VocabParallelEmbedding(c.vocab, c.width, name="embed")(tokens)
    for i in range(c.layers):
        attention = tfmp.layers.ParallelMultiHeadAttention(
            c.heads, c.width // c.heads, name=f"attention_{i}"
        )
        x = keras.layers.LayerNormalization(name=f"norm_a{i}")(
            x + attention(x, x, use_causal_mask=True)
        )
        h = tfmp.layers.ColumnParallelDense(c.ffn, activation="gelu", name=f"ffn_in_{i}")(x)
        h = tfmp.layers.RowParallelDense(c.width, name=f"ffn_out_{i}")(h)
        x = keras.layers.LayerNormalization(name=f"norm_f{i}")(x + h)
    head = keras.layers.Dense(c.vocab, name="head")
    logits = tfmp.layers.Sharded(head, {"kernel": (None, True), "bias": (True,)})(x)
    return keras.Model(tokens, logits, name="gpt")


class StepTimer(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.ends: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())


def run(c: Config, model_axis: int, weights, data, batch_axis: int = 1, fully_shard: bool = False) -> dict:
    mesh = tfmp.DeviceMesh(
        (batch_axis, model_axis), ("batch", "model"), DEVICES[: batch_axis * model_axis]
    )
    strategy = tfmp.ModelParallelStrategy(mesh, fully_shard=fully_shard)
    with strategy.scope():
        model = build_gpt(c)
        model.set_weights(weights)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-4),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    timer = StepTimer()
    model.fit(*data, batch_size=c.batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    report = tfmp.comm_report(model, print_fn=lambda _: None)
    model_bytes = sum(col.bytes for col in report.collectives if col.axes == ("model",))
    per_device = max(kinds["total"] for kinds in bytes_per_device(model).values())
    batch_wire = sum(
        col.wire_bytes(batch_axis)
        for col in report.collectives
        if col.axes == ("batch",) and col.category != "activations"
    )
    read_bytes = sum(
        int(np.prod(tfmp_shard_shape(v.value.compute_layout, v.shape))) * v.value.dtype.size
        for v in model.trainable_variables
    )
    return {
        "step_s": statistics.median(np.diff(timer.ends)[WARMUP_STEPS - 1 :]),
        "memory": per_device,
        "comm": model_bytes,
        "batch_wire": batch_wire,
        "zero3_minimum": 3 * (batch_axis - 1) / batch_axis * read_bytes,
    }


@contextlib.contextmanager
def gathers_lowered_as(kind: str):
    """DTensor lowers the all-gathers of the functions it compiles in the block
    as `kind`: "all-reduce" (its default) or "all-gather" (TensorFlow's gather
    collective). DTensor reads the variable at each compilation; any value,
    "0" too, selects the gather."""
    previous = os.environ.pop(GATHER_LOWERING, None)
    if kind == "all-gather":
        os.environ[GATHER_LOWERING] = "1"
    try:
        yield
    finally:
        os.environ.pop(GATHER_LOWERING, None)
        if previous is not None:
            os.environ[GATHER_LOWERING] = previous


def tfmp_shard_shape(layout, shape) -> list[int]:
    """The shape one device holds of a tensor with `layout`."""
    return [
        int(size) // (layout.mesh.dim_size(spec) if spec != "unsharded" else 1)
        for size, spec in zip(shape, layout.sharding_specs)
    ]


def megatron_minimum(c: Config) -> int:
    activation = c.batch * c.seq * c.width * 4
    return 2 * (2 * c.layers + 1) * activation + 3 * c.batch * c.seq * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_devices.add_argument(parser)
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke run")
    c = QUICK if parser.parse_args().quick else FULL
    keras.utils.set_random_seed(0)
    weights = build_gpt(c).get_weights()
    rng = np.random.default_rng(0)
    n = (c.steps + WARMUP_STEPS) * c.batch
    tokens = rng.integers(0, c.vocab, size=(n, c.seq + 1)).astype("int32")
    data = (tokens[:, :-1], tokens[:, 1:])
    results = {size: run(c, size, weights, data) for size in MODEL_AXIS_SIZES}
    one = results[1]
    print(f"model: {c}; {bench_devices.describe()}; "
          f"tensorflow {tf.__version__}, keras {keras.__version__}")
    print()
    print("| mesh | bytes/device | memory / ideal (<= 1.05) | comm bytes/step | comm / Megatron min (1.00) | step time / 1x1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for size, r in results.items():
        ideal = one["memory"] / size
        comm_ratio = r["comm"] / megatron_minimum(c) if size > 1 else float("nan")
        print(
            f"| 1x{size} | {r['memory']:,} | {r['memory'] / ideal:.3f} | {r['comm']:,} "
            f"| {comm_ratio:.3f} | {r['step_s'] / one['step_s']:.2f} |"
        )
    print()
    print(
        "| fully sharded | all-gathers lowered as | bytes/device | memory / (total / 8) (<= 1.05) "
        "| batch-axis bytes sent/step | / ZeRO-3 min (<= 1.10) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for lowering in ("all-reduce", "all-gather"):
        for batch_axis, model_axis in FULLY_SHARDED_MESHES:
            with gathers_lowered_as(lowering):
                r = run(c, model_axis, weights, data, batch_axis=batch_axis, fully_shard=True)
            print(
                f"| {batch_axis}x{model_axis} | {lowering} | {r['memory']:,} "
                f"| {r['memory'] / (one['memory'] / 8):.3f} "
                f"| {r['batch_wire']:,.0f} | {r['batch_wire'] / r['zero3_minimum']:.3f} |"
            )


if __name__ == "__main__":
    main()
