"""Random draws that equal one device's for the whole tensor, however it is split.

DTensor expands a stateless random op per device, with the shard's local
shape and a seed mixed with the device's position, so a draw laid out like a
split activation (Dropout's mask after a column-parallel Dense, GaussianNoise,
a batch of augmentation factors) holds other numbers on each device than one
device draws for the whole tensor. On a mesh, the Keras TensorFlow random
functions below draw the whole tensor, with Keras' own seeds and ops,
replicated on every device, and DTensor slices the draw to its consumer's
layout locally. The draws are bitwise one device's, so a model with random
layers trains as closely to one device as one without them.

In a pipeline a layer runs once per micro-batch. There each draw takes the
seed one device takes for the whole step (a `SeedGenerator` advances once
per step: the first micro-batch to draw advances it, the others reuse that
seed), draws the whole batch's shape (the batch dimension times the number of
micro-batches) and keeps the micro-batch's rows. Keras puts the batch first:
a draw whose first dimension is the micro-batch's size has one row per
sample; any other (a noise shape of 1, a scalar) is one draw for the whole
batch, and is drawn as it is. A shared draw whose first dimension happens to
equal the micro-batch's size would be misread; where tfmp cannot tell at all
(micro-batches of 1 sample, a first dimension unknown while tracing) it
raises an error naming the layer.

Cost: each device draws the whole tensor rather than its shard, so a dropout
mask costs every device the random numbers (and transient memory) of the
whole activation it masks: the mesh size times the work of a split draw (and
in a pipeline, each micro-batch draws the whole batch's: m times more). The
draws add no communication; a tensor parameter of a draw (a broadcast
`minval`, say) is gathered first.

`keras.random.shuffle` needs no lowering: its sort keys form one dimension,
which the sort keeps whole. DTensor has no layout rule for the ops of
`categorical`, `gamma`, `binomial` and `beta` (AugMix, MixUp and CutMix draw
with the last three) and runs them replicated (`tfmp._env.REPLICATED_OPS`);
tfmp gives them the step's seed and whole parameters, as the others. A
pipeline micro-batch holds only its rows of `categorical`'s logits: there
it raises an error.
"""

from __future__ import annotations

import collections
import functools
import random
import weakref
from typing import Any, Callable

import tensorflow as tf
from keras.src.backend.common.name_scope import current_path
from keras.src.backend.tensorflow import random as keras_random
from keras.src.random.seed_generator import SeedGenerator, global_seed_generator
from tensorflow.experimental import dtensor
from tensorflow.python.framework import tensor_util
from tensorflow.python.ops import gen_stateless_random_ops_v2 as stateless_v2

from tfmp.forward import MicrobatchedStep, forward_mesh, microbatched_step
from tfmp.integrations import Patch
from tfmp.layout import replicated
from tfmp.lowering.registry import Lowering, keras_original


def _replicated(value: Any, mesh: dtensor.Mesh | None = None) -> Any:
    """`value` whole on every device of `mesh` (by default the forward
    pass'); Python numbers are left alone (they are whole already)."""
    if not isinstance(value, tf.Tensor):
        return value
    return replicated(value, mesh or forward_mesh())


def _keras(name: str) -> Callable:
    """Keras' own function `name`, past tfmp's wrapper around it."""
    return keras_original(_MODULE, name)


def normal(
    shape: Any, mean: Any = 0.0, stddev: Any = 1.0, dtype: Any = None, seed: Any = None
) -> tf.Tensor:
    """Keras' `random.normal`, drawn whole on every device."""
    return _draw("normal", shape, (mean, stddev), dtype, seed)


def uniform(
    shape: Any, minval: Any = 0.0, maxval: Any = 1.0, dtype: Any = None, seed: Any = None
) -> tf.Tensor:
    """Keras' `random.uniform`, drawn whole on every device."""
    return _draw("uniform", shape, (minval, maxval), dtype, seed)


def truncated_normal(
    shape: Any, mean: Any = 0.0, stddev: Any = 1.0, dtype: Any = None, seed: Any = None
) -> tf.Tensor:
    """Keras' `random.truncated_normal`, drawn whole on every device."""
    return _draw("truncated_normal", shape, (mean, stddev), dtype, seed)


def randint(
    shape: Any, minval: Any, maxval: Any, dtype: Any = "int32", seed: Any = None
) -> tf.Tensor:
    """Keras' `random.randint`, drawn whole on every device."""
    return _draw("randint", shape, (minval, maxval), dtype, seed)


def dropout(inputs: Any, rate: float, noise_shape: Any = None, seed: Any = None) -> tf.Tensor:
    """Keras' `random.dropout`: the keep mask is drawn whole on every device,
    and each device keeps its shard of `inputs` by its slice of the mask."""
    if rate in (0.0, 1.0):
        return _keras("dropout")(inputs, rate, noise_shape, seed)
    # Keras' own steps, in its order: the seed is drawn before the shape.
    seed = keras_random._cast_seed(keras_random.draw_seed(_seed_of_step(seed)))  # noqa: SLF001
    noise_shape = keras_random._get_concrete_noise_shape(inputs, noise_shape)  # noqa: SLF001

    def sampler(shape: Any, dtype: tf.DType) -> tf.Tensor:
        # The sampler of `tf.nn.experimental.stateless_dropout`, which Keras calls.
        return _for_microbatch(
            lambda whole: _replicated(tf.random.stateless_uniform(whole, seed=seed, dtype=dtype)),
            shape,
        )

    return tf.nn.experimental.general_dropout(
        inputs, rate=rate, uniform_sampler=sampler, noise_shape=noise_shape
    )


def gamma(shape: Any, alpha: Any, dtype: Any = None, seed: Any = None) -> tf.Tensor:
    """Keras' `random.gamma`, drawn whole on every device."""
    return _draw("gamma", shape, (alpha,), dtype, seed)


def binomial(
    shape: Any, counts: Any, probabilities: Any, dtype: Any = None, seed: Any = None
) -> tf.Tensor:
    """Keras' `random.binomial`, drawn whole on every device."""
    return _draw("binomial", shape, (counts, probabilities), dtype, seed)


def beta(shape: Any, alpha: Any, beta: Any, dtype: Any = None, seed: Any = None) -> tf.Tensor:
    """Keras' `random.beta` (a ratio of gamma draws), drawn whole on every device."""
    return _draw("beta", shape, (alpha, beta), dtype, seed)


def categorical(logits: Any, num_samples: Any, dtype: Any = "int64", seed: Any = None) -> tf.Tensor:
    """Keras' `random.categorical`, drawn whole on every device from the
    whole logits. A pipeline micro-batch holds only its rows of the logits,
    from which one device's draw for the whole batch cannot be made: an
    error there."""
    if microbatched_step() is not None:
        raise ValueError(
            f"Layer {current_path() or '?'!r} calls keras.random.categorical in pipeline "
            "micro-batches: each holds only its rows of the logits, so tfmp cannot draw "
            "what one device draws for the whole batch. Draw it outside the pipelined "
            "model (e.g. in the tf.data pipeline), or train without micro-batches."
        )
    logits = _replicated(tf.convert_to_tensor(logits))
    return _replicated(_keras("categorical")(logits, num_samples, dtype, seed))


def _draw(name: str, shape: Any, params: tuple, dtype: Any, seed: Any) -> tf.Tensor:
    """Keras' `random.<name>(shape, *params, dtype, seed)`, drawn whole on
    every device (in a pipeline micro-batch: its rows of the step's draw)."""
    seed = _seed_of_step(seed)
    params = [_replicated(param) for param in params]
    return _for_microbatch(
        lambda whole: _replicated(_keras(name)(whole, *params, dtype, seed)), shape
    )


# Pipelines: a layer runs once per micro-batch, but must draw what one device
# draws for the whole batch in one call.


class _DrawnSeed(SeedGenerator):
    """A seed drawn already, in the form Keras' draw functions take: a
    generator whose next seed it is (and that makes no state variable)."""

    def __init__(self, value: tf.Tensor):
        self._value = value

    def next(self, ordered: bool = True) -> tf.Tensor:
        return self._value


def _seed_of_step(seed: Any) -> Any:
    """`seed`, or within a pipeline micro-batch the seed one device draws for
    the whole step: a generator advances once per step, not once per micro-batch."""
    step = microbatched_step()
    if step is None or isinstance(seed, int):
        return seed
    # Keras draws from its global generator for `seed=None`.
    generator = global_seed_generator() if seed is None else seed
    return _DrawnSeed(step.seed(generator, lambda: keras_random.draw_seed(seed)))


def _for_microbatch(draw: Callable[[Any], tf.Tensor], shape: Any) -> tf.Tensor:
    """`draw(shape)`; within a pipeline micro-batch, when `shape` has one row
    per sample, the micro-batch's rows of `draw` of the whole batch's shape."""
    step = microbatched_step()
    if step is None:
        return draw(shape)
    dims = _dims(shape)
    if not _one_row_per_sample(dims, step, shape):
        return draw(shape)  # one draw for the whole batch, as on one device
    rows, rest = dims[0], dims[1:]
    whole = draw([rows * step.count, *rest])
    # A replicated draw: DTensor slices it locally, whatever the bounds.
    return tf.slice(whole, [rows * step.index] + [0] * len(rest), [rows] + [-1] * len(rest))


def _dims(shape: Any) -> list[Any]:
    """The dimensions of a draw's `shape`: ints where known before the step
    runs, scalar tensors where not."""
    if tf.is_tensor(shape):  # e.g. tf.shape(inputs): as much of it as is known
        known = tensor_util.constant_value_as_shape(shape).as_list()
        return [shape[k] if dim is None else dim for k, dim in enumerate(known)]
    if isinstance(shape, tf.TensorShape):
        return shape.as_list()
    return [_static(dim) for dim in shape]


def _static(dim: Any) -> Any:
    if not tf.is_tensor(dim):
        return dim
    value = tf.get_static_value(dim)
    return dim if value is None else int(value)


def _one_row_per_sample(dims: list[Any], step: MicrobatchedStep, shape: Any) -> bool:
    """Whether a draw of `dims` in a micro-batch has one row per sample (its
    first dimension is the batch's), rather than one draw shared by the batch
    (a noise shape of 1, a scalar).

    Keras puts the batch first; a first dimension equal to the micro-batch's
    size is taken to be it. Where that cannot tell the two apart, a ValueError
    names the layer."""
    if not dims:
        return False
    leading = dims[0]
    if step.rows is None:
        # The batch's size is unknown while tracing; a size fixed in the model is not it.
        return tf.is_tensor(leading)
    if tf.is_tensor(leading) or (leading == step.rows == 1):
        raise ValueError(
            f"Layer {current_path() or '?'!r} draws random numbers of shape {shape} in "
            f"pipeline micro-batches of {step.rows} rows, and tfmp cannot tell whether "
            "their first dimension is the batch's (one row per sample) or one draw for "
            "the whole batch, so it cannot draw what one device draws. Use micro-batches "
            "of at least 2 samples (a batch size of at least 2 * num_microbatches), and "
            "random shapes known before the step runs."
        )
    return leading == step.rows


_MODULE = "keras.src.backend.tensorflow.random"
_SPLIT_DRAW = "DTensor draws each shard with its local shape and a per-device seed"
_REPLICATED_DRAW = (
    "DTensor runs their ops replicated by tfmp's switch (tfmp._env.REPLICATED_OPS), "
    "and a pipeline micro-batch would draw with a seed of its own"
)

LOWERINGS: tuple[Lowering, ...] = tuple(
    Lowering(_MODULE, draw.__name__, draw, _SPLIT_DRAW)
    for draw in (normal, uniform, truncated_normal, randint, dropout)
) + tuple(
    Lowering(_MODULE, draw.__name__, draw, _REPLICATED_DRAW)
    for draw in (gamma, binomial, beta, categorical)
)


# TensorFlow's stateful random ops, called by user code on a mesh: a layer or
# a `train_step` written before Keras 3 (`tf.random.normal`,
# `tf.keras.backend.random_normal`, a GAN's latent vectors and label noise).
# DTensor refuses stateful random ops ("Stateful random operations are not
# supported in DTensor"). On one device each such op is a kernel holding a
# Philox generator keyed by the op's seeds (`seed`, `seed2`), which reserves
# 256 blocks of 128 bits per number drawn at every run; a new traced function
# makes new kernels, which start again. On a mesh each op draws the same
# numbers from TensorFlow's stateless Philox ops, with the same key and the
# counter a replicated mesh variable keeps: the draws are whole on every
# device, and equal one device's bit for bit whenever TensorFlow's global seed
# is set (`tf.random.set_seed`, `keras.utils.set_random_seed`): an op without
# a seed of its own gets its place among the traced function's unseeded ops,
# the same on a mesh. tfmp traces a step once more than
# one device for a last batch that does not divide the batch axis; the traces
# of a function share each op's counter, as one device's single trace does:
# an op is known by its strategy, the traced function's name, its seeds, and
# how many ops with those seeds that trace made before it. (So a recompiled
# model's new train function, or a second model's in the same strategy,
# continues the draws where one device's starts again.) Seeds of 0 (no seed
# anywhere) make one device's kernel seed itself at random, and the mesh
# picks random seeds: they match in distribution. `tf.random.gamma`'s kernel
# reserves its blocks per number alike, and the stateless gamma op samples as
# it does: one device's numbers. `tf.random.shuffle` and
# `tf.random.categorical` have kernels no stateless op reproduces; on a mesh
# they draw from the same stateless stream, and match one device only in
# distribution. `tf.random.poisson`'s kernel has no stateless twin either: it
# runs as it is on every device, seeded alike.

# Philox blocks of 128 bits a stateful kernel reserves per number it draws.
_BLOCKS_PER_NUMBER = 256
_PHILOX = 1  # `Algorithm.PHILOX` of the stateless ops


def _mesh_of_draw() -> dtensor.Mesh | None:
    """The mesh a stateful op is traced on: a layer's forward pass', else a
    tfmp step's (a `train_step`'s own draws run outside any layer). The
    lowerings cannot import the strategy, so a tfmp step is known by its
    replica context's strategy, which names its home mesh."""
    mesh = forward_mesh()
    if mesh is not None or tf.executing_eagerly():
        return mesh
    context = tf.distribute.get_replica_context()
    extended = getattr(getattr(context, "strategy", None), "extended", None)
    if not type(extended).__module__.startswith("tfmp."):
        return None
    return extended.home_mesh.dtensor_mesh


# Per strategy, each op's stream, by (mesh, traced function's name, seeds, ordinal).
_streams: "weakref.WeakKeyDictionary[Any, dict[tuple, _PhiloxStream]]" = weakref.WeakKeyDictionary()
# Per graph being traced: how many ops of each seed pair it made.
_ordinals: "weakref.WeakKeyDictionary[Any, collections.Counter]" = weakref.WeakKeyDictionary()


def _stream_of_op(mesh: dtensor.Mesh, seed: int, seed2: int) -> "_PhiloxStream":
    """The stream of the op being traced now (see above)."""
    seed, seed2 = seed or 0, seed2 or 0  # TensorFlow passes None for "no seed"
    graph = tf.compat.v1.get_default_graph()
    ordinals = _ordinals.setdefault(graph, collections.Counter())
    key = (mesh.to_string(), graph.name, seed, seed2, ordinals[seed, seed2])
    ordinals[seed, seed2] += 1
    streams = _streams.setdefault(tf.distribute.get_strategy(), {})
    if key not in streams:
        streams[key] = _PhiloxStream(mesh, seed, seed2)
    return streams[key]


class _PhiloxStream:
    """One stateful op's generator on a mesh: its Philox key (the op's
    `seed`) and counter (`seed2` above the blocks drawn so far, which a
    replicated int64 variable keeps)."""

    def __init__(self, mesh: dtensor.Mesh, seed: int, seed2: int):
        if seed == seed2 == 0:
            seed, seed2 = _unseeded_seeds()
        self._key = seed
        self._seed2 = seed2
        with tf.init_scope():  # made as the step is first traced, like the kernel
            zero = dtensor.call_with_layout(
                tf.zeros, dtensor.Layout.replicated(mesh, 0), shape=[], dtype=tf.int64
            )
            self._drawn = dtensor.DVariable(zero, trainable=False, name="philox_counter")

    def key_and_counter(self, numbers: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The key and counter of the next draw of `numbers` numbers."""
        offset = self._drawn.read_value()
        self._drawn.assign_add(tf.cast(numbers, tf.int64) * _BLOCKS_PER_NUMBER)
        key = tf.constant([self._key], tf.uint64)
        counter = tf.stack([tf.cast(offset, tf.uint64), tf.constant(self._seed2, tf.uint64)])
        return key, counter


def _unseeded_seeds() -> tuple[int, int]:
    """Seeds for an op with none: a one-device kernel seeds itself at random.
    In a run of several clients each would pick its own, and the draws that
    should be whole on every device would differ: an error instead."""
    if dtensor.num_clients() > 1:
        raise ValueError(
            "An unseeded TensorFlow random op (tf.random.normal, uniform, ...) runs in a "
            "step of a multi-client tfmp run: each client would draw other numbers. "
            "Call tf.random.set_seed(...) in every client before the model trains."
        )
    return _SEEDS.getrandbits(31), _SEEDS.getrandbits(31)


_SEEDS = random.SystemRandom()


def _size(shape: Any) -> tf.Tensor:
    return tf.reduce_prod(tf.cast(shape, tf.int64))


def stateless_on_mesh(kernel: Callable) -> Callable:
    """A stateful random op's function (`gen_random_ops.<op>`) that, on a
    mesh, draws one device's numbers from the stateless op of the same
    distribution (see above)."""
    stateless = {
        "random_standard_normal": stateless_v2.stateless_random_normal_v2,
        "random_uniform": stateless_v2.stateless_random_uniform_v2,
        "truncated_normal": stateless_v2.stateless_truncated_normal_v2,
    }[kernel.__name__]

    @functools.wraps(kernel)
    def wrapper(shape, dtype, seed=0, seed2=0, name=None):
        mesh = _mesh_of_draw()
        if mesh is None:
            return kernel(shape, dtype, seed=seed, seed2=seed2, name=name)
        key, counter = _stream_of_op(mesh, seed, seed2).key_and_counter(_size(shape))
        return _replicated(stateless(shape, key, counter, _PHILOX, dtype=dtype, name=name), mesh)

    return wrapper


def stateless_int_on_mesh(kernel: Callable) -> Callable:
    """`gen_random_ops.random_uniform_int` (`tf.random.uniform` of an integer
    dtype) that, on a mesh, draws one device's numbers statelessly."""

    @functools.wraps(kernel)
    def wrapper(shape, minval, maxval, seed=0, seed2=0, name=None):
        mesh = _mesh_of_draw()
        if mesh is None:
            return kernel(shape, minval, maxval, seed=seed, seed2=seed2, name=name)
        key, counter = _stream_of_op(mesh, seed, seed2).key_and_counter(_size(shape))
        minval, maxval = _replicated(minval, mesh), _replicated(maxval, mesh)
        drawn = stateless_v2.stateless_random_uniform_int_v2(
            shape, key, counter, _PHILOX, minval, maxval, name=name
        )
        return _replicated(drawn, mesh)

    return wrapper


def shuffled_on_mesh(kernel: Callable) -> Callable:
    """`gen_random_ops.random_shuffle` (`tf.random.shuffle`) that, on a mesh,
    orders the rows by a stateless uniform draw: a uniform permutation, as
    one device's, but not its."""

    @functools.wraps(kernel)
    def wrapper(value, seed=0, seed2=0, name=None):
        mesh = _mesh_of_draw()
        if mesh is None:
            return kernel(value, seed=seed, seed2=seed2, name=name)
        value = _replicated(tf.convert_to_tensor(value), mesh)
        rows = tf.shape(value, out_type=tf.int64)[:1]
        key, counter = _stream_of_op(mesh, seed, seed2).key_and_counter(rows[0])
        sort_keys = stateless_v2.stateless_random_uniform_v2(rows, key, counter, _PHILOX)
        return tf.gather(value, tf.argsort(_replicated(sort_keys, mesh)), name=name)

    return wrapper


def gumbel_categorical_on_mesh(kernel: Callable) -> Callable:
    """`gen_random_ops.multinomial` (`tf.random.categorical`) that, on a
    mesh, samples by the Gumbel-max rule from a stateless uniform draw: the
    same distribution as one device's, other samples."""

    @functools.wraps(kernel)
    def wrapper(logits, num_samples, seed=0, seed2=0, output_dtype=tf.int64, name=None):
        mesh = _mesh_of_draw()
        if mesh is None:
            return kernel(
                logits, num_samples, seed=seed, seed2=seed2, output_dtype=output_dtype, name=name
            )
        logits = _replicated(tf.convert_to_tensor(logits), mesh)
        rows, classes = tf.unstack(tf.shape(logits, out_type=tf.int64))
        shape = tf.stack([rows, tf.cast(num_samples, tf.int64), classes])
        key, counter = _stream_of_op(mesh, seed, seed2).key_and_counter(_size(shape))
        uniform = stateless_v2.stateless_random_uniform_v2(
            shape, key, counter, _PHILOX, dtype=logits.dtype
        )
        # -log(-log(u)) is Gumbel noise; u = 0 only makes its class lose.
        gumbel = -tf.math.log(-tf.math.log(_replicated(uniform, mesh)))
        samples = tf.argmax(logits[:, None, :] + gumbel, axis=-1, output_type=output_dtype)
        return tf.identity(samples, name=name)

    return wrapper


def stateless_gamma_on_mesh(kernel: Callable) -> Callable:
    """`gen_random_ops.random_gamma` (`tf.random.gamma`) that, on a mesh,
    draws one device's numbers from `StatelessRandomGammaV3`: a gamma kernel
    reserves its Philox blocks per number as the normal kernel does, and the
    stateless kernel samples the same way from the same key and counter."""

    @functools.wraps(kernel)
    def wrapper(shape, alpha, seed=0, seed2=0, name=None):
        mesh = _mesh_of_draw()
        if mesh is None:
            return kernel(shape, alpha, seed=seed, seed2=seed2, name=name)
        alpha = _replicated(tf.convert_to_tensor(alpha), mesh)
        whole_shape = tf.concat(
            [tf.cast(shape, tf.int64), tf.shape(alpha, out_type=tf.int64)], axis=0
        )
        key, counter = _stream_of_op(mesh, seed, seed2).key_and_counter(_size(whole_shape))
        drawn = stateless_v2.stateless_random_gamma_v3(
            whole_shape, key, counter, _PHILOX, alpha, name=name
        )
        return _replicated(drawn, mesh)

    return wrapper


def replicated_poisson_on_mesh(kernel: Callable) -> Callable:
    """`gen_random_ops.random_poisson_v2` (`tf.random.poisson`) that, on a
    mesh, runs TensorFlow's own kernel on every device with the same seeds
    (DTensor runs it replicated: `tfmp._env.REPLICATED_OPS`): every device
    draws the same numbers, like one device's in distribution. No stateless
    op samples as the kernel does, and the kernel's state starts again in
    each traced function (tfmp traces one more for a last batch that does not
    divide the batch axis), so the numbers are not one device's. An op with
    no seed at all gets random seeds, the same on every device."""

    @functools.wraps(kernel)
    def wrapper(shape, rate, seed=0, seed2=0, dtype=tf.int64, name=None):
        mesh = _mesh_of_draw()
        if mesh is None:
            return kernel(shape, rate, seed=seed, seed2=seed2, dtype=dtype, name=name)
        if not (seed or seed2):
            seed, seed2 = _unseeded_seeds()
        rate = _replicated(tf.convert_to_tensor(rate), mesh)
        drawn = kernel(shape, rate, seed=seed, seed2=seed2, dtype=dtype, name=name)
        return _replicated(drawn, mesh)

    return wrapper


# TensorFlow functions patched with this family's code while a strategy exists.
PATCHES = (
    *(
        Patch(
            "tensorflow.python.ops.gen_random_ops",
            kernel,
            wrapper,
            "DTensor refuses stateful random ops (tf.random.normal in a VAE's "
            "sampling layer, a GAN's latent vectors in its train_step): on a "
            f"mesh they draw from stateless ops, {matching}.",
            parameters=parameters,
        )
        for kernel, wrapper, matching, parameters in (
            *(
                (
                    kernel,
                    stateless_on_mesh,
                    "the numbers one device draws",
                    ("shape", "dtype", "seed", "seed2", "name"),
                )
                for kernel in ("random_standard_normal", "random_uniform", "truncated_normal")
            ),
            (
                "random_uniform_int",
                stateless_int_on_mesh,
                "the numbers one device draws",
                ("shape", "minval", "maxval", "seed", "seed2", "name"),
            ),
            (
                "random_gamma",
                stateless_gamma_on_mesh,
                "the numbers one device draws",
                ("shape", "alpha", "seed", "seed2", "name"),
            ),
            (
                "random_poisson_v2",
                replicated_poisson_on_mesh,
                "the same numbers on every device, like one device's in distribution",
                ("shape", "rate", "seed", "seed2", "dtype", "name"),
            ),
            (
                "random_shuffle",
                shuffled_on_mesh,
                "a permutation like one device's in distribution",
                ("value", "seed", "seed2", "name"),
            ),
            (
                "multinomial",
                gumbel_categorical_on_mesh,
                "samples like one device's in distribution",
                ("logits", "num_samples", "seed", "seed2", "output_dtype", "name"),
            ),
        )
    ),
)
