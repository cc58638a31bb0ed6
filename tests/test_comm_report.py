"""tfmp.comm_report counts the collectives of a step as Megatron-LM predicts."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from helpers import build_layers_lm, build_mlp, compile_mlp, lm_data, mesh, mlp_data, mlp_layout_map
from tfmp.inspect.comm_report import CommReport, _collective, _sums_gradients
from tfmp.inspect.summary import bytes_per_device


def fit_one_epoch(strategy, build, compile_fn, data, batch_size):
    with strategy.scope():
        model = compile_fn(build())
    model.fit(*data, batch_size=batch_size, epochs=1, verbose=0)
    return model


def compile_loss_only(model):
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def test_two_layer_transformer_megatron_traffic():
    device_mesh = mesh((2, 4))
    strategy = tfmp.ModelParallelStrategy(device_mesh)
    # Loss only: an accuracy metric would gather the vocabulary-split logits.
    model = fit_one_epoch(strategy, lambda: build_layers_lm(num_layers=2), compile_loss_only, lm_data(64), 32)
    report = tfmp.comm_report(model, print_fn=lambda _: None)
    # b = 32 / 2 rows per device, s = 8, h = 32, float32.
    activation_bytes = 16 * 8 * 32 * 4
    per_layer = [
        c for c in report.collectives
        if c.phase == "forward" and c.axes == ("model",)
        and any(f"/{name}" in c.op for name in ("attention_output", "ffn_out"))
    ]
    assert [c.kind for c in per_layer] == ["all-reduce"] * 4  # 2 per layer, 2 layers
    assert all(c.bytes == activation_bytes for c in per_layer)
    assert not [c for c in report.collectives if c.kind == "all-gather"]
    backward_model = [c for c in report.collectives if c.phase == "backward" and c.axes == ("model",)]
    # Per layer the input gradients of attention (q, k, v summed first) and of
    # the FFN; then the head's input gradient.
    assert len(backward_model) == 2 * 2 + 1
    assert all(c.bytes == activation_bytes for c in backward_model)
    # Every gradient is synchronized over "batch" at its shard size, but the
    # embedding's: its gradient is sparse (rows by id, as Keras' Embedding), and
    # Keras' Adam sums those rows into its two slots, one all-reduce each.
    gradient_bytes = sum(c.bytes for c in report.collectives if c.category == "gradients")
    embedding_shard = (64 // 4) * 32 * 4
    shard_bytes = {kinds["parameters"] for kinds in bytes_per_device(model).values()}
    assert shard_bytes == {gradient_bytes + embedding_shard}
    assert all(c.axes == ("batch",) for c in report.collectives if c.category == "gradients")
    optimizer = [c for c in report.collectives if c.category == "optimizer"]
    assert [(c.axes, c.bytes) for c in optimizer] == [(("batch",), 64 * 32 * 4)] * 2
    assert "gradients" in str(report) and "all-reduce" in str(report)


def test_column_row_mlp_costs_one_forward_all_reduce():
    device_mesh = mesh((1, 8))
    strategy = tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))
    model = fit_one_epoch(strategy, build_mlp, compile_mlp, mlp_data(32), 16)
    report = tfmp.comm_report(model, print_fn=lambda _: None)
    forward = [c for c in report.collectives if c.phase == "forward" and c.axes == ("model",)]
    # The pair's output: 16 rows x 8 outputs x 4 bytes, then the metric/loss sums.
    assert [c.bytes for c in forward if "down" in c.op] == [16 * 8 * 4]
    # The first layer's input needs no gradient: no backward activation traffic.
    assert not [c for c in report.collectives if c.phase == "backward" and c.axes == ("model",)]
    # No batch axis of size > 1: nothing to synchronize.
    assert not [c for c in report.collectives if c.category == "gradients"]


def test_reduce_scatter_counts_the_tensor_it_reduces():
    """A reduce-scatter (DTensor's lowering with NCCL) outputs one device's
    part of the tensor it reduces; the report counts the whole tensor, of
    which a ring sends (k-1)/k, as for the other kinds."""
    device_mesh = mesh((2, 4))
    partition = tf.compat.v1.GraphDef()
    # DTensor's group table: one entry per device; equal entries form a group.
    # Devices (batch, model) = (0, m) and (1, m) reduce together: over "batch".
    table = partition.node.add(name="group_table", op="Const")
    table.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.array([0, 1, 2, 3] * 2, np.int32)))
    node = partition.node.add(
        name="gradient_tape/m/dense/MatMul/DTensorReduceScatterOp",
        op="CollectiveReduceScatterV2",
        input=["gradient", "group_size", "group_table"],
    )
    node.attr["T"].type = tf.float32.as_datatype_enum
    node.attr["_output_shapes"].list.shape.add().CopyFrom(tf.TensorShape([8, 16]).as_proto())
    collective = _collective(node, partition, device_mesh, "adam", "batch", sums_gradients=False)
    assert collective.kind == "reduce-scatter"
    assert (collective.axes, collective.category) == (("batch",), "gradients")
    assert collective.bytes == 2 * 8 * 16 * 4
    assert collective.wire_bytes(2) == 8 * 16 * 4


def test_a_sum_of_gradients_is_backward():
    """TensorFlow names the sum of a value's several gradients `AddN` outside
    "gradient_tape/", and DTensor names a collective of it after the sum:
    it is backward; an `AddN` of the forward pass stays forward."""
    device_mesh = mesh((2, 4))
    partition = tf.compat.v1.GraphDef()
    table = partition.node.add(name="group_table", op="Const")
    table.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32)))
    partition.node.add(name="AddN_7", op="AddN", input=["gradient_tape/m/dense/MatMul", "AddN_5"])
    partition.node.add(name="m/AddN", op="AddN", input=["m/dense/MatMul", "m/other/MatMul"])
    nodes = {}
    for op in ("AddN_7", "m/AddN"):
        nodes[op] = partition.node.add(
            name=f"{op}/DTensorAllGatherOp", op="CollectiveGatherV2", input=[op, "group_size", "group_table"]
        )
        nodes[op].attr["T"].type = tf.float32.as_datatype_enum
        nodes[op].attr["_output_shapes"].list.shape.add().CopyFrom(tf.TensorShape([8, 16]).as_proto())
    by_name = {node.name: node for node in partition.node}
    phases = {
        op: _collective(node, partition, device_mesh, "adam", "batch", _sums_gradients(node, by_name)).phase
        for op, node in nodes.items()
    }
    assert phases == {"AddN_7": "backward", "m/AddN": "forward"}


def test_unknown_sizes_and_groups_are_named():
    """A collective whose shape was unknown when traced, or whose group table
    the graph does not hold, is listed by name, not counted as 0 bytes or a
    "?" axis without a word."""
    device_mesh = mesh((2, 4))
    partition = tf.compat.v1.GraphDef()
    node = partition.node.add(
        name="m/dense/MatMul/DTensorAllReduceOp", op="CollectiveReduceV2",
        input=["x", "group_size", "missing_group_table"],
    )
    node.attr["T"].type = tf.float32.as_datatype_enum
    node.attr["_output_shapes"].list.shape.add().CopyFrom(tf.TensorShape([None, 16]).as_proto())
    collective = _collective(node, partition, device_mesh, "adam", "batch", sums_gradients=False)
    assert (collective.unknown, collective.axes, collective.bytes) == (("size", "group"), (), 0)
    report = CommReport([collective])
    assert report.unread() == [collective]
    assert "m/dense/MatMul (all-reduce): unknown size and group" in str(report)


def test_report_needs_a_trained_model():
    with pytest.raises(ValueError, match="not built under a tfmp.ModelParallelStrategy"):
        tfmp.comm_report(build_mlp())
    with tfmp.ModelParallelStrategy(mesh((2, 4))).scope():
        model = compile_mlp(build_mlp())
    with pytest.raises(ValueError, match=r"call model.fit\(...\) for at least one step"):
        tfmp.comm_report(model)


def test_each_model_reports_its_own_step():
    device_mesh = mesh((2, 4))
    strategy = tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))
    first = fit_one_epoch(strategy, build_mlp, compile_mlp, mlp_data(32), 16)
    with strategy.scope():
        second = compile_loss_only(build_layers_lm())
    second.fit(*lm_data(32), batch_size=16, epochs=1, verbose=0)
    ops_first = {c.op for c in tfmp.comm_report(first, print_fn=lambda _: None).collectives}
    ops_second = {c.op for c in tfmp.comm_report(second, print_fn=lambda _: None).collectives}
    assert any("down" in op for op in ops_first) and not any("down" in op for op in ops_second)
    assert any("ffn_out" in op for op in ops_second)
