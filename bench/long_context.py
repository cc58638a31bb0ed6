"""Long sequences on 8 devices: activation bytes per device with tensor, sequence and context parallelism.

The demo LM (`tfmp.demo.build_transformer_lm`: width 64, 8 heads, FFN 256,
causal attention, Megatron rules on "model"), batch 2, one training step,
on 8 simulated CPU devices in four ways:

- `tensor`: ("batch", "model") 1x8, tensor parallelism alone;
- `sequence`: the same with `sequence_parallel=True`;
- `context`: ("batch", "sequence", "model") 1x8x1, `context_parallel=True`;
- `context+tensor`: 1x4x2, both.

CPU devices report no allocator peaks, so a device's activation bytes are
read from the graph it ran for the train step, on its first device (the
`_output_shapes` of the nodes of its partition graphs, counted as float32;
the backward pass is `backward_nodes`):

- **kept**: the forward values the backward pass reads (through
  identities), each once: the activations a step holds from its forward
  pass to its backward pass, the memory that grows with the model's depth
  and the sequence (Megatron's "activation memory");
- **produced**: every forward output, each once, alive at the peak or not;
- **largest**: the largest forward output, a floor of the peak (Keras'
  whole scores, or one block of them).

One device (a 1x1 mesh) gives the ideal, its bytes / 8. Each configuration
and length runs in a fresh process: in one process, a second model's
captured graphs held 222 functions where the first's held 13.

It prints the three measures and the kept bytes' ratio to the ideal for
each length, then the longest sequence each configuration trains within
what tensor parallelism alone needs at the longest length measured, by the
kept bytes and by the kept bytes plus the largest value (a floor of the
peak): each configuration's bytes fitted by a quadratic in the length, the
fit's length rounded down to a multiple of 64, measured there, and moved
until the longest length that fits is found within 64 tokens. Keras'
attention keeps the `(sequence, sequence)` scores, so tensor parallelism's
bytes grow with the square of the length; under context parallelism
attention runs a block of keys at a time and keeps none
(`tfmp/lowering/attention.py`).

Last, KerasHub's Llama (one block, width 64, 8 query and 4 key and value
heads, a Dense vocabulary head) on 1x8x1 with `layout_map="auto"` at the
longest length: its kept bytes with its own softmax
(`keras.config.disable_flash_attention()`) and through the blockwise
attention (`tfmp/lowering/hub_attention.py`).

    PYTHONPATH=$PWD python bench/long_context.py [--lengths 256,512,1024]

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
# KerasHub's Llama (one decoder block of the same width and heads, 4 key
# and value heads) on 1x8x1 with "auto": whether it takes
# `ops.dot_product_attention` a block of keys at a time (else its own softmax).
HUB_CONFIGURATIONS = {"llama, own softmax": False, "llama, blockwise": True}
_NOT_ACTIVATIONS = ("Const", "ReadVariableOp", "_Arg", "_Retval", "NoOp", "Identity", "IdentityN")


def activation_bytes(name: str, length: int) -> dict:
    """The forward activation bytes of the first device of configuration
    `name` for one training step on sequences of `length` tokens."""
    if name in HUB_CONFIGURATIONS:
        if not HUB_CONFIGURATIONS[name]:
            keras.config.disable_flash_attention()
        mesh = tfmp.DeviceMesh((1, 8, 1), ("batch", "sequence", "model"))
        strategy = tfmp.ModelParallelStrategy(mesh, "auto")
    else:
        shape, axes, kwargs = CONFIGURATIONS[name]
        mesh = tfmp.DeviceMesh(shape, axes)
        strategy = tfmp.ModelParallelStrategy(mesh, megatron_layout_map(mesh), **kwargs)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_hub_llama() if name in HUB_CONFIGURATIONS else build_transformer_lm(
            seq_len=length, d_model=WIDTH, num_heads=HEADS, ffn_dim=FFN
        )
        model.compile(
            keras.optimizers.Adam(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    x, y = next_token_data(BATCH, length, 64)
    if name in HUB_CONFIGURATIONS:
        x = {"token_ids": x, "padding_mask": np.ones_like(x)}
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    first = mesh.dtensor_mesh.local_devices()[0]
    produced = kept = largest = 0
    for function in filter(is_train_step, first_step_graphs_of(model).function_graphs):
        for partition in function.partition_graphs:
            nodes = {node.name: node for node in partition.node if _on_device(node, first)}
            backward = backward_nodes(nodes.values())
            read_back = set()
            for node in nodes.values():
                if node.name in backward:
                    read_back.update(filter(None, (_forward_source(nodes, backward, source) for source in node.input)))
                elif _is_activation(node):
                    sizes = [_output_bytes(node, index) for index in range(_outputs(node))]
                    produced += sum(sizes)
                    largest = max([largest, *sizes])
            kept += sum(_output_bytes(nodes[name], index) for name, index in read_back)
    return {"produced": produced, "kept": kept, "largest": largest}


def build_hub_llama() -> keras.Model:
    """KerasHub's Llama backbone, one block, under a Dense vocabulary head."""
    import keras_hub

    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=HEADS, num_key_value_heads=HEADS // 2,
        hidden_dim=WIDTH, intermediate_dim=FFN,
    )
    return keras.Model(backbone.input, keras.layers.Dense(64, name="lm_head")(backbone.output))


def _op_name(node) -> str:
    names = node.experimental_debug_info.original_node_names
    return names[0] if names else node.name


def backward_nodes(nodes) -> set[str]:
    """The backward pass among a step's partition graph `nodes`: the names of
    the nodes TensorFlow's gradients (and tfmp's) name under
    "gradient_tape/", and of every node that reads a value of one, such as
    the sums of gradients TensorFlow names outside it (`AddN`) and the
    optimizer's update. A value computed from no batch and no weight (a
    causal mask, from ranges and the device's offset) is in neither pass:
    the two passes can share it under the backward's name. An `IdentityN`
    passes each input to its output of the same position, and DTensor's
    bundle forward and backward values: its outputs that carry backward
    values are in the set as `"name:position"`.
    """
    nodes = list(nodes)
    readers: dict[str, list[tuple[str, int, int]]] = {}
    identities = {node.name for node in nodes if node.op == "IdentityN"}
    for node in nodes:
        data = [source for source in node.input if not source.startswith("^")]
        for position, source in enumerate(data):
            producer, _, index = source.partition(":")
            readers.setdefault(producer, []).append((node.name, position, int(index or 0)))
    from_data = _computed_from_data(nodes, readers)
    backward = {
        node.name
        for node in nodes
        if node.name in from_data and any(part.startswith("gradient_tape") for part in _op_name(node).split("/"))
    }
    frontier: list[tuple[str, int | None]] = [(name, None) for name in backward]
    while frontier:
        producer, output = frontier.pop()
        for reader, position, index in readers.get(producer, ()):
            if output is not None and index != output:
                continue
            if reader in identities and reader not in backward:
                if f"{reader}:{position}" not in backward:
                    backward.add(f"{reader}:{position}")
                    frontier.append((reader, position))
            elif reader not in backward:
                backward.add(reader)
                frontier.append((reader, None))
    return backward


def _computed_from_data(nodes: list, readers: dict) -> set[str]:
    """The names of `nodes` computed from a weight or a batch: a variable
    read or an argument that is not a scalar (a device's id is), or a node
    that reads one of their values."""
    from_data = {
        node.name
        for node in nodes
        if node.op in ("ReadVariableOp", "ResourceGather")
        or (node.op == "_Arg" and any(len(shape.dim) or shape.unknown_rank
                                      for shape in node.attr["_output_shapes"].list.shape))
    }
    frontier = list(from_data)
    while frontier:
        for reader, _, _ in readers.get(frontier.pop(), ()):
            if reader not in from_data:
                from_data.add(reader)
                frontier.append(reader)
    return from_data


def _forward_source(nodes: dict, backward: set, source: str) -> tuple[str, int] | None:
    """The forward activation a backward op's input `source` reads, through
    identities; None for a control input, a weight, a constant or a
    backward value."""
    if source.startswith("^"):
        return None
    name, _, index = source.partition(":")
    index = int(index or 0)
    while name in nodes and nodes[name].op in ("Identity", "IdentityN") and name not in backward:
        if f"{name}:{index}" in backward:
            return None
        name, _, inner = nodes[name].input[index if nodes[name].op == "IdentityN" else 0].partition(":")
        index = int(inner or 0)
    if name in nodes and name not in backward and _is_activation(nodes[name]):
        return name, index
    return None


def _on_device(node, device: str) -> bool:
    return (
        tf.DeviceSpec.from_string(node.device or "/cpu:0").device_index
        == tf.DeviceSpec.from_string(device).device_index
    )


def _is_activation(node) -> bool:
    return node.op not in _NOT_ACTIVATIONS and "_output_shapes" in node.attr


def _outputs(node) -> int:
    return len(node.attr["_output_shapes"].list.shape) if "_output_shapes" in node.attr else 0


def _output_bytes(node, index: int) -> int:
    """Bytes of output `index` of `node`, counted as float32; 0 where its
    shape is not known."""
    shapes = node.attr["_output_shapes"].list.shape
    if index >= len(shapes):
        return 0
    dims = [d.size for d in shapes[index].dim]
    return int(np.prod(dims)) * 4 if dims and all(d >= 0 for d in dims) else 0


def longest_within(lengths: list[int], sizes: list[int], limit: int) -> float:
    """The length at which a quadratic through `(lengths, sizes)` reaches `limit`."""
    a, b, c = np.polyfit(lengths, sizes, 2)
    roots = [r.real for r in np.roots([a, b, c - limit]) if abs(r.imag) < 1e-9 and r.real > 0]
    return max(roots)


def longest_measured(name: str, of, limit: int, length: int, known: dict) -> tuple[int, int]:
    """The longest length, a multiple of 64, whose measure `of` fits `limit`,
    searched from `length`: up or down by the square root of the measure's
    distance to the limit (at least 64 tokens) until one length fits and
    another does not, then by halves between them. Returns it and its
    measure."""
    fits, over = None, None
    while True:
        measured = of(known[length] if length in known else measured_in_a_fresh_process(name, length))
        if measured <= limit:
            fits = max(fits or (0, 0), (length, measured))
        else:
            over = length if over is None else min(over, length)
        if fits is not None and over is not None:
            if over - fits[0] <= 64:
                return fits
            length = max(fits[0] + 64, (fits[0] + over) // 2 // 64 * 64)
            continue
        scaled = int(length * (limit / measured) ** 0.5) // 64 * 64
        if measured <= limit:
            length = max(length + 64, scaled)
        elif length == 64:
            return 0, measured
        else:
            length = max(64, min(length - 64, scaled))


def measured_in_a_fresh_process(name: str, length: int) -> dict:
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", name, str(length)],
        capture_output=True, text=True, timeout=3600,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{name} at {length} tokens failed:\n{result.stderr[-2000:]}")
    return json.loads(lines[-1])["bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,512,1024", help="three or more sequence lengths, multiples of 64")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, length = args.child
        print(json.dumps({"bytes": activation_bytes(name, int(length))}))
        return
    lengths = [int(n) for n in args.lengths.split(",")]
    table = {name: {n: measured_in_a_fresh_process(name, n) for n in lengths} for name in CONFIGURATIONS}
    kept = {name: {n: table[name][n]["kept"] for n in lengths} for name in CONFIGURATIONS}
    ideal = {n: kept["one device"][n] / 8 for n in lengths}
    print(f"activation bytes per device (batch {BATCH}, width {WIDTH}, {HEADS} heads): kept for the backward "
          "pass (/ ideal, one device's / 8), produced, largest")
    print(f"{'configuration':16s}" + "".join(f"{n:>48d}" for n in lengths))
    for name in CONFIGURATIONS:
        cells = "".join(
            f"{kept[name][n]:>14,d} ({kept[name][n] / ideal[n]:4.2f}) {table[name][n]['produced']:>13,d}"
            f" {table[name][n]['largest']:>11,d}"
            for n in lengths
        )
        print(f"{name:16s}{cells}")
    measures = {
        "kept": lambda bytes_: bytes_["kept"],
        "kept + largest": lambda bytes_: bytes_["kept"] + bytes_["largest"],
    }
    for measure, of in measures.items():
        limit = of(table["tensor"][lengths[-1]])
        print(f"longest length within {limit:,d} B {measure} per device (tensor parallelism alone at "
              f"{lengths[-1]} tokens), fitted, then measured:")
        for name in ("sequence", "context", "context+tensor"):
            fitted = longest_within(lengths, [of(table[name][n]) for n in lengths], limit)
            length, measured = longest_measured(name, of, limit, max(64, int(fitted) // 64 * 64), table[name])
            print(f"  {name}: fitted {fitted:.0f} tokens; measured {measured:,d} B at {length} tokens")
            ratio = length / lengths[-1]
            target = ">=6" if name.startswith("context") else "-"
            status = ("met" if ratio >= 6 else "missed") if name.startswith("context") else "-"
            print(f'RESULT measure="longest sequence within one per-device limit ({measure}), {name} / tensor" '
                  f"ratio={ratio:.2f} target={target} status={status}")
    for name in ("context", "context+tensor"):
        ratio = kept[name][lengths[-1]] / ideal[lengths[-1]]
        print(f'RESULT measure="activation bytes kept per device / ideal, {name}, {lengths[-1]} tokens" '
              f"ratio={ratio:.2f} target=- status=-")
    hub = {name: measured_in_a_fresh_process(name, lengths[-1]) for name in HUB_CONFIGURATIONS}
    print(f"KerasHub's Llama on 1x8x1, {lengths[-1]} tokens, activation bytes per device: kept, largest")
    for name, bytes_ in hub.items():
        print(f"  {name:20s}{bytes_['kept']:>14,d} {bytes_['largest']:>13,d}")
    ratio = hub["llama, blockwise"]["kept"] / hub["llama, own softmax"]["kept"]
    print(f'RESULT measure="KerasHub Llama under context parallelism, kept bytes, blockwise / own softmax, '
          f'{lengths[-1]} tokens" ratio={ratio:.2f} target=- status=-')


if __name__ == "__main__":
    main()
