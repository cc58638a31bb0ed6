"""Sequence parallelism against tensor parallelism alone: what each device sends.

The demo LM (`tfmp.demo`, Megatron rules) on a 2x4 ("batch", "model") mesh
of 8 CPU devices, one epoch of 64 sequences at batch 16, once without and
once with `sequence_parallel=True`. Prints `tfmp.comm_report`'s bytes per
device per step over "model", by phase and kind, for both, and their ratio.
The norms' outputs (what sequence parallelism splits) take 1/N of the
sequence per device by their layout; this shows what the layout costs in
traffic, where DTensor all-reduces and slices instead of reduce-scattering.
docs/tensor-parallel.md has the numbers of a run.

    PYTHONPATH=$PWD python bench/sequence_parallel.py [--sequence 16]
"""

from __future__ import annotations

import argparse
import collections

import tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 8
)

import keras  # noqa: E402

import tfmp  # noqa: E402
from tfmp.demo import build_transformer_lm, megatron_layout_map, next_token_data  # noqa: E402


def model_axis_bytes(sequence: int, sequence_parallel: bool) -> dict[tuple[str, str], int]:
    """(phase, kind) -> bytes per device per step over "model"; "total" too."""
    mesh = tfmp.DeviceMesh((2, 4), ("batch", "model"))
    strategy = tfmp.ModelParallelStrategy(
        mesh, megatron_layout_map(mesh), sequence_parallel=sequence_parallel
    )
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_transformer_lm(seq_len=sequence)
        model.compile(
            keras.optimizers.Adam(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    x, y = next_token_data(64, sequence, 64)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    report = tfmp.comm_report(model, print_fn=lambda text: None)
    sizes: dict[tuple[str, str], int] = collections.Counter()
    for collective in report.collectives:
        if "model" in collective.axes:
            sizes[collective.phase, collective.kind] += collective.bytes
            sizes["total", ""] += collective.bytes
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequence", type=int, default=16, help="tokens per sequence (a multiple of 4)")
    args = parser.parse_args()
    tensor_parallel = model_axis_bytes(args.sequence, sequence_parallel=False)
    sequence_parallel = model_axis_bytes(args.sequence, sequence_parallel=True)
    print(f"bytes per device per step over 'model', sequence {args.sequence}")
    print(f"{'phase':10} {'kind':11} {'tensor parallel':>16} {'+ sequence parallel':>20}")
    for key in sorted(set(tensor_parallel) | set(sequence_parallel)):
        print(f"{key[0]:10} {key[1]:11} {tensor_parallel[key]:>16} {sequence_parallel[key]:>20}")
    ratio = sequence_parallel["total", ""] / tensor_parallel["total", ""]
    print(f"RESULT sequence_parallel_model_axis_bytes_ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
