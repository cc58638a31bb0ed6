"""Train a 2-stage pipeline with tensor-parallel layers inside each stage.

The mesh is 2x1x4 ("stage", "batch", "model"): two stages of four devices
each. The script

1. writes the model as a plain list of Keras layers (`build_layers`),
2. asks `tfmp.balance` where to cut that list into 2 stages of even parameter
   count,
3. wraps each part in a `tfmp.layers.LayerGroup(..., stage=k)`, whose
   variables then live only on stage k's 4 devices,
4. splits the Dense layers inside each stage over "model" with a layout map
   table (`TENSOR_PARALLEL_RULES`: column-parallel "up_*", row-parallel
   "down_*"),
5. trains with `num_microbatches=4` under the schedule of `--schedule`
   (`gpipe`: each stage runs passes as soon as their inputs exist; `1f1b`:
   one forward, one backward, holding fewer micro-batches' activations).

Run (8 simulated CPU devices; about 30 s on 2 cores):

    python examples/pipeline_two_stage.py --schedule 1f1b

Full size (67 million parameters; meant for 8 GPUs or TPU cores, slow on a CPU):

    python examples/pipeline_two_stage.py --full

It prints the split `tfmp.balance` chose, the loss of every epoch, and
`tfmp.summary`, whose "per pipeline stage" lines give each stage's parameter
bytes and the most bytes one of its devices holds. On a host with 8 or more
GPUs or TPU cores the mesh takes those instead of the CPU devices.
"""

from __future__ import annotations

import os

# TensorFlow's C++ logs: fatal errors only (TF_CPP_MIN_LOG_LEVEL=0 shows them
# all). Set before TensorFlow loads; tfmp, imported first, also drops the lines
# TensorFlow writes before it reads this setting.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse

import tfmp  # before Keras: it imports TensorFlow
import keras
import numpy as np

from tfmp.devices import devices_for
from tfmp.pipeline.balance import stage_costs

# Sizes of the two modes: the small one runs in under a minute on 2 CPU cores.
SIZES = {
    "small": {"features": 32, "hidden": 256, "width": 64, "blocks": 3, "samples": 1024, "epochs": 4},
    "full": {"features": 256, "hidden": 4096, "width": 1024, "blocks": 8, "samples": 32768, "epochs": 8},
}
NUM_CLASSES = 10
NUM_MICROBATCHES = 4

# Tensor parallelism inside each stage, as a table: variable-path regex -> mesh axes.
TENSOR_PARALLEL_RULES = {
    r"up_\d+/kernel": (None, "model"),  # column-parallel: split the hidden units
    r"up_\d+/bias": ("model",),
    r"down_\d+/kernel": ("model", None),  # row-parallel: sum the partial outputs
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="full-size model and data")
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    parser.add_argument("--epochs", type=int, default=None, help="overrides the mode's epochs")
    parser.add_argument(
        "--batch", type=int, default=64, help=f"global batch size, cut into {NUM_MICROBATCHES} micro-batches"
    )
    return parser.parse_args()


def make_data(samples: int, features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Points labelled by a random linear teacher: a task an MLP learns quickly."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    teacher = rng.normal(size=(features, NUM_CLASSES))
    return x, np.argmax(x @ teacher, axis=1).astype("int32")


def build_layers(width: int, hidden: int, blocks: int) -> list[keras.layers.Layer]:
    """The model as a chain of plain Keras layers: an input projection,
    `blocks` feed-forward blocks (up to `hidden`, down to `width`), a head."""
    layers = [keras.layers.Dense(width, activation="relu", name="embed")]
    for i in range(blocks):
        layers += [
            keras.layers.Dense(hidden, activation="relu", name=f"up_{i}"),
            keras.layers.Dense(width, activation="relu", name=f"down_{i}"),
        ]
    return layers + [keras.layers.Dense(NUM_CLASSES, name="classifier")]


def stage_sizes(features: int, width: int, hidden: int, blocks: int, num_stages: int) -> list[int]:
    """How many layers of `build_layers` each stage gets, by `tfmp.balance`.

    `balance` measures built layers, so it is given a throwaway built copy;
    the pipeline itself needs fresh, unbuilt layers.
    """
    plan = keras.Sequential([keras.Input((features,)), *build_layers(width, hidden, blocks)])
    stages = tfmp.balance(plan, num_stages, by="params")
    for stage, (layers, cost) in enumerate(zip(stages, stage_costs(stages))):
        print(f"balance: stage {stage} gets {[layer.name for layer in layers]} ({cost:,} parameters)")
    return [len(layers) for layers in stages]


def build_pipeline(
    features: int, width: int, hidden: int, blocks: int, sizes: list[int]
) -> keras.Model:
    """`build_layers`, cut into consecutive `LayerGroup` stages of `sizes` layers."""
    layers = build_layers(width, hidden, blocks)
    groups, start = [], 0
    for stage, count in enumerate(sizes):
        groups.append(tfmp.layers.LayerGroup(layers[start : start + count], stage=stage, name=f"stage_{stage}"))
        start += count
    return keras.Sequential([keras.Input((features,)), *groups], name="pipeline_mlp")



def main() -> None:
    args = parse_args()
    size = SIZES["full" if args.full else "small"]
    tfmp.simulate_devices(8)  # 8 logical CPU devices: must come before any TensorFlow op
    dims = (size["features"], size["width"], size["hidden"], size["blocks"])
    mesh = tfmp.DeviceMesh((2, 1, 4), ("stage", "batch", "model"), devices_for(8))
    strategy = tfmp.ModelParallelStrategy(
        mesh, TENSOR_PARALLEL_RULES, num_microbatches=NUM_MICROBATCHES, schedule=args.schedule
    )
    print(f"mesh: {mesh}, schedule: {args.schedule}, micro-batches: {NUM_MICROBATCHES}")
    sizes = stage_sizes(*dims, num_stages=mesh.axis_size("stage"))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_pipeline(*dims, sizes)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    x, y = make_data(size["samples"], size["features"])
    history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs or size["epochs"], verbose=0)
    for epoch, (loss, accuracy) in enumerate(
        zip(history.history["loss"], history.history["accuracy"]), start=1
    ):
        print(f"epoch {epoch}: loss {loss:.4f}, accuracy {accuracy:.3f}")
    tfmp.summary(model)


if __name__ == "__main__":
    main()
