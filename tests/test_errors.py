"""Bad input gets an error (or warning) that names the value and the fix."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from helpers import assert_parity, build_mlp, build_on, initial_weights, mesh, mlp_data, mlp_layout_map


def test_simulate_devices_after_start_says_how_to_fix():
    assert len(tfmp.simulate_devices(8)) == 8  # same split again: fine
    with pytest.raises(RuntimeError, match=r"simulate_devices\(4\).*after TensorFlow.*first"):
        tfmp.simulate_devices(4)
    with pytest.raises(ValueError, match="positive integer"):
        tfmp.simulate_devices(0)


def test_mesh_device_count_must_match_shape():
    with pytest.raises(ValueError, match=r"holds 8 devices but 2 were given"):
        tfmp.DeviceMesh((2, 4), ("batch", "model"), devices=["cpu:0", "cpu:1"])


def test_mesh_larger_than_machine():
    with pytest.raises(ValueError, match=r"needs 16 devices but only 8 exist.*simulate_devices\(16\)"):
        tfmp.DeviceMesh((4, 4), ("batch", "model"))


def test_mesh_axis_names_must_match_shape():
    with pytest.raises(ValueError, match="one name per axis"):
        tfmp.DeviceMesh((2, 4), ("batch",))


@pytest.mark.parametrize(
    "shape, axis_names, message",
    [
        ((2.5, 4), ("batch", "model"), r"size 2\.5 \(float\).*an int"),
        ((True, 8), ("batch", "model"), r"size True \(bool\)"),
        (("2", "4"), ("batch", "model"), r"size '2' \(str\)"),
        (8, ("batch",), r"got the number 8.*shape=\(8,\)"),
        ("24", ("batch", "model"), r"sequence of axis sizes such as \(2, 4\), got '24'"),
        ((8,), "bm", r"got the string 'bm' \(read as \('b', 'm'\)\).*axis_names=\('bm',\)"),
        ((8,), ("",), r"name '': every axis name must be a non-empty string"),
        ((2, 4), ("batch", 4), r"name 4: every axis name"),
    ],
)
def test_mesh_refuses_what_it_would_have_converted(shape, axis_names, message):
    with pytest.raises(TypeError, match=message):
        tfmp.DeviceMesh(shape, axis_names)


def test_mesh_refuses_repeated_axis_names_and_missing_devices():
    with pytest.raises(ValueError, match=r"repeat a name: give each axis its own name"):
        tfmp.DeviceMesh((2, 4), ("batch", "batch"))
    with pytest.raises(ValueError, match=r"'/device:CPU:99' does not exist on this machine.*simulate_devices"):
        tfmp.DeviceMesh((2,), ("batch",), ["cpu:0", "cpu:99"])


def test_layout_axis_not_in_mesh():
    layout_map = tfmp.LayoutMap(mesh((2, 4)))
    with pytest.raises(ValueError, match=r"'modle' is not an axis of the mesh.*\['batch', 'model'\]"):
        layout_map["dense/kernel"] = (None, "modle")


def test_layout_rank_differs_from_variable():
    device_mesh = mesh((2, 4))
    layout_map = tfmp.LayoutMap(device_mesh)
    layout_map["up/kernel"] = ("model",)
    strategy = tfmp.ModelParallelStrategy(device_mesh, layout_map)
    with pytest.raises(ValueError, match=r"variable 'mlp/up/kernel' has 1 entries but the variable has shape \(16, 32\) \(rank 2\).*'up/kernel'"):
        with strategy.scope():
            build_mlp()


def test_two_rules_matching_one_variable():
    device_mesh = mesh((2, 4))
    layout_map = tfmp.LayoutMap(device_mesh)
    layout_map["up/.*"] = (None, "model")
    layout_map["kernel"] = ("model", None)
    with pytest.raises(ValueError, match=r"matches several LayoutMap keys"):
        with tfmp.ModelParallelStrategy(device_mesh, layout_map).scope():
            build_mlp()


def test_indivisible_dimension_is_replicated_with_a_warning():
    device_mesh = mesh((1, 8))
    layout_map = tfmp.LayoutMap(device_mesh)
    layout_map["down/kernel"] = (None, "model")  # 8 outputs / 8: fine
    layout_map["extra/kernel"] = (None, "model")  # 10 outputs / 8: not divisible
    strategy = tfmp.ModelParallelStrategy(device_mesh, layout_map)

    def build():
        return keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(10, name="extra"), keras.layers.Dense(8, name="down")],
            name="odd",
        )

    def compile_fn(model):
        model.compile(optimizer="adam", loss="mse")
        return model

    with pytest.warns(UserWarning, match=r"kept whole: odd/extra/kernel dimension 1 of size 10 .*replicated") as caught:
        model = assert_parity(
            build, None, *mlp_data(32), strategy=strategy, compile_fn=compile_fn,
            steps=2, loss_atol=0, batch_size=16,
        )
    assert sum("odd/extra/kernel" in str(w.message) for w in caught) == 1
    assert model.get_layer("extra").kernel.value.layout.is_fully_replicated()


def test_batch_axis_must_exist():
    with pytest.raises(ValueError, match=r"batch_axis 'data' is not an axis of the mesh"):
        tfmp.ModelParallelStrategy(mesh((2, 4)), batch_axis="data")
    model_only = tfmp.ModelParallelStrategy(tfmp.DeviceMesh((8,), ("model",)))
    assert model_only.batch_axis is None


def test_default_batch_axis_refuses_a_mesh_axis_that_would_compute_copies():
    data_model = tfmp.DeviceMesh((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match=r"batch_axis='data' to split batches over it"):
        tfmp.ModelParallelStrategy(data_model)
    assert tfmp.ModelParallelStrategy(data_model, batch_axis="data").batch_axis == "data"
    assert tfmp.ModelParallelStrategy(data_model, batch_axis=None).batch_axis is None
    unit_axis = tfmp.DeviceMesh((1, 8), ("data", "model"))
    assert tfmp.ModelParallelStrategy(unit_axis).batch_axis is None


def test_unmatched_layout_rules_warn_once_at_first_step():
    device_mesh = mesh((2, 4))
    layout_map = mlp_layout_map(device_mesh)
    layout_map["renamed_layer/kernel"] = (None, "model")
    strategy = tfmp.ModelParallelStrategy(device_mesh, layout_map)
    model = build_on(strategy, "mlp", initial_weights(build_mlp))
    x, y = mlp_data(32)
    with pytest.warns(UserWarning, match=r"\['renamed_layer/kernel'\] matched no variable") as caught:
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert sum("matched no variable" in str(w.message) for w in caught) == 1


def test_layout_values_must_be_axis_tuples():
    layout_map = tfmp.LayoutMap(mesh((2, 4)))
    with pytest.raises(TypeError, match=r"such as \(None, 'model'\)"):
        layout_map["dense/kernel"] = "model"


# DTensor's internal errors become ValueErrors naming the layer and a fix -----


class RawDeterminant(keras.layers.Layer):
    """Calls TensorFlow directly: `tf.linalg.det` (`MatrixDeterminant`) has no
    DTensor layout rule, and tfmp does not enroll it (`tfmp._env.REPLICATED_OPS`)."""

    def call(self, x):
        return x * tf.linalg.det(x[:, :4])[:, None, None]


class RawConv(keras.layers.Layer):
    """A convolution through `tf.nn.conv2d`, which tfmp does not rewrite."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(3, 3, input_shape[-1], 8), name="kernel")

    def call(self, x):
        return tf.nn.conv2d(x, self.kernel, 1, "SAME")


def test_op_without_a_dtensor_rule_names_the_layer_and_a_fix():
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)))
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((6, 4)), keras.layers.Dense(4, name="d"), RawDeterminant(name="raw_determinant")]
        )
        model.compile(optimizer="adam", loss="mse")
    x = np.zeros((8, 6, 4), "float32")
    with pytest.raises(ValueError, match=r"op 'MatrixDeterminant' in layer '\S*raw_determinant'.*\n.*keras\.ops"):
        model.fit(x, x, batch_size=4, verbose=0)


def test_split_weight_an_op_refuses_names_the_variable_and_its_layout():
    device_mesh = mesh((2, 4))
    layout_map = tfmp.LayoutMap(device_mesh)
    layout_map["raw_conv/kernel"] = (None, None, None, "model")
    with tfmp.ModelParallelStrategy(device_mesh, layout_map).scope():
        model = keras.Sequential([keras.Input((6, 6, 4)), RawConv(name="raw_conv")])
        model.compile(optimizer="adam", loss="mse")
    x, y = np.zeros((8, 6, 6, 4), "float32"), np.zeros((8, 6, 6, 8), "float32")
    with pytest.raises(
        ValueError,
        match=r"op 'Conv2D' in layer '\S*raw_conv'(.|\n)*raw_conv/kernel: \(None, None, None, 'model'\)(.|\n)*LayoutMap rules",
    ):
        model.predict(x, batch_size=4, verbose=0)


class SimilarityBothWays(keras.layers.Layer):
    """CLIP's head in small: text-image similarities and their transpose,
    through TensorFlow directly (tfmp rewrites keras.ops.transpose)."""

    def call(self, image, text):
        per_text = keras.ops.matmul(text, tf.transpose(image))
        return tf.transpose(per_text)


def test_transpose_that_dtensor_refuses_says_what_to_do_instead():
    """The (batch, batch) logits' rows are split over the batch, and so are
    the transposed ones: no rule of a variable decides that, and the fix
    says so."""

    def build():
        image, text = keras.Input((6,), name="image"), keras.Input((6,), name="text")
        logits = SimilarityBothWays(name="similarity")(
            keras.layers.Dense(8, name="image_proj")(image), keras.layers.Dense(8, name="text_proj")(text)
        )
        return keras.Model({"image": image, "text": text}, keras.ops.logsumexp(logits, axis=-1, keepdims=True))

    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)), layout_map="auto")
    with strategy.scope():
        model = build()
        model.compile(optimizer="adam", loss="mse")
    x = {name: np.zeros((8, 6), "float32") for name in ("image", "text")}
    with pytest.raises(
        ValueError, match=r"op 'Transpose' in layer '\S*similarity'(.|\n)*keras\.ops\.transpose, which tfmp runs as an einsum"
    ):
        model.fit(x, np.zeros((8, 1), "float32"), batch_size=8, verbose=0)


class DataDependentLoop(keras.layers.Layer):
    """Halves its input until the largest entry is below 1: a while loop
    whose trip count only the step knows."""

    def call(self, x):
        return keras.ops.while_loop(lambda v: keras.ops.max(v) > 1.0, lambda v: v * 0.5, x)


def test_while_loop_in_a_training_step_says_how_to_unroll_it():
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="d"), DataDependentLoop()])
        model.compile(optimizer="adam", loss="mse")
    x = np.ones((8, 4), "float32")
    with pytest.raises(ValueError, match=r"TensorList(.|\n)*fori_loop with Python bounds"):
        model.fit(x, x, batch_size=8, verbose=0)


def test_layout_map_key_that_is_no_regex_is_named_where_it_is_set():
    layout_map = tfmp.LayoutMap(mesh((2, 4)))
    with pytest.raises(ValueError, match=r"key 'up\[kernel' is not a valid regular expression.*re\.escape"):
        layout_map["up[kernel"] = (None, "model")


def test_fully_shard_must_be_a_bool():
    with pytest.raises(TypeError, match=r"fully_shard must be True or False, got 'no' \(str\)"):
        tfmp.ModelParallelStrategy(mesh((2, 4)), fully_shard="no")


def test_layout_map_of_another_mesh_is_refused():
    written_for = tfmp.LayoutMap(mesh((2, 4)))
    written_for["up/kernel"] = (None, "model")
    with pytest.raises(ValueError, match=r"LayoutMap was built on DeviceMesh\(batch=2, model=4.*strategy's\s+mesh is DeviceMesh\(batch=4, model=2"):
        tfmp.ModelParallelStrategy(mesh((4, 2)), written_for)
    keras_map = keras.distribution.LayoutMap(
        keras.distribution.DeviceMesh((2, 4), ("batch", "model"), [f"cpu:{i}" for i in range(8)])
    )
    with pytest.raises(ValueError, match=r"keras.distribution.LayoutMap was built on a mesh of shape \(2, 4\)"):
        tfmp.ModelParallelStrategy(mesh((1, 8)), keras_map)


def test_a_model_built_outside_the_scope_is_named_at_compile_and_fit():
    """A newcomer's first mistake: the model made before `strategy.scope()`.
    Keras would stop only inside fit's step, naming the call."""
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)), layout_map="auto")
    outside = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)], name="made_outside")
    with strategy.scope():
        with pytest.raises(ValueError, match=r"'made_outside' was built outside strategy\.scope\(\), and `compile`.*Build the model inside the scope"):
            outside.compile("sgd", "mse")
    outside.compile("sgd", "mse")
    x, y = np.zeros((8, 8), "float32"), np.zeros((8, 4), "float32")
    with strategy.scope():
        for call in (lambda: outside.fit(x, y, verbose=0), lambda: outside.train_on_batch(x, y)):
            with pytest.raises(ValueError, match=r"'made_outside' was built outside strategy\.scope\(\)"):
                call()
    other = tfmp.ModelParallelStrategy(mesh((8,), ("batch",)))
    with other.scope():
        elsewhere = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)], name="made_elsewhere")
    with strategy.scope():
        with pytest.raises(ValueError, match=r"'made_elsewhere' was built under another strategy"):
            elsewhere.compile("sgd", "mse")
    assert outside.fit(x, y, verbose=0).history["loss"]  # outside every scope: plain Keras, as before


def test_a_long_error_message_is_parsed_as_tensorflow_parses_it_without_waiting():
    """TensorFlow parses the message of every error a function raises before
    anyone sees the error, in time quadratic in its length: a DTensor
    expansion error of 421,000 characters held fit silent for over 15
    minutes (TensorFlow's own parse of 2,000,000 would take hours). With a
    strategy, the parse gives TensorFlow's results in one pass: the 900 s
    test timeout bounds it."""
    import importlib.util

    from tensorflow.python.framework import error_interpolation

    spec = importlib.util.find_spec(error_interpolation.__name__)
    tensorflow_own = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tensorflow_own)
    tfmp.ModelParallelStrategy(mesh((2, 4)))  # its patches
    assert error_interpolation.parse_message is not tensorflow_own.parse_message
    messages = [
        "",
        "no tag at all {a = {b = 1}} {{ node}}",
        "123{{node Foo}}456{{function_node Bar}}789",
        "{{function_node __inference_step_42}}{{node model/dense/MatMul}} error: x\n{{node a.b-c/d}}",
        "{{node {{node Inner}}}} {{colocation_node x}}{{function_node f}}",
    ]
    for message in messages:
        assert error_interpolation.parse_message(message) == tensorflow_own.parse_message(message), message
    long = "module {\n" + '  %1 = "tf.Reshape"(%0) {a = {b = 1}} : tensor<?xi32>\n' * 40_000
    text, function_tags, node_tags = error_interpolation.parse_message(long + "{{node last}} end")
    assert text == long + "{{node last}} end" and not function_tags
    assert [tag.name for tag in node_tags] == ["last"]
