"""Each DTensor bug or missing layout rule that tfmp works around, reproduced
on raw DTensor (TensorFlow ops under a mesh, no tfmp), in this process.

Run as a script in a fresh process without DTensor's replicated switches
(`tests/test_canaries.py` does): it prints one JSON object, each probe's name
with `{"still": bool, "saw": str, "remove": str}`: whether DTensor still does
what the workaround is for, what it did, and the workaround that becomes
removable when it no longer does. The names are the workarounds' own: a
lowering's `"<module tail>.<function>"`, an integration patch's
`"tf.<attribute>"`, an op of `tfmp._env.REPLICATED_OPS`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from typing import Any, Callable

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

# As tfmp sets them (`tfmp._env`), but no replicated switches.
os.environ["DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"] = "0"
os.environ["LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"] = "1"
REPLICATED_BY_DEFAULT = "DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF."
NO_RULE = "does not implement layout propagation"

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
MESH = dtensor.create_mesh([("batch", 2), ("model", 4)], devices=[f"CPU:{i}" for i in range(8)])
U = dtensor.UNSHARDED
RNG = np.random.default_rng(0)


def on_mesh(value: Any, *specs: str) -> tf.Tensor:
    """`value` on the mesh, laid out by `specs` (replicated without)."""
    value = tf.constant(value)
    whole = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(MESH, value.shape.rank))
    return dtensor.relayout(whole, dtensor.Layout(list(specs) or [U] * value.shape.rank, MESH))


def whole(value: tf.Tensor) -> np.ndarray:
    """A DTensor's global value, gathered one mesh axis at a time."""
    specs = list(dtensor.fetch_layout(value).sharding_specs)
    for dim, spec in enumerate(specs):
        if spec != U:
            specs[dim] = U
            value = dtensor.relayout(value, dtensor.Layout(specs, MESH))
    return value.numpy()


def refusal(fn: Callable, *inputs: tf.Tensor, says: str) -> tuple[bool, str]:
    """Whether `tf.function(fn)(*inputs)` still fails with `says` in its error."""
    return _refused(lambda: tf.function(fn)(*inputs), says)


def _refused(run: Callable[[], Any], says: str) -> tuple[bool, str]:
    try:
        run()
    except Exception as error:  # noqa: BLE001 (any error is what DTensor did)
        words = str(error)
        if says in words:
            return True, f"refuses: ...{_around(words, says)}..."
        return False, f"fails otherwise: {_first_line(words)}"
    return False, "runs it"


def wrong_values(fn: Callable, *inputs: np.ndarray, specs: list[tuple[str, ...]]) -> tuple[bool, str]:
    """Whether `fn` on the mesh, its inputs laid out by `specs`, still gives
    other values than `fn` on one device (or fails)."""
    want = [np.asarray(v) for v in tf.nest.flatten(fn(*(tf.constant(x) for x in inputs)))]
    try:
        got = tf.function(fn)(*(on_mesh(x, *spec) for x, spec in zip(inputs, specs)))
        got = [whole(v) for v in tf.nest.flatten(got)]
    except Exception as error:  # noqa: BLE001
        return True, f"fails: {_first_line(str(error))}"
    for g, w in zip(got, want):
        if g.shape != w.shape or not np.allclose(g, w, atol=1e-5):
            return True, f"gives other values (max difference {_difference(g, w)})"
    return False, "gives one device's values"


def _difference(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape:
        return f"shapes {got.shape} and {want.shape}"
    return f"{np.max(np.abs(got - want)):.3g}"


def _around(words: str, says: str) -> str:
    at = words.index(says)
    return words[max(0, at - 60) : at + len(says) + 20].replace("\n", " ")


def _first_line(words: str) -> str:
    lines = [line for line in words.splitlines() if line.strip() and "in user code" not in line]
    return (lines[0] if lines else words)[:240]


PROBES: list[tuple[str, str, tuple[str, ...], Callable[[], tuple[bool, str]]]] = []


def probe(name: str, remove: str, covers: tuple[str, ...] = ()) -> Callable:
    """Registers a probe: `name` the workaround's, `remove` what to delete,
    `covers` the other workarounds that exist for the same DTensor behaviour."""

    def register(check: Callable[[], tuple[bool, str]]) -> Callable:
        PROBES.append((name, remove, (name, *covers), check))
        return check

    return register


ONE = on_mesh(1.0)
SEED = tf.constant([1, 2])


# Lowerings that exist because an op has no rule (faster than the op replicated).
_ALSO_FOR = {"MatrixBandPart": ("numpy.tril", "numpy.triu")}


def _no_rule_probe(op: str, run: Callable[[tf.Tensor], Any]) -> None:
    also = _ALSO_FOR.get(op, ())
    remove = f'"{op}" from tfmp._env.REPLICATED_OPS' + "".join(f", the {name} lowering" for name in also)

    @probe(op, remove, covers=also)
    def check():
        return refusal(run, ONE, says=NO_RULE)


_STATE = dtensor.DVariable(on_mesh(np.array([5, 0, 0], np.int64)))
_SQUARE = np.array([[2.0, 1.0], [0.5, 3.0]], np.float32)
for _op, _run in {
    "StatelessRandomGammaV3": lambda a: tf.random.stateless_gamma([3], SEED, alpha=a),
    "StatelessRandomPoisson": lambda a: tf.random.stateless_poisson([3], SEED, lam=a),
    "StatelessRandomBinomial": lambda a: tf.random.stateless_binomial([3], SEED, 10.0, a / 2),
    "StatelessMultinomial": lambda a: tf.random.stateless_categorical(tf.math.log([[a, a]]), 3, SEED),
    "StatelessParameterizedTruncatedNormal": lambda a: tf.random.stateless_parameterized_truncated_normal(
        [3], SEED, 0.0, a, -1.0, 1.0
    ),
    "RandomPoissonV2": lambda a: tf.random.poisson([3], lam=a, seed=1),
    "StatefulRandomBinomial": lambda a: tf.raw_ops.StatefulRandomBinomial(
        resource=_STATE.handle, algorithm=1, shape=[3], counts=10.0 * a, probs=a / 2
    ),
    "MatrixBandPart": lambda a: tf.linalg.band_part(_SQUARE * a, -1, 0),
    "MatrixDiagV3": lambda a: tf.linalg.diag(tf.stack([a, a])),
    "ConcatOffset": lambda a: tf.raw_ops.ConcatOffset(
        concat_dim=0, shape=[tf.cast(tf.stack([a, a]), tf.int32), tf.cast(tf.stack([2.0 * a, a]), tf.int32)]
    ),
    "ImageProjectiveTransformV3": lambda a: tf.raw_ops.ImageProjectiveTransformV3(
        images=tf.ones([1, 4, 4, 1]) * a, transforms=[[1.0, 0, 1, 0, 1, 0, 0, 0]], output_shape=[4, 4],
        fill_value=0.0, interpolation="BILINEAR",
    ),
    "MatrixInverse": lambda a: tf.linalg.inv(_SQUARE * a),
    "MatrixSolve": lambda a: tf.linalg.solve(_SQUARE * a, [[1.0], [2.0]]),
    "Roll": lambda a: tf.roll(_SQUARE * a, 1, axis=1),
    "AvgPoolGrad": lambda a: tf.raw_ops.AvgPoolGrad(
        orig_input_shape=[1, 4, 4, 1], grad=tf.ones([1, 2, 2, 1]) * a, ksize=[1, 2, 2, 1],
        strides=[1, 2, 2, 1], padding="VALID",
    ),
    "AvgPool3DGrad": lambda a: tf.raw_ops.AvgPool3DGrad(
        orig_input_shape=[1, 2, 2, 2, 1], grad=tf.ones([1, 1, 1, 1, 1]) * a, ksize=[1, 2, 2, 2, 1],
        strides=[1, 2, 2, 2, 1], padding="VALID",
    ),
    "ReverseV2": lambda a: tf.reverse(_SQUARE * a, [1]),
    "DepthwiseConv2dNativeBackpropFilter": lambda a: tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
        input=tf.ones([1, 3, 3, 2]) * a, filter_sizes=[2, 2, 2, 1], out_backprop=tf.ones([1, 2, 2, 2]),
        strides=[1, 1, 1, 1], padding="VALID",
    ),
    "DepthwiseConv2dNativeBackpropInput": lambda a: tf.raw_ops.DepthwiseConv2dNativeBackpropInput(
        input_sizes=[1, 3, 3, 2], filter=tf.ones([2, 2, 2, 1]) * a, out_backprop=tf.ones([1, 2, 2, 2]),
        strides=[1, 1, 1, 1], padding="VALID",
    ),
    "SpaceToBatchND": lambda a: tf.space_to_batch_nd(tf.ones([1, 4, 4, 1]) * a, [2, 2], [[0, 0], [0, 0]]),
    "BatchToSpaceND": lambda a: tf.batch_to_space(tf.ones([4, 2, 2, 1]) * a, [2, 2], [[0, 0], [0, 0]]),
}.items():
    _no_rule_probe(_op, _run)

ROWS = RNG.normal(size=(4, 8)).astype("float32")
IMAGES = RNG.normal(size=(4, 5, 5, 8)).astype("float32")
SPLIT_ROWS = on_mesh(ROWS, "batch", "model")
SPLIT_CHANNELS = on_mesh(IMAGES, "batch", U, U, "model")
SPLIT_BATCH = on_mesh(IMAGES, "batch", U, U, U)


@probe("nn.conv", "the conv lowering (tfmp/lowering/conv.py)")
def _conv():
    kernel = on_mesh(RNG.normal(size=(3, 3, 8, 4)).astype("float32"), U, U, U, "model")
    return refusal(
        lambda x, k: tf.nn.conv2d(x, k, 1, "SAME"), SPLIT_BATCH, kernel,
        says="Filter for convolution must have fully replicated layout",
    )


@probe(
    "nn.depthwise_conv",
    "the gathering of depthwise_conv and separable_conv's inputs (tfmp/lowering/replicated.py), "
    "where their gradients' ops have a rule too",
    covers=("nn.separable_conv",),
)
def _depthwise_split_channels():
    kernel = on_mesh(RNG.normal(size=(3, 3, 8, 1)).astype("float32"), U, U, "model", U)
    return refusal(
        lambda x, k: tf.nn.depthwise_conv2d(x, k, [1, 1, 1, 1], "SAME"), SPLIT_CHANNELS, kernel,
        says="must be batch parallel",
    )


@probe("nn.conv_transpose", "the conv_transpose lowering (tfmp/lowering/conv.py)")
def _conv_transpose():
    kernel = on_mesh(RNG.normal(size=(3, 3, 4, 8)).astype("float32"))
    return refusal(
        lambda x, k: tf.nn.conv2d_transpose(x, k, [4, 5, 5, 4], 1, "SAME"), SPLIT_CHANNELS, kernel,
        says="batch parallel",
    )


@probe("numpy.split", "the split lowering (tfmp/lowering/rnn.py)")
def _split():
    return wrong_values(lambda x: tf.split(x, 2, axis=1)[0] * 1.0, ROWS, specs=[("batch", "model")])


@probe(
    "backend.rnn", "the rnn, fori_loop, scan and map lowerings and the TensorArray patch",
    covers=("core.fori_loop", "core.scan", "core.map", "tf.__init__"),
)
def _tensor_lists():
    def loop(x):
        array = tf.TensorArray(tf.float32, size=3)
        _, array = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a.write(i, x)), (0, array))
        return array.stack()

    return refusal(loop, SPLIT_ROWS, says="'tf.TensorList")


@probe(
    "random.normal", "the normal, uniform, truncated_normal, randint and dropout lowerings",
    covers=("random.uniform", "random.truncated_normal", "random.randint", "random.dropout", "image.elastic_transform"),
)
def _per_shard_draws():
    draw = lambda x: x * 0.0 + tf.random.stateless_normal([4, 8], SEED)  # noqa: E731
    return wrong_values(draw, ROWS, specs=[("batch", "model")])


@probe(
    "nn.one_hot", "the one_hot lowering and the tf.one_hot patch (tfmp/lowering/indexing.py)",
    covers=("tf.one_hot",),
)
def _one_hot():
    return wrong_values(lambda h: tf.one_hot(tf.argmax(h, -1), 8) * h, ROWS, specs=[("batch", "model")])


@probe("numpy.take", "the take lowering (tfmp/lowering/indexing.py)")
def _take():
    table = RNG.normal(size=(8, 8)).astype("float32")
    indices = np.array([1, 2, 6, 7], np.int32)
    return wrong_values(
        lambda t, i, h: tf.gather(t, i) * h, table, indices, ROWS, specs=[("model", U), ("batch",), ("batch", "model")]
    )


@probe("array_ops.strided_slice", "the strided_slice lowering (tfmp/lowering/slicing.py)")
def _backward_slice():
    return wrong_values(lambda x: x[:, ::-1] * 1.0, ROWS, specs=[("batch", "model")])


@probe("core.slice", "the slice and pad lowerings (tfmp/lowering/slicing.py)", covers=("numpy.pad",))
def _slice_gradient():
    table = RNG.normal(size=(16, 8)).astype("float32")

    def table_gradient(t, h):
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(tf.slice(t, [2, 0], [4, 8]) * h)
        return tape.gradient(loss, t)

    return wrong_values(table_gradient, table, ROWS, specs=[(U, U), ("batch", "model")])


@probe("nn.average_pool", "the gathering of average_pool's input (tfmp/lowering/replicated.py)")
def _average_pool():
    return refusal(lambda x: tf.nn.avg_pool2d(x, 2, 2, "VALID"), SPLIT_CHANNELS, says="must be batch parallel")


@probe("nn.max_pool", "the max_pool lowering (tfmp/lowering/pooling.py)")
def _max_pool():
    return refusal(lambda x: tf.nn.max_pool2d(x, 2, 2, "VALID"), SPLIT_CHANNELS, says="batch parallel")


@probe("numpy.transpose", "the transpose lowering (tfmp/lowering/arrays.py)")
def _transpose():
    square = RNG.normal(size=(8, 8)).astype("float32")
    return wrong_values(lambda x: tf.transpose(x) * x, square, specs=[("batch", "model")])


@probe("numpy.argsort", "the argsort and sort lowerings (tfmp/lowering/arrays.py)", covers=("numpy.sort",))
def _argsort():
    sorted_as_split = lambda x: tf.cast(tf.argsort(x, axis=1), tf.float32) * x  # noqa: E731
    return refusal(sorted_as_split, SPLIT_ROWS, says="should be UNSHARDED")


@probe("tf.unstack", "the tf.unstack patch (tfmp/lowering/joins.py)")
def _unstack():
    boxes = RNG.normal(size=(8, 4)).astype("float32")
    restacked = lambda x, h: tf.stack(tf.unstack(x, axis=1), 1) * h  # noqa: E731
    return wrong_values(restacked, boxes, boxes, specs=[("batch", "model"), ("batch", "model")])


@probe("tf.stack", "the tf.stack patch (tfmp/lowering/joins.py)")
def _stack():
    return wrong_values(
        lambda x, h: tf.stack(tf.unstack(x, axis=0), axis=1) * h, ROWS[:, :4], ROWS[:, 4:],
        specs=[(U, U), (U, "model")],
    )


@probe("tf.capture", "the FuncGraph.capture patch (tfmp/strategy/keras_hooks.py)")
def _host_capture():
    host = tf.constant(ROWS)
    return refusal(lambda x: x + host, SPLIT_ROWS, says="expecting a DTensor")


@probe("numpy.matmul", "the matmul lowering (tfmp/lowering/arrays.py)")
def _tensordot_gathers_a_split_sequence():
    """Keras' matmul of a (batch, sequence, features) tensor is tensordot,
    whose reshape of batch and sequence into rows gathers a split sequence."""
    product = tf.function(lambda x, w: tf.tensordot(x, w, axes=[[-1], [0]]))(
        on_mesh(RNG.normal(size=(4, 8, 3)).astype("float32"), "batch", "model", U),
        on_mesh(RNG.normal(size=(3, 2)).astype("float32")),
    )
    specs = dtensor.fetch_layout(product).sharding_specs
    return specs[1] == U, f"lays its result out {specs}"


@probe("nn.sparse_categorical_crossentropy", "the sparse_categorical_crossentropy lowering (tfmp/lowering/losses.py)")
def _cross_entropy_takes_a_label_past_split_classes():
    """With the classes split, DTensor's expansion of the kernel computes a
    loss for a label that is not a class, where the kernel refuses it."""
    loss = tf.function(
        lambda labels, logits: tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    )(on_mesh(np.array([0, 8]), "batch"), on_mesh(ROWS[:2, :8], "batch", "model"))
    return bool(np.all(np.isfinite(whole(loss)))), f"a loss of {whole(loss)} for labels [0, 8] of 8 classes"


@probe("nn.dot_product_attention", "the dot_product_attention lowering (tfmp/lowering/attention.py)")
def _attention_softmax_over_every_key():
    """Keras' attention on TensorFlow (no DTensor behaviour: Keras' own)
    takes the softmax of each query's scores against every key at once, so
    its backward pass keeps `(batch, heads, queries, keys)` scores."""
    from keras.src.backend.tensorflow.nn import dot_product_attention

    x = tf.zeros((1, 8, 2, 4))
    graph = tf.function(lambda x: dot_product_attention(x, x, x, is_causal=True)).get_concrete_function(x).graph
    shapes = sorted(tuple(op.outputs[0].shape) for op in graph.get_operations() if op.type == "Softmax")
    return (1, 2, 8, 8) in shapes, f"softmax outputs shaped {shapes}"


@probe("tf.var_handle_op", "the var_handle_op patch (tfmp/strategy/variable_handles.py)")
def _each_variable_name_is_laid_out_anew():
    """Two variables of one shape and layout, two names: DTensor lays out
    their handle ops twice, keyed by the debug name TensorFlow gives them."""
    from tensorflow.dtensor.python import api as dtensor_api

    def misses():
        return dtensor_api._dtensor_device()._get_stats()["function_manager.miss"]  # noqa: SLF001

    initial = on_mesh(ROWS[:2, :3])
    before = misses()
    dtensor.DVariable(initial, name="first_of_a_shape")
    after_one = misses()
    dtensor.DVariable(initial, name="second_of_the_shape")
    anew = misses() - after_one
    return anew > 0, f"the second variable of a shape and layout laid out {anew} more functions (the first {after_one - before})"


@probe("tf.call_flat", "the Grappler patch (tfmp/strategy/grappler.py)")
def _grappler_folds_with_whole_shapes():
    """Each device's graph keeps the whole kernel's shape on its shard, and
    Grappler's constant folding makes `zeros_like` of a product with it that
    wide: the result's shards are wider than its layout says. The batch is
    unknown when traced (a last partial batch), so `zeros_like` stays an op."""
    kernel = dtensor.DVariable(on_mesh(ROWS[:3, :4], U, "model"))

    @tf.function(input_signature=[tf.TensorSpec([None, 3]), tf.TensorSpec([None, 1], tf.bool)])
    def masked(x, keep):
        product = tf.matmul(x, kernel)
        return tf.where(keep, product, tf.zeros_like(product))

    result = masked(on_mesh(ROWS[:1, :3]), on_mesh(np.array([[True]])))
    shapes = {tuple(shard.shape) for shard in dtensor.unpack(result)}
    return shapes != {(1, 1)}, f"shards of shapes {sorted(shapes)} for a [1, 4] result split in 4"


def _eager_refusal(write: Callable[[], Any], says: str) -> tuple[bool, str]:
    """Whether `write()`, eager, under a host summary writer, still fails
    with `says` in its error."""
    with tempfile.TemporaryDirectory() as logdir:
        writer = tf.summary.create_file_writer(logdir)
        with writer.as_default():
            refused = _refused(write, says)
        writer.close()
    return refused


@probe(
    "tf.write_summary", "the summary-write patch (tfmp/strategy/summaries.py)",
    covers=("tf.write_raw_proto_summary",),
)
def _summary_at_a_mesh_step():
    """A host value at a step on the mesh (an optimizer's iterations) is
    refused; a mesh value is written as a queued mesh op, after a flush or
    deletion of the writer that ran at once (not probed: it is a race)."""
    step = dtensor.DVariable(on_mesh(np.int64(1)))
    return _eager_refusal(lambda: tf.summary.write("rows", tf.constant(ROWS), step=step), says="expecting a DTensor")


@probe("tf.histogram", "the summary patch (tfmp/strategy/summaries.py)", covers=("tf.image", "tf.audio"))
def _histogram_of_mesh_data():
    return _eager_refusal(lambda: tf.summary.histogram("rows", SPLIT_ROWS, step=1), says="expecting a DTensor")


@probe("tf.Relayout", "the Relayout gradient patch (tfmp/strategy/variable.py)")
def _dense_relayout_gradient():
    table = dtensor.DVariable(on_mesh(ROWS))
    kinds = []

    def lookup(indices):
        with tf.GradientTape() as tape:
            read = dtensor.relayout(table.read_value(), dtensor.Layout([U, U], MESH))
            loss = tf.reduce_sum(tf.gather(read, indices))
        kinds.append(type(tape.gradient(loss, table)).__name__)
        return loss

    tf.function(lookup)(on_mesh(np.array([0, 2], np.int32)))
    sparse = kinds == ["IndexedSlices"]
    return not sparse, "keeps it sparse" if sparse else "makes it dense"


@probe(
    "tf.random_standard_normal", "the stateful random kernel patches (tfmp/lowering/random.py)",
    covers=tuple(
        f"tf.{kernel}"
        for kernel in (
            "random_uniform", "truncated_normal", "random_uniform_int", "random_gamma",
            "random_poisson_v2", "random_shuffle", "multinomial",
        )
    ),
)
def _stateful_random():
    return refusal(lambda a: tf.raw_ops.RandomStandardNormal(shape=[3], dtype=tf.float32) * a, ONE, says=NO_RULE)


def _enrolled(op: str) -> None:
    os.environ[REPLICATED_BY_DEFAULT + op.upper()] = "1"


# After the probes above: DTensor keeps an op's switch for the process once
# it compiled the op with it.
@probe(
    "numpy.roll", "the gathering of tfmp/lowering/replicated.py (DTensor's own gather would do)",
    covers=("numpy.flip", "numpy.fliplr", "numpy.flipud", "image.affine_transform", "image.perspective_transform"),
)
def _replicated_gathers_two_axes():
    _enrolled("Roll")
    scores = on_mesh(RNG.normal(size=(4, 8, 8)).astype("float32"), "batch", "model", U)
    return refusal(lambda x: tf.roll(x, 1, axis=1), scores, says="number of elements to match")


def main() -> None:
    results = {}
    for name, remove, covers, check in PROBES:
        try:
            still, saw = check()
        except Exception:  # noqa: BLE001 (a probe's own failure is reported, not hidden)
            still, saw = False, "probe failed: " + traceback.format_exc(limit=3)[-600:]
        results[name] = {"still": bool(still), "saw": saw, "remove": remove, "covers": covers}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
