"""A model trained on a mesh takes its traced steps with it when it goes.

A Python process keeps whatever still refers to a traced graph; a notebook
that builds and trains models in a loop, and this suite, grew by each
model's graphs until the machine ran out of memory.
"""

import gc
import weakref

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework.func_graph import FuncGraph
from tensorflow.python.ops import custom_gradient

import tfmp
from helpers import mesh
from tfmp.strategy.custom_gradients import released_with_graph


def _traced_with_custom_gradient(graph_mode_decorator):
    """A graph holding one custom gradient traced by `graph_mode_decorator`
    (`tf.custom_gradient`'s graph path), whose gradient is taken in it;
    returns a weak reference to the graph and the gradient's value."""

    def doubled(x):
        return tf.identity(x), lambda upstream: 2.0 * upstream

    graph = FuncGraph("with_custom_gradient")
    with graph.as_default():
        x = tf.constant([1.0, 2.0])
        gradient = tf.gradients(graph_mode_decorator(doubled, (x,), {}), x)[0]
    with tf.compat.v1.Session(graph=graph) as session:
        value = session.run(gradient)
    return weakref.ref(graph), value


def test_tensorflow_keeps_a_traced_custom_gradient_for_good_and_tfmp_releases_it():
    """Why tfmp patches `_graph_mode_decorator` (tfmp/strategy/custom_gradients.py):
    TensorFlow's own registers the gradient function for good, and with it
    the graph it closes over. When the first assertion fails, TensorFlow
    releases them itself and the patch can go."""
    decorator = custom_gradient._graph_mode_decorator
    own = getattr(decorator, "__wrapped__", decorator)  # under a strategy, the patched one
    kept, own_gradient = _traced_with_custom_gradient(own)
    released, gradient = _traced_with_custom_gradient(released_with_graph(own))
    gc.collect()
    assert kept() is not None, "TensorFlow releases a traced custom gradient now: drop tfmp's patch"
    assert released() is None
    np.testing.assert_array_equal(gradient, own_gradient)
    np.testing.assert_array_equal(gradient, [2.0, 2.0])


class ScaledByHostConstant(keras.layers.Layer):
    """Multiplies by a host tensor made outside the step, which the step
    captures (tfmp makes it a constant of the step's graph)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scale = tf.constant([1.0, 2.0, 3.0])

    def call(self, x):
        return x * self.scale


def test_a_model_trained_on_a_mesh_is_freed_with_its_step_graphs():
    """fit (with a last partial batch), evaluate and predict on 2x4: the
    mean pooling's lowering traces a custom gradient into the steps and the
    layer's host constant is captured by them; once the model is gone, no
    graph traced for it is left."""

    def graphs():
        return {id(o): weakref.ref(o) for o in gc.get_objects() if isinstance(o, FuncGraph)}

    rng = np.random.default_rng(0)
    # 9 rows at batch 4: a last batch of 1 that the batch axis does not divide.
    x, y = rng.normal(size=(9, 4, 3)).astype("float32"), rng.normal(size=(9, 1)).astype("float32")
    strategy = tfmp.ModelParallelStrategy(mesh((2, 4)), "auto")
    before = graphs()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((4, 3)),
                ScaledByHostConstant(),
                keras.layers.Dense(8),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(1),
            ]
        )
        model.compile("adam", "mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    model.evaluate(x, y, batch_size=4, verbose=0)
    model.predict(x, batch_size=4, verbose=0)
    traced = [reference for key, reference in graphs().items() if key not in before]
    assert traced
    del model
    gc.collect()
    alive = [reference().name for reference in traced if reference() is not None]
    assert not alive, f"graphs left after the model: {alive}"
