"""One pure function decides every variable's layout
(`tfmp.layout_decision.decide_layout`): a table of cases, then the strategy
using it at variable creation and for `layout_map="auto"`.

Tolerances of the mixed_bfloat16 run: bfloat16 rounds every product and sum
at 2**-8 relative, and the mesh sums in another order than one device, so
its numbers are held to a yardstick measured here, not to 1e-5: the one-device
float64 run is the exact answer, and the mesh may be no further from it than
one device under the same policy is, within a factor of 2, one device in
two float orders (rows as given and reversed within each batch), the further
counting (as in tests/test_mixed_precision.py).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from helpers import initial_weights, mesh, rows_reversed_within_batches, train
from tfmp.layout import gather_on_use, split_on_use
from tfmp.layout_decision import decide_layout, is_floating_point

MESH_2X4 = {"batch": 2, "model": 4}
RULE = ("up/kernel", (None, "model"))
DECLARED = ("up", ("model", None))
PLANNED = ("^m/up/kernel$", ("model", None))
EXPLICIT = ("keras.Variable('m/up/kernel', layout=...)", (None, "model"))
SLOT_OF = ("m/up/kernel", (16, 32), ("batch", "model"))

# (case, shape, dtype, sources, fully_shard_axis, mesh axes) -> (axes, source)
CASES = [
    ("nothing: replicated", (16, 32), "float32", {}, None, MESH_2X4, ((None, None), "replicated")),
    ("a rule", (16, 32), "float32", {"rule": RULE}, None, MESH_2X4, ((None, "model"), "rule")),
    ("the plan", (16, 32), "float32", {"planned": PLANNED}, None, MESH_2X4, (("model", None), "planned")),
    ("the plan over a rule", (16, 32), "float32", {"planned": PLANNED, "rule": RULE}, None, MESH_2X4,
     (("model", None), "planned")),
    ("a declaration over the plan", (16, 32), "float32", {"declared": ("up", (None, "model")), "planned": PLANNED},
     None, MESH_2X4, ((None, "model"), "declared")),
    ("a declaration and a rule that agrees", (16, 32), "float32", {"declared": DECLARED, "rule": ("up", ("model", None))},
     None, MESH_2X4, (("model", None), "declared")),
    ("a declared axis the mesh lacks: whole", (16, 32), "float32", {"declared": ("up", ("expert", "model"))},
     None, MESH_2X4, ((None, "model"), "declared")),
    ("keras.Variable(layout=) over everything", (16, 32), "float32",
     {"explicit": EXPLICIT, "declared": DECLARED, "planned": PLANNED, "rule": ("up", ("model", None))},
     None, MESH_2X4, ((None, "model"), "explicit")),
    ("a slot: its variable's layout", (16, 32), "float32", {"slot_of": SLOT_OF, "rule": ("k", ("model", None))},
     "batch", MESH_2X4, (("batch", "model"), "slot")),
    ("a slot of another shape (a factored moment): its own", (16,), "float32", {"slot_of": SLOT_OF},
     "batch", MESH_2X4, (("batch",), "replicated")),
    ("an undividable dimension stays whole", (16, 30), "float32", {"rule": RULE}, None, MESH_2X4,
     ((None, None), "rule")),
    ("fully sharded float32", (16, 32), "float32", {"rule": RULE}, "batch", MESH_2X4, (("batch", "model"), "rule")),
    ("fully sharded bfloat16", (16, 32), "bfloat16", {"rule": RULE}, "batch", MESH_2X4, (("batch", "model"), "rule")),
    ("fully sharded float16", (16, 32), tf.float16, {"rule": RULE}, "batch", MESH_2X4, (("batch", "model"), "rule")),
    ("fully sharded float64", (16, 32), np.float64, {"rule": RULE}, "batch", MESH_2X4, (("batch", "model"), "rule")),
    ("fully sharded under the plan, bfloat16", (16, 32), "bfloat16", {"planned": PLANNED}, "batch", MESH_2X4,
     (("model", "batch"), "planned")),
    ("int64 (a seed) is never fully sharded", (2,), "int64", {}, "batch", MESH_2X4, ((None,), "replicated")),
    ("int32 (a lookup table) is never fully sharded", (64, 8), "int32", {}, "batch", MESH_2X4,
     ((None, None), "replicated")),
    ("bool is never fully sharded", (8,), "bool", {}, "batch", MESH_2X4, ((None,), "replicated")),
    ("string is never fully sharded", (8,), tf.string, {}, "batch", MESH_2X4, ((None,), "replicated")),
    ("a scalar stays a scalar", (), "float32", {}, "batch", MESH_2X4, ((), "replicated")),
    ("no whole dimension divides by the batch axis", (3, 5), "float32", {}, "batch", MESH_2X4,
     ((None, None), "replicated")),
    ("the largest whole dimension that divides", (3, 8, 4), "float32", {}, "batch", MESH_2X4,
     ((None, "batch", None), "replicated")),
    ("a tie: the first", (4, 4), "float32", {}, "batch", MESH_2X4, (("batch", None), "replicated")),
    ("already split over the batch axis", (4, 8, 4), "float32", {"rule": ("k", ("batch", None, None))}, "batch",
     MESH_2X4, (("batch", None, None), "rule")),
    ("a batch axis of one device: nothing more", (16, 32), "float32", {"rule": RULE}, "batch",
     {"batch": 1, "model": 8}, ((None, "model"), "rule")),
    ("a stage mesh without the batch axis", (16, 32), "float32", {}, "batch", {"model": 4}, ((None, None), "replicated")),
    ("a split over an axis of size 1 is whole", (16, 32), "float32", {"rule": ("k", ("model", "batch"))}, None,
     {"batch": 1, "model": 8}, (("model", None), "rule")),
    ("a model axis of size 1: whole, then fully sharded there", (16, 32), "float32", {"rule": RULE}, "batch",
     {"batch": 8, "model": 1}, ((None, "batch"), "rule")),
]


@pytest.mark.parametrize(
    "shape, dtype, sources, fully_shard_axis, mesh_axes, expected", [case[1:] for case in CASES], ids=[c[0] for c in CASES]
)
def test_decide_layout(shape, dtype, sources, fully_shard_axis, mesh_axes, expected):
    decision = decide_layout("m/up/kernel", shape, dtype, mesh_axes, fully_shard_axis=fully_shard_axis, **sources)
    assert (decision.axes, decision.source) == expected, decision.why


def test_decide_layout_says_why():
    fully = decide_layout("m/up/kernel", (16, 32), "bfloat16", MESH_2X4, rule=RULE, fully_shard_axis="batch")
    assert fully.why == "LayoutMap rule 'up/kernel'; fully sharded: 'batch' on dimension 0"
    seed = decide_layout("m/seed", (2,), "int64", MESH_2X4, fully_shard_axis="batch")
    assert seed.why == "no rule: replicated; not fully sharded: int64 is not floating point"
    slot = decide_layout("adam/m", (16, 32), "float32", MESH_2X4, slot_of=SLOT_OF)
    assert slot.why == "optimizer slot of 'm/up/kernel': its variable's layout"
    undivided = decide_layout("m/up/kernel", (16, 30), "float32", MESH_2X4, rule=RULE)
    [dimension] = undivided.undivided
    assert (dimension.dim, dimension.size, dimension.axis, dimension.parts) == (1, 30, "model", 4)
    assert dimension.source == "LayoutMap rule 'up/kernel'"


def test_gather_on_use_layouts_name_their_gathered_axes():
    planned = ("^m/patch/kernel$", gather_on_use((None, None, None, "model")))
    decision = decide_layout("m/patch/kernel", (4, 4, 3, 8), "float32", MESH_2X4, planned=planned, fully_shard_axis="batch")
    assert decision.axes == ("batch", None, None, "model")
    assert decision.gathered_on_use == ("model",)
    assert decide_layout("m/up/kernel", (16, 32), "float32", MESH_2X4, rule=RULE).gathered_on_use == ()


def test_split_on_use_layouts_are_not_gathered_over_the_batch_axis():
    from tfmp.strategy.variable_layout import gathered_axes

    rule = ("moe/w_in", split_on_use(("batch", None, "model")))
    decision = decide_layout("moe/w_in", (8, 16, 32), "float32", MESH_2X4, rule=rule)
    assert decision.axes == ("batch", None, "model") and decision.split_on_use == ("batch", "model")
    assert gathered_axes("batch", decision) == ()
    # On "model" only, fully sharded over "batch": the added split is gathered.
    rule = ("moe/w_out", split_on_use((None, None, "model")))
    model_only = decide_layout("moe/w_out", (8, 16, 32), "float32", MESH_2X4, rule=rule, fully_shard_axis="batch")
    assert model_only.axes == (None, "batch", "model") and model_only.split_on_use == ("model",)
    assert gathered_axes("batch", model_only) == ("batch",)
    layout_map = tfmp.LayoutMap(mesh((2, 4)))
    layout_map["moe/w_in"] = split_on_use(("batch", None, "model"))
    assert repr(layout_map["moe/w_in"]) == "split_on_use(('batch', None, 'model'))"


def test_bad_layouts_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"layer 'up' declares the layout \('model', None\) but LayoutMap rule 'up/kernel'"):
        decide_layout("m/up/kernel", (16, 32), "float32", MESH_2X4, declared=DECLARED, rule=RULE)
    with pytest.raises(ValueError, match=r"'expert' is not an axis of the mesh \{'batch': 2, 'model': 4\}"):
        decide_layout("m/up/kernel", (16, 32), "float32", MESH_2X4, rule=("up", (None, "expert")))
    with pytest.raises(ValueError, match=r"has 1 entries but the variable has shape \(16, 32\).*Fix LayoutMap rule 'up'"):
        decide_layout("m/up/kernel", (16, 32), "float32", MESH_2X4, rule=("up", ("model",)))


def test_floating_point_is_every_float_width():
    assert all(map(is_floating_point, ["float16", "bfloat16", "float32", "float64", tf.bfloat16, np.float16]))
    assert not any(map(is_floating_point, ["int8", "int32", "int64", "uint8", "bool", tf.string]))


# The strategy under layout_map="auto" and fully_shard=True -----------------

ROWS, BATCH = 37, 8  # the last batch (5 rows) does not divide the batch axis (2)


def build_classifier():
    """Token ids -> embedding -> a Dense pair -> pooled logits: auto splits
    the table, pairs `up`/`down`, and leaves `head` (8 wide) to its
    storage split."""
    return keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(64, 16, name="embed"),
            keras.layers.Dense(32, activation="relu", name="up"),
            keras.layers.Dense(16, name="down"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(8, name="head"),
        ],
        name="classifier",
    )


def classifier_data():
    rng = np.random.default_rng(5)
    return rng.integers(0, 64, size=(ROWS, 6)).astype("int32"), rng.integers(0, 8, size=(ROWS,)).astype("int32")


@pytest.fixture(scope="module")
def classifier_weights():
    return initial_weights(build_classifier)


def fit_classifier(weights, policy, strategy=None, rows=ROWS, reverse_rows=False):
    """The classifier trained one epoch of Adam under `policy` (each batch's
    rows reversed if `reverse_rows`): its batch losses, its weights in
    float64, and the model."""
    keras.config.set_dtype_policy(policy)
    try:
        with (strategy or tf.distribute.get_strategy()).scope():
            model = build_classifier()
            model.set_weights(weights)
            model.compile(
                optimizer=keras.optimizers.Adam(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
    finally:
        keras.config.set_dtype_policy("float32")
    x, y = (data[:rows] for data in classifier_data())
    if reverse_rows:
        order = rows_reversed_within_batches(rows, BATCH)
        x, y = x[order], y[order]
    losses, _ = train(model, x, y, batch_size=BATCH)
    return np.array(losses), [np.asarray(w, "float64") for w in model.get_weights()], model


def auto_fully_sharded():
    return tfmp.ModelParallelStrategy(mesh((2, 4)), layout_map="auto", fully_shard=True)


def stored_axes(model):
    """Each variable's storage axes, by path: the weights, then Adam's
    variables (without the optimizer's name, which counts optimizers)."""
    optimizer = model.optimizer.variables
    slots = {id(variable) for variable in optimizer}
    return {
        variable.path.split("/", 1)[1] if id(variable) in slots else variable.path: tuple(
            None if spec == "unsharded" else spec for spec in variable.value.layout.sharding_specs
        )
        for variable in [*model.weights, *optimizer]
    }


@pytest.fixture(scope="module")
def mixed_bfloat16_runs(classifier_weights):
    """float64 on one device (the exact answer), mixed_bfloat16 on one
    device (rows as given and reversed within each batch) and on the 2x4
    mesh under layout_map="auto", fully_shard=True."""
    return {
        "exact": fit_classifier(classifier_weights, "float64"),
        "one device": fit_classifier(classifier_weights, "mixed_bfloat16"),
        "one device, rows reversed": fit_classifier(classifier_weights, "mixed_bfloat16", reverse_rows=True),
        "mesh": fit_classifier(classifier_weights, "mixed_bfloat16", auto_fully_sharded()),
    }


def largest_difference(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b, strict=True))


def test_mixed_bfloat16_under_auto_fully_sharded_is_as_close_to_float64_as_one_device(mixed_bfloat16_runs):
    exact_losses, exact_weights, _ = mixed_bfloat16_runs["exact"]
    mesh_losses, mesh_weights, model = mixed_bfloat16_runs["mesh"]
    assert model.get_layer("up").compute_dtype == "bfloat16" and len(mesh_losses) == 5

    def to_float64(losses, weights):
        return np.max(np.abs(losses - exact_losses)), largest_difference(weights, exact_weights)

    one_device = [to_float64(*mixed_bfloat16_runs[run][:2]) for run in ("one device", "one device, rows reversed")]
    on_mesh = to_float64(mesh_losses, mesh_weights)
    print(f"to float64 (loss, weights): one device {one_device}, mesh {on_mesh}")
    assert min(weights for _, weights in one_device) > 1e-4  # bfloat16 rounding is what is measured
    yardstick = np.max(one_device, axis=0)
    assert on_mesh[0] <= 2 * yardstick[0] and on_mesh[1] <= 2 * yardstick[1]
    axes = stored_axes(model)
    assert axes["classifier/embed/embeddings"] == ("model", "batch")
    assert axes["classifier/up/kernel"] == ("batch", "model")
    assert axes["classifier/down/kernel"] == ("model", "batch")


def test_bfloat16_weights_are_fully_sharded_under_auto_as_float32_ones(classifier_weights, mixed_bfloat16_runs):
    """Keras' "bfloat16" policy makes bfloat16 variables; they and their
    Adam slots get the layouts the float32 variables of the mixed run got."""
    float32_model = mixed_bfloat16_runs["mesh"][2]
    *_, model = fit_classifier(classifier_weights, "bfloat16", auto_fully_sharded(), rows=BATCH)
    assert {v.dtype for v in model.weights} == {"bfloat16"}
    assert {v.dtype for v in float32_model.weights} == {"float32"}
    axes = stored_axes(model)
    assert axes == stored_axes(float32_model)
    # Every bfloat16 variable takes "batch" too, but vectors the plan split
    # over "model" already (a dimension takes one mesh axis).
    floating = [axes for path, axes in axes.items() if axes and path != "iteration"]
    assert len(floating) == 7 * 3 and all("batch" in a or None not in a for a in floating), axes
    assert axes["iteration"] == ()
    assert "('batch', 'model')" in tfmp.summary(model, print_fn=lambda _: None)


class OwnLayoutDense(keras.layers.Layer):
    """A layer written for Keras on JAX: its kernel has a layout of its own,
    `keras.Variable(..., layout=...)`."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = keras.Variable(
            keras.initializers.GlorotUniform(seed=3)((input_shape[-1], self.units)),
            name="kernel",
            layout=keras.distribution.TensorLayout(("model", None)),
        )

    def call(self, x):
        return keras.ops.matmul(x, self.kernel)


def build_own_layout_mlp():
    return keras.Sequential(
        [keras.Input((16,)), OwnLayoutDense(32, name="own"), keras.layers.Dense(8, name="down")],
        name="own_mlp",
    )


def test_auto_keeps_a_keras_variable_layout_and_trains_like_one_device():
    """`layout_map="auto"` plans a storage split for the kernel of a layer it
    does not know (gathered on use, on its largest dimension: 32), but the
    variable's own `layout=` wins: it stays where it was made, read as it is
    stored, and the model trains like one device."""
    weights = initial_weights(build_own_layout_mlp)
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(ROWS, 16)).astype("float32"), rng.normal(size=(ROWS, 8)).astype("float32")
    reference = build_own_layout_mlp()
    reference.set_weights(weights)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)), layout_map="auto")
    with strategy.scope():
        model = build_own_layout_mlp()
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    made = model.get_layer("own").kernel.value
    ref_losses, _ = train(reference, x, y, batch_size=BATCH)
    losses, _ = train(model, x, y, batch_size=BATCH)

    kernel = model.get_layer("own").kernel
    planned = strategy.extended.layout_map.match(kernel.path)
    assert planned is not None and tuple(planned[1]) == (None, "model"), planned  # what auto would do
    assert kernel.value is made  # not moved
    assert list(kernel.value.layout.sharding_specs) == ["model", "unsharded"]
    assert kernel.value.gathered_axes == ("batch",)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for want, got in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-5, atol=1e-5)


def test_auto_plans_nothing_for_the_weights_of_a_layer_that_declares_its_own():
    """A tfmp layer's declaration is its layout: the plan gives its kernel no
    storage split (which would win over the declaration under
    layout_map="auto", and contradict it as a LayoutMap), and splits the
    plain Dense after it for storage as it does any unpaired weight."""
    model = keras.Sequential(
        [keras.Input((16,)), tfmp.layers.RowParallelDense(64, name="row"), keras.layers.Dense(8, name="out")],
        name="declaring",
    )
    plan = tfmp.auto_layout(model, mesh((2, 4)))
    assert plan.match("declaring/row/kernel") is None
    assert plan.reasons["declaring/row/kernel"] == "a tfmp layer: declares its own layouts"
    assert plan.match("declaring/out/kernel")[1] == gather_on_use(("model", None))
