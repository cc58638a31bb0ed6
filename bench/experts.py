"""Expert parallelism: parameter bytes per device and all-to-all bytes of a mixture of experts.

A mixture-of-experts token model: Embedding (vocabulary 512, width 64), a
`tfmp.layers.MixtureOfExperts` (16 experts of hidden width 256, top-2,
capacity factor 1) added to its input, and a Dense vocabulary head; Adam,
batch 16 of 32 tokens, one training step. Experts are over "batch", the axis
that splits the batch (GShard's expert parallelism), on 8 simulated CPU
devices in two meshes:

- 8x1 ("batch", "model") with `fully_shard=True`: the experts 2 per device,
  every other weight split over "batch" too;
- 2x4 with the head and embedding split over "model" (Megatron rules): 8
  experts per "batch" device.

Two measures per mesh:

1. parameter bytes per device (the model's variables, not the optimizer's,
   read from `tfmp.inspect.summary.placements`) against total / N, N the
   number of devices that split the experts. Target <= 1.05 on 8x1.
2. all-to-all bytes of the step (`tfmp.comm_report`: each all-to-all's
   buffer per device, summed) against the minimum: every token copy the
   router sends goes to its expert and back, forward and backward, so 4 x
   top_k x tokens per device x width x 4 bytes. With capacity factor 1 and
   sequences of a multiple of the experts, the capacity buffers hold exactly
   that many slots. Target <= 1.10.

The other collectives of the mixture's layer are printed too. Each mesh runs
in its own process (a second model's graphs in one process hold more
functions than the first's).

    PYTHONPATH=$PWD python bench/experts.py

docs/tensor-parallel.md has the numbers of a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

VOCAB, WIDTH, EXPERTS, HIDDEN, TOP_K, SEQ, BATCH = 512, 64, 16, 256, 2, 32, 16
MESHES = {"8x1": (8, 1), "2x4": (2, 4)}


def build_model():
    import keras

    import tfmp

    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, WIDTH, name="embedding")(tokens)
    experts = tfmp.layers.MixtureOfExperts(
        EXPERTS, HIDDEN, top_k=TOP_K, capacity_factor=1.0, aux_loss_weight=0.01, name="moe"
    )
    x = keras.layers.Add(name="residual")([x, experts(x)])
    return keras.Model(tokens, keras.layers.Dense(VOCAB, name="lm_head")(x), name="moe_lm")


def measure(mesh_name: str) -> dict:
    """One training step on `mesh_name`; the bytes it reads off the model."""
    import tfmp

    tfmp.simulate_devices(8)
    import keras
    import numpy as np

    from tfmp.inspect.summary import placements

    shape = MESHES[mesh_name]
    mesh = tfmp.DeviceMesh(shape, ("batch", "model"))
    if shape[1] > 1:
        layout_map = tfmp.LayoutMap(mesh)
        layout_map["embedding/embeddings"] = (None, "model")
        layout_map["lm_head/kernel"] = (None, "model")
        layout_map["lm_head/bias"] = ("model",)
        strategy = tfmp.ModelParallelStrategy(mesh, layout_map)
    else:
        strategy = tfmp.ModelParallelStrategy(mesh, fully_shard=True)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype("int32")
    model.fit(x, np.roll(x, -1, axis=1), batch_size=BATCH, verbose=0)
    rows = [row for row in placements(model) if not row.is_slot]
    report = tfmp.comm_report(model, print_fn=lambda text: None)
    moe = [c for c in report.collectives if "/moe" in c.op]
    return {
        "total": sum(int(np.prod(row.shape)) * row.itemsize for row in rows),
        "per_device": sum(row.shard_bytes for row in rows),
        "experts_over": shape[0],
        "all_to_all": sum(c.bytes for c in moe if c.kind == "all-to-all"),
        "all_to_alls": sum(c.kind == "all-to-all" for c in moe),
        "others": [(c.kind, c.axes, c.phase, c.bytes, c.op.rsplit("/", 2)[-2]) for c in moe if c.kind != "all-to-all"],
    }


def in_a_fresh_process(mesh_name: str) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--child", mesh_name],
        capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{mesh_name} failed:\n{result.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    print(f"{EXPERTS} experts (width {WIDTH}, hidden {HIDDEN}), top-{TOP_K}, capacity factor 1, "
          f"batch {BATCH} x {SEQ} tokens, experts over 'batch'")
    for mesh_name, shape in MESHES.items():
        measured = in_a_fresh_process(mesh_name)
        n = measured["experts_over"]
        param_ratio = measured["per_device"] / (measured["total"] / n)
        minimum = 4 * TOP_K * (BATCH // shape[0]) * SEQ * WIDTH * 4
        exchange_ratio = measured["all_to_all"] / minimum
        print(f"{mesh_name}: parameters {measured['per_device']:,d} B per device of {measured['total']:,d} B "
              f"(total / {n} = {measured['total'] / n:,.0f}); {measured['all_to_alls']} all-to-alls, "
              f"{measured['all_to_all']:,d} B per device against the minimum {minimum:,d} B")
        for kind, axes, phase, size, op in measured["others"]:
            print(f"    also: {kind} over {axes} ({phase}), {size:,d} B, at {op}")
        target = "<=1.05" if shape[1] == 1 else "-"
        status = ("met" if param_ratio <= 1.05 else "missed") if shape[1] == 1 else "-"
        print(f'RESULT measure="parameter bytes per device / (total / {n}), {mesh_name}" '
              f"ratio={param_ratio:.3f} target={target} status={status}")
        print(f'RESULT measure="all-to-all bytes / minimum, {mesh_name}" ratio={exchange_ratio:.3f} '
              f"target=<=1.10 status={'met' if exchange_ratio <= 1.10 else 'missed'}")


if __name__ == "__main__":
    main()
