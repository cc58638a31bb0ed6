"""Long sequences on 8 devices: activation bytes per device with tensor, sequence and context parallelism.

The demo LM (`tfmp.demo.build_transformer_lm`: width 64, 8 heads, FFN 256,
causal attention, Megatron rules on "model"), batch 2, one training step,
on 8 simulated CPU devices in four ways:

- `tensor`: ("batch", "model") 1x8, tensor parallelism alone;
- `sequence`: the same with `sequence_parallel=True`;
- `context`: ("batch", "sequence", "model") 1x8x1, `context_parallel=True`;
- `context+tensor`: 1x4x2, both.

CPU devices report no allocator peaks, so a device's activation bytes are
read from the graph it ran: the sum of the output sizes of the forward ops
of the train step on its first device (`_output_shapes` of each node of its
partition graph that is neither a gradient, an optimizer update, a variable
read nor a constant). That counts every intermediate once, whether or not it
is alive at the peak: the same measure for every configuration, and for one
device (a 1x1 mesh), whose bytes / 8 is the ideal. Each configuration and
length runs in a fresh process: in one process, a second model's captured
graphs held 222 functions where the first's held 13.

For sequence lengths 64 to 256 it prints each configuration's bytes and
their ratio to the ideal, then the longest sequence whose bytes fit the
limit that tensor parallelism alone reaches at the longest length measured
(each configuration's bytes fitted by a quadratic in the length), and that
length against tensor parallelism's. Keras' attention on TensorFlow materializes the
`(sequence, sequence)` scores, so bytes grow with the square of the length
and 8x less memory buys about sqrt(8) = 2.8x the length, not 8x.

    PYTHONPATH=$PWD python bench/long_context.py [--lengths 64,128,256]

docs/tensor-parallel.md has the numbers of a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 8
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfmp  # noqa: E402
from tfmp.demo import build_transformer_lm, megatron_layout_map, next_token_data  # noqa: E402
from tfmp.strategy.graph_capture import first_step_graphs_of, is_train_step  # noqa: E402

BATCH, WIDTH, HEADS, FFN = 2, 64, 8, 256
# name -> (mesh shape, axis names, strategy keyword arguments)
CONFIGURATIONS = {
    "one device": ((1, 1), ("batch", "model"), {}),
    "tensor": ((1, 8), ("batch", "model"), {}),
    "sequence": ((1, 8), ("batch", "model"), {"sequence_parallel": True}),
    "context": ((1, 8, 1), ("batch", "sequence", "model"), {"context_parallel": True}),
    "context+tensor": ((1, 4, 2), ("batch", "sequence", "model"), {"context_parallel": True}),
}
_NOT_ACTIVATIONS = ("Const", "ReadVariableOp", "_Arg", "_Retval", "NoOp", "Identity")


def activation_bytes(name: str, length: int) -> int:
    """The forward activation bytes of the first device of configuration
    `name` for one training step on sequences of `length` tokens."""
    shape, axes, kwargs = CONFIGURATIONS[name]
    mesh = tfmp.DeviceMesh(shape, axes)
    strategy = tfmp.ModelParallelStrategy(mesh, megatron_layout_map(mesh), **kwargs)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_transformer_lm(seq_len=length, d_model=WIDTH, num_heads=HEADS, ffn_dim=FFN)
        model.compile(
            keras.optimizers.Adam(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    x, y = next_token_data(BATCH, length, 64)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    first = mesh.dtensor_mesh.local_devices()[0]
    total = 0
    for function in filter(is_train_step, first_step_graphs_of(model).function_graphs):
        for partition in function.partition_graphs:
            for node in partition.node:
                if not _is_forward_activation(node, first):
                    continue
                for output in node.attr["_output_shapes"].list.shape:
                    dims = [d.size for d in output.dim]
                    if dims and all(d >= 0 for d in dims):
                        total += int(np.prod(dims)) * 4
    return total


def _is_forward_activation(node, device: str) -> bool:
    return (
        tf.DeviceSpec.from_string(node.device or "/cpu:0").device_index
        == tf.DeviceSpec.from_string(device).device_index
        and node.op not in _NOT_ACTIVATIONS
        and "gradient_tape" not in node.name
        and "adam/" not in node.name.lower()
        and "_output_shapes" in node.attr
    )


def longest_within(lengths: list[int], sizes: list[int], limit: int) -> float:
    """The length at which a quadratic through `(lengths, sizes)` reaches `limit`."""
    a, b, c = np.polyfit(lengths, sizes, 2)
    roots = [r.real for r in np.roots([a, b, c - limit]) if abs(r.imag) < 1e-9 and r.real > 0]
    return max(roots)


def measured_in_a_fresh_process(name: str, length: int) -> int:
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", name, str(length)],
        capture_output=True, text=True, timeout=1800,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{name} at {length} tokens failed:\n{result.stderr[-2000:]}")
    return json.loads(lines[-1])["bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,128,256", help="three or more sequence lengths, multiples of 8")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, length = args.child
        print(json.dumps({"bytes": activation_bytes(name, int(length))}))
        return
    lengths = [int(n) for n in args.lengths.split(",")]
    table = {name: {n: measured_in_a_fresh_process(name, n) for n in lengths} for name in CONFIGURATIONS}
    ideal = {n: table["one device"][n] / 8 for n in lengths}
    print(f"forward activation bytes per device (batch {BATCH}, width {WIDTH}, {HEADS} heads), / ideal (one device's / 8)")
    print(f"{'configuration':16s}" + "".join(f"{n:>22d}" for n in lengths))
    for name in CONFIGURATIONS:
        cells = "".join(f"{table[name][n]:>14,d} ({table[name][n] / ideal[n]:4.2f})" for n in lengths)
        print(f"{name:16s}{cells}")
    limit = table["tensor"][lengths[-1]]
    print(f"longest length within {limit:,d} B per device (tensor parallelism alone at {lengths[-1]} "
          "tokens), from each configuration's bytes fitted as a quadratic in the length:")
    for name in ("tensor", "sequence", "context", "context+tensor"):
        longest = longest_within(lengths, [table[name][n] for n in lengths], limit)
        ratio = longest / longest_within(lengths, [table["tensor"][n] for n in lengths], limit)
        print(f"  {name}: {longest:.0f} tokens")
        target = ">=6" if name.startswith("context") else "-"
        status = ("met" if ratio >= 6 else "missed") if name.startswith("context") else "-"
        print(f'RESULT measure="longest sequence within one per-device limit, {name} / tensor" '
              f"ratio={ratio:.2f} target={target} status={status}")
    for name in ("context", "context+tensor"):
        ratio = table[name][lengths[-1]] / ideal[lengths[-1]]
        print(f'RESULT measure="activation bytes per device / ideal, {name}, {lengths[-1]} tokens" '
              f"ratio={ratio:.2f} target=- status=-")


if __name__ == "__main__":
    main()
