"""Steps after the first ones compile nothing new on the mesh.

Each step on a mesh runs functions DTensor has compiled for it (the step,
the packing of batches, the outputs' reads). A per-step compile, a new
`tf.function` or a new layout made every step would show here as a count
that keeps growing: DTensor's function cache misses and size, and the
functions in TensorFlow's eager context. Counts, not bytes: the step loop's
memory itself is measured by bench/memory_growth.py.
"""

import keras
from tensorflow.dtensor.python import api as dtensor_api
from tensorflow.python.eager import context

from helpers import build_mlp, build_on, initial_weights, mlp_data, mlp_layout_map, strategy_on

WEIGHTS = initial_weights(build_mlp)


def compiled_counts() -> dict:
    stats = dtensor_api._dtensor_device()._get_stats()  # noqa: SLF001
    return {
        "dtensor misses": stats["function_manager.miss"],
        "dtensor functions": stats["function_manager.size"],
        "dtensor kernels": stats["kernel_cache.size"],
        "eager context functions": len(context.context().list_function_names()),
    }


def run_every_loop(model: keras.Model, x, y, epochs: int) -> None:
    # 37 rows at batch 8: a last batch of 5 that does not divide the batch axis.
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0)
    model.evaluate(x, y, batch_size=8, verbose=0)
    model.predict(x, batch_size=8, verbose=0)
    for _ in range(epochs):
        model.train_on_batch(x[:8], y[:8])
        model.test_on_batch(x[:8], y[:8])
        model.predict_on_batch(x[:8])


def test_later_steps_compile_nothing():
    strategy = strategy_on((2, 4), mlp_layout_map)
    model = build_on(strategy, "mlp", WEIGHTS)
    x, y = mlp_data(37)
    run_every_loop(model, x, y, epochs=1)
    warm = compiled_counts()
    run_every_loop(model, x, y, epochs=3)
    assert compiled_counts() == warm
