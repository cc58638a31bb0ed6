"""Every Keras convolution on a mesh: tfmp's tap-wise lowerings against
Keras' own, and the conv layers (depthwise and separable ones too, which run
Keras' own on gathered inputs) on the mesh against one device."""

import importlib
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from helpers import assert_parity, rules
from tfmp.lowering import conv as lowered

KERAS_NN = importlib.import_module("keras.src.backend.tensorflow.nn")
BATCH = 12  # 3 training steps of 4 rows; 4 divides by the batch axis (2)


def keras_own(name: str, module: str = "nn"):
    """Keras' TF backend function, also where a strategy has wrapped it."""
    function = getattr(importlib.import_module(f"keras.src.backend.tensorflow.{module}"), name)
    return getattr(function, "__wrapped_keras__", function)


def normal(*shape: int, seed: int = 0) -> tf.Tensor:
    return tf.constant(np.random.default_rng(seed).normal(size=shape) * 0.5, tf.float32)


def assert_same_values_and_gradients(name: str, arrays: list, **kwargs) -> None:
    """tfmp's `name` equals Keras' own, and so do the gradients of a random
    projection of the output in every input."""
    tensors = [normal(*shape, seed=i) for i, shape in enumerate(arrays)]
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(tensors)
        want = keras_own(name)(*tensors, **kwargs)
        got = getattr(lowered, name)(*tensors, **kwargs)
        projection = normal(*want.shape, seed=99)
        want_loss = tf.reduce_sum(want * projection)
        got_loss = tf.reduce_sum(got * projection)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for got_grad, want_grad in zip(tape.gradient(got_loss, tensors), tape.gradient(want_loss, tensors)):
        np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-5)


CONV_STRIDES = [
    dict(strides=1, padding="valid"),
    dict(strides=2, padding="valid"),
    dict(strides=1, padding="same"),
    dict(strides=2, padding="same"),
    dict(strides=1, padding="same", dilation_rate=2),
]


@pytest.mark.parametrize("kwargs", CONV_STRIDES, ids=str)
@pytest.mark.parametrize(
    "shapes",
    [[(2, 9, 3), (3, 3, 4)], [(2, 7, 8, 3), (3, 2, 3, 4)], [(2, 5, 6, 5, 2), (3, 2, 2, 2, 3)]],
    ids=["1d", "2d", "3d"],
)
def test_conv(shapes, kwargs):
    assert_same_values_and_gradients("conv", shapes, **kwargs)


@pytest.mark.parametrize(
    "shapes,kwargs",
    [
        ([(2, 7, 8, 6), (3, 3, 2, 9)], dict(strides=2, padding="same")),  # 3 groups
        ([(2, 9, 4), (3, 2, 4)], dict(padding="valid", dilation_rate=2)),  # 2 groups
        ([(2, 3, 7, 8), (3, 3, 3, 4)], dict(strides=2, padding="same", data_format="channels_first")),
        ([(2, 4, 9), (3, 2, 6)], dict(padding="same", data_format="channels_first")),  # grouped
    ],
    ids=["groups-2d", "groups-1d", "channels-first-2d", "channels-first-groups-1d"],
)
def test_grouped_and_channels_first_conv(shapes, kwargs):
    assert_same_values_and_gradients("conv", shapes, **kwargs)


TRANSPOSE = [
    dict(strides=1, padding="valid"),
    dict(strides=2, padding="valid"),
    dict(strides=2, padding="valid", output_padding=1),
    dict(strides=1, padding="same"),
    dict(strides=2, padding="same"),
    dict(strides=2, padding="same", output_padding=1),
    dict(strides=2, padding="same", output_padding=0),
]


@pytest.mark.parametrize("kwargs", TRANSPOSE, ids=str)
@pytest.mark.parametrize(
    "shapes",
    [[(2, 5, 3), (3, 4, 3)], [(2, 5, 6, 3), (3, 3, 4, 3)], [(2, 3, 4, 3, 2), (3, 3, 3, 3, 2)]],
    ids=["1d", "2d", "3d"],
)
def test_conv_transpose(shapes, kwargs):
    assert_same_values_and_gradients("conv_transpose", shapes, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(strides=3, padding="same", output_padding=(1, 2)),
        dict(strides=1, padding="same", dilation_rate=2),
        dict(strides=2, padding="same", data_format="channels_first"),
    ],
    ids=str,
)
def test_conv_transpose_2d_variants(kwargs):
    shapes = [(2, 3, 5, 6), (3, 3, 4, 3)] if "data_format" in kwargs else [(2, 5, 6, 3), (4, 5, 4, 3)]
    assert_same_values_and_gradients("conv_transpose", shapes, **kwargs)


@pytest.mark.parametrize(
    "x1,x2",
    [
        ((2, 5, 5, 4), (1, 1, 1, 4)),  # a conv bias, channels last
        ((2, 4, 5, 5), (1, 4, 1, 1)),  # channels first
        ((2, 4, 6), (1, 4, 1)),  # rank-3 channels first
        ((2, 4, 4), (1, 4, 1)),  # ambiguous: Keras adds it along the last axis
        ((2, 3), (3,)),  # a Dense bias
        ((2, 3, 4), (2, 1, 4)),  # no bias: broadcasting
    ],
    ids=str,
)
def test_add_matches_keras(x1, x2):
    want = keras_own("add", "numpy")(normal(*x1), normal(*x2, seed=1))
    np.testing.assert_array_equal(lowered.add(normal(*x1), normal(*x2, seed=1)), want)


def test_add_promotes_dtypes_as_keras():
    got = lowered.add(tf.constant([1, 2], tf.int32), 0.5)
    assert got.dtype == keras_own("add", "numpy")(tf.constant([1, 2], tf.int32), 0.5).dtype
    np.testing.assert_array_equal(got, [1.5, 2.5])


def test_unknown_batch_size():
    x, kernel = normal(3, 6, 5, 2), normal(3, 3, 2, 4, seed=1)

    @tf.function(input_signature=[tf.TensorSpec((None, 6, 5, 2))])
    def value_and_gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = lowered.conv_transpose(lowered.conv(x, kernel, strides=2, padding="same"), kernel, strides=2)
            loss = tf.reduce_sum(y**2)
        return y, tape.gradient(loss, x)

    with tf.GradientTape() as tape:
        tape.watch(x)
        y = keras_own("conv")(x, kernel, strides=2, padding="same")
        y = keras_own("conv_transpose")(y, kernel, strides=2)
        loss = tf.reduce_sum(y**2)
    got_y, got_dx = value_and_gradient(x)
    np.testing.assert_allclose(got_y, y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_dx, tape.gradient(loss, x), rtol=1e-5, atol=1e-5)


def test_errors_name_the_argument_and_the_fix():
    x, kernel = tf.zeros((2, 6, 6, 3)), tf.zeros((3, 3, 3, 4))
    with pytest.raises(ValueError, match=r"padding=\(\(1, 1\), \(1, 1\)\).*ZeroPadding"):
        lowered.conv(x, kernel, padding=((1, 1), (1, 1)))
    with pytest.raises(ValueError, match=r"smaller than the kernel's span 7.*padding='same'"):
        lowered.conv(x, kernel, dilation_rate=3)
    with pytest.raises(ValueError, match=r"output_padding=2.*smaller than the stride"):
        lowered.conv_transpose(x, tf.zeros((3, 3, 4, 3)), strides=2, output_padding=2)

    @tf.function(input_signature=[tf.TensorSpec((None, None, 6, 3))])
    def unknown_height(x):
        return lowered.conv(x, tf.zeros((3, 3, 3, 1)))

    with pytest.raises(ValueError, match=r"conv on a mesh needs a static spatial.*keras.Input\("):
        unknown_height.get_concrete_function()


def test_lowerings_take_keras_arguments():
    names = {lowering.attribute for lowering in lowered.LOWERINGS}
    assert names == {"add", "conv", "conv_transpose"}
    for lowering in lowered.LOWERINGS:
        module, replacement = lowering.owner(), lowering.wrapper
        keras_function = getattr(module, lowering.attribute)
        keras_signature = inspect.signature(getattr(keras_function, "__wrapped_keras__", keras_function))
        assert inspect.signature(replacement).parameters.keys() == keras_signature.parameters.keys()
        for name, parameter in keras_signature.parameters.items():
            assert inspect.signature(replacement).parameters[name].default == parameter.default


def test_conv_lstm_convolves_through_the_backend_conv(monkeypatch):
    calls = []
    keras_conv = keras_own("conv")

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return keras_conv(*args, **kwargs)

    monkeypatch.setattr(KERAS_NN, "conv", counting)
    layer = keras.layers.ConvLSTM1D(2, 3, padding="same")
    layer(np.zeros((1, 2, 5, 3), "float32"))
    # Per step, 4 gates of the input and 4 of the state.
    assert len(calls) >= 8 and {tuple(shape) for shape in calls} == {(3, 3, 2), (3, 2, 2)}


# --- Parity with one device on a mesh ---------------------------------------

FILTERS = (None, None, None, "model")  # a 2-D kernel's last dimension
CHANNELS = (None, None, "model", None)


def data(shape: tuple, outputs: int = 3, samples: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return (
        rng.normal(size=(samples,) + shape).astype("float32"),
        rng.normal(size=(samples, outputs)).astype("float32"),
    )


def build_2d() -> keras.Model:
    layers = keras.layers
    # Small kernels: compiling the step on the mesh costs about a second per tap.
    return keras.Sequential(
        [
            keras.Input((6, 6, 4)),
            layers.Conv2D(8, (3, 2), padding="same", activation="relu", name="filters"),
            layers.Conv2D(8, 2, strides=2, padding="same", name="channels"),
            layers.Conv2D(8, 2, padding="same", groups=4, name="grouped"),
            layers.DepthwiseConv2D(2, padding="same", depth_multiplier=2, name="depthwise"),
            layers.SeparableConv2D(8, 2, name="separable"),
            layers.Conv2DTranspose(4, 2, strides=2, padding="same", output_padding=1, name="transpose"),
            layers.GlobalAveragePooling2D(),
            layers.Dense(3, name="out"),
        ]
    )


SPLIT_2D = {
    "filters/kernel": FILTERS,
    "filters/bias": ("model",),
    "channels/kernel": CHANNELS,
    "grouped/kernel": FILTERS,  # whole groups on each device
    "grouped/bias": ("model",),
    "depthwise/kernel": CHANNELS,  # (taps, taps, channels, multiplier)
    "depthwise/bias": ("model",),
    "separable/depthwise_kernel": CHANNELS,
    "separable/pointwise_kernel": CHANNELS,
    "transpose/kernel": FILTERS,  # (taps, taps, filters, channels): split channels
}


def test_conv2d_family_split_by_taps(monkeypatch):
    """Every split kernel tap-wise (as a kernel too large to gather runs)."""
    monkeypatch.setattr(lowered, "GATHERED_WORK_PER_MOVED_ELEMENT", -1)
    model = assert_parity(build_2d, rules(SPLIT_2D), *data((6, 6, 4)))
    report = tfmp.comm_report(model, print_fn=lambda _: None)
    on_model = [c for c in report.collectives if c.axes == ("model",) and c.category != "replicated-ops"]
    # One all-reduce of the output per tap-wise layer that contracts split
    # channels (channels, transpose), not one per tap, and no gather; the
    # backward pass at most one collective per split layer. The depthwise and
    # separable layers gather their split inputs, as "replicated-ops".
    assert [c.kind for c in on_model if c.phase == "forward"] == ["all-reduce"] * 2
    assert len([c for c in on_model if c.phase == "backward"]) <= 4
    gathered = [c.op for c in report.collectives if c.category == "replicated-ops"]
    assert {layer for layer in ("depthwise", "separable", "transpose") if any(layer in op for op in gathered)} == {
        "depthwise",
        "separable",
    }, gathered


def test_conv2d_family_split_with_small_kernels_gathered():
    """The split kernels of `build_2d` are small: the filter and channel
    splits and the transposed convolution run as Keras' own op on the kernel
    gathered whole. Forward, each gathers its kernel, and the channel split
    its input (which the filter split leaves split over its filters): no
    all-reduce of partial sums. 13 rows at batch 4 end with a batch of one,
    which divides by no batch axis."""
    x, y = data((6, 6, 4), samples=13)
    model = assert_parity(build_2d, rules(SPLIT_2D), x, y, steps=4, batch_size=4)
    report = tfmp.comm_report(model, print_fn=lambda _: None)
    forward = [
        (c.kind, c.category, c.op.split("/")[1])
        for c in report.collectives
        if c.axes == ("model",) and c.phase == "forward" and c.category != "replicated-ops"
    ]
    assert sorted(forward) == [
        ("all-gather", "activations", "filters_1"),
        ("all-gather", "weight-gathers", "channels_1"),
        ("all-gather", "weight-gathers", "filters_1"),
        ("all-gather", "weight-gathers", "transpose_1"),
    ], forward


def build_native_candidates() -> keras.Model:
    """Convolutions of every rank, with strides, "same" padding and a
    dilation, and a transposed one, whose kernels a rule may leave whole or
    split
    (`CANDIDATES_SPLIT`), among them one too large to gather ("wide": a
    filter split over 4 duplicates 96 multiply-adds per element the taps
    move)."""
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((6, 6, 4)),
            layers.Conv2D(8, 3, padding="same", activation="relu", name="whole"),
            layers.Conv2D(8, 2, strides=2, name="strided"),
            layers.Conv2D(8, 2, padding="same", dilation_rate=2, name="dilated"),
            layers.Conv2D(160, 1, name="widen"),
            layers.Conv2D(160, 1, name="wide"),
            layers.Conv2D(4, 2, padding="same", name="filters"),
            layers.Reshape((3, 3, 4, 1)),
            layers.Conv3D(2, 2, padding="same", name="volume"),
            layers.Reshape((9, 8)),
            layers.Conv1D(4, 3, strides=2, name="sequence"),
            layers.Conv1DTranspose(4, 3, strides=2, name="transpose"),
            layers.Flatten(),
            layers.Dense(3, name="out"),
        ]
    )


CANDIDATE_KERNELS = {
    (3, 4, 4),
    (3, 3, 4, 8),
    (2, 2, 8, 8),
    (1, 1, 8, 160),
    (1, 1, 160, 160),
    (2, 2, 160, 4),
    (2, 2, 2, 1, 2),
    (3, 8, 4),
}
CANDIDATES_SPLIT = (
    {f"{name}/kernel": FILTERS for name in ("widen", "wide", "filters")}
    | {f"{name}/bias": ("model",) for name in ("widen", "wide", "filters")}
    | {"transpose/kernel": (None, None, "model")}  # (taps, filters, channels): split channels
)


@pytest.mark.parametrize(
    "shape, layout_map_fn, natively",
    [
        ((2, 4), rules(CANDIDATES_SPLIT), CANDIDATE_KERNELS - {(1, 1, 160, 160)}),
        ((2, 4), rules({"wide/kernel": CHANNELS, "out/kernel": ("model", None)}), CANDIDATE_KERNELS),
        ((2, 4), rules({"out/kernel": ("model", None)}), CANDIDATE_KERNELS),
        ((8, 1), None, CANDIDATE_KERNELS),
        ((8, 1), rules(CANDIDATES_SPLIT), CANDIDATE_KERNELS),
    ],
    ids=["2x4-filters-split", "2x4-channels-split", "2x4-kernels-whole", "8x1-auto", "8x1-split-over-an-axis-of-size-1"],
)
def test_convolutions_run_natively_where_cheap_and_match_one_device(shape, layout_map_fn, natively, monkeypatch):
    """DTensor's own Conv ops take a batch split: a convolution or a
    transposed one whose kernel is whole, or split and cheap to gather, runs
    as Keras' own op on the mesh (one op, one device's sums), not as a sum
    of per-tap products; the
    filter split of "wide" runs tap-wise, its channel split (whose sum over
    its one tap would all-reduce every output) natively; a split over an
    axis of size 1 is stored whole. 13 rows at batch 4 end with a batch of
    one, which divides by no batch axis."""
    kernels = []
    native_conv = lowered._native_conv

    def counted(convolve, x, kernel, *args):
        kernels.append(tuple(kernel.shape))
        return native_conv(convolve, x, kernel, *args)

    monkeypatch.setattr(lowered, "_native_conv", counted)
    x, y = data((6, 6, 4), samples=13)
    # Noise yardstick: Adam turns the float order of the mesh's sums into
    # steps of up to 1.4e-5 on a few of wide's 25600 weights.
    assert_parity(
        build_native_candidates, layout_map_fn, x, y, mesh_shape=shape, steps=4, batch_size=4, noise_yardstick=True
    )
    assert set(kernels) == natively


def build_max_pools() -> keras.Model:
    """Max poolings of every rank, channels last and first, same and valid
    padding, strided and not, between convs whose filters and input
    channels may be split."""
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((6, 6, 4)),
            layers.Conv2D(8, 3, padding="same", activation="relu", name="filters"),
            layers.MaxPooling2D(2),
            layers.Conv2D(8, 1, name="channels"),
            layers.MaxPooling2D(2, strides=1, padding="same", data_format="channels_first"),
            layers.Reshape((3, 3, 8, 1)),
            layers.MaxPooling3D(2, padding="same"),
            layers.Reshape((16, 1)),
            layers.MaxPooling1D(3, strides=2, padding="same"),
            layers.Flatten(),
            layers.Dense(3, name="out"),
        ]
    )


@pytest.mark.parametrize(
    "shape, batch_size, layout_map_fn",
    [
        ((8, 1), 8, None),
        ((1, 1), 4, None),
        ((2, 4), 4, rules({"filters/kernel": FILTERS, "filters/bias": ("model",), "channels/kernel": CHANNELS})),
    ],
    ids=["8x1", "1x1", "2x4-filters-then-channels-split"],
)
def test_max_pooling_runs_natively_on_the_batch_split(shape, batch_size, layout_map_fn, monkeypatch):
    """A 1-D or 2-D max pooling runs Keras' own MaxPool on its input pinned
    to the batch split, its channels gathered where a conv split them
    (2x4: filters split before the first pooling, input channels after
    it); a 3-D pooling runs over the window's taps (its ties, repeated by
    the stride-1 pooling before it, `MaxPool3DGrad` breaks otherwise on the
    mesh). 13 rows end with a batch that divides by no batch axis of more
    than one device (5 at batch 8, 1 at batch 4), run whole on every
    device."""
    from tfmp.lowering import pooling

    native_inputs = []
    native_max_pool = pooling._native_max_pool

    def counted(x, *args):
        native_inputs.append(tuple(x.shape[1:]))
        return native_max_pool(x, *args)

    monkeypatch.setattr(pooling, "_native_max_pool", counted)
    x, y = data((6, 6, 4), samples=13)
    steps = -(-13 // batch_size)
    assert_parity(build_max_pools, layout_map_fn, x, y, mesh_shape=shape, steps=steps, batch_size=batch_size)
    # The 2-D poolings and the 1-D one, each traced for whole batches and the last one.
    assert set(native_inputs) == {(6, 6, 8), (3, 3, 8), (16, 1)}


def build_1d() -> keras.Model:
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((8, 4)),
            layers.Conv1D(8, 3, padding="same", activation="relu", name="filters"),
            layers.Conv1D(8, 3, strides=2, name="channels"),
            layers.DepthwiseConv1D(3, padding="same", name="depthwise"),
            layers.SeparableConv1D(8, 3, padding="same", depth_multiplier=2, name="separable"),
            layers.Conv1DTranspose(8, 3, strides=2, name="transpose"),
            layers.Conv1D(16, 2, padding="same", data_format="channels_first", name="first"),
            layers.GlobalAveragePooling1D(),
            layers.Dense(3, name="out"),
        ]
    )


SPLIT_1D = {
    "filters/kernel": (None, None, "model"),
    "filters/bias": ("model",),
    "channels/kernel": (None, "model", None),
    "separable/pointwise_kernel": (None, None, "model"),
    "separable/bias": ("model",),
    "transpose/kernel": (None, "model", None),  # split filters
    "transpose/bias": ("model",),
    "first/kernel": (None, None, "model"),
    "first/bias": ("model",),
}


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)], ids=["2x4", "1x8"])
def test_conv1d_family_split_and_depthwise_replicated(shape):
    assert_parity(build_1d, rules(SPLIT_1D), *data((8, 4)), mesh_shape=shape)


def build_3d() -> keras.Model:
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((4, 5, 4, 2)),
            layers.Conv3D(8, 2, padding="same", name="filters"),
            layers.Conv3D(8, (2, 1, 2), strides=2, padding="same", name="channels"),
            layers.Conv3DTranspose(4, 2, strides=2, name="transpose"),
            layers.GlobalAveragePooling3D(),
            layers.Dense(3, name="out"),
        ]
    )


SPLIT_3D = {
    "filters/kernel": (None, None, None, None, "model"),
    "filters/bias": ("model",),
    "channels/kernel": (None, None, None, "model", None),
    "transpose/kernel": (None, None, None, None, "model"),
}


def test_conv3d_family_split():
    assert_parity(build_3d, rules(SPLIT_3D), *data((4, 5, 4, 2)))


def build_depthwise() -> keras.Model:
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((9, 9, 4)),
            layers.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2, name="strided"),
            layers.DepthwiseConv2D(2, dilation_rate=2, padding="same", name="dilated"),
            layers.SeparableConv2D(8, 2, strides=2, padding="same", name="separable"),
            layers.Permute((3, 1, 2)),
            layers.DepthwiseConv2D(2, padding="same", data_format="channels_first", name="first"),
            layers.GlobalAveragePooling2D(data_format="channels_first"),
            layers.Dense(3, name="out"),
        ]
    )


SPLIT_DEPTHWISE = {
    "strided/kernel": CHANNELS,
    "strided/bias": ("model",),
    "dilated/kernel": CHANNELS,
    "separable/depthwise_kernel": CHANNELS,
    "separable/pointwise_kernel": CHANNELS,
}


@pytest.mark.parametrize("shape", [(2, 4), (8, 1)], ids=["2x4", "8x1"])
def test_depthwise_and_separable_layers_match_one_device(shape):
    """Strides, dilation (SpaceToBatchND), a depth multiplier and
    channels-first, on inputs gathered whole; 37 rows at batch 8 end in a
    batch that does not divide the batch axis."""
    x, y = data((9, 9, 4), samples=37)
    assert_parity(build_depthwise, rules(SPLIT_DEPTHWISE), x, y, mesh_shape=shape, steps=5, batch_size=8)
