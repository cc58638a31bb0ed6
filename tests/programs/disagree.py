"""Clients of one run that disagree, as several clients: `disagree.py`.

Each case prints `CASE name: ...` on every client. Same program: the
monitors find nothing; one client's copy of a bias changed behind the
strategy's back: `GradientSyncMonitor` names it on both clients. Then client 1
differs: other layout rules (refused before the first step), other data
order with `InputOrderCheck` (refused at the epoch's end), a custom loop's
model seeded otherwise (refused at the first `strategy.run`), a tf_keras
model seeded otherwise (refused as its fit starts); these errors are
caught so that one run tries them all. Last, client 1 seeded otherwise: the
error is not caught, and the run fails.
"""

import os
import sys
import warnings

import tfmp

cluster = tfmp.initialize(timeout_s=60)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import build_mlp, build_on, compile_mlp, initial_weights, mesh, mlp_data, mlp_layout_map  # noqa: E402

client = cluster.client_id
device_mesh = mesh((2, 4))
strategy = tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))
weights = initial_weights(build_mlp)
x, y = mlp_data(37)  # batches of 8: the last has 5 rows


def case(name, run):
    try:
        print(f"CASE {name}: {run()}", flush=True)
    except tfmp.ClientsDisagreeError as error:
        # Raised in a traced step, the message ends autograph's trace.
        message = str(error).strip().splitlines()[-1].strip().removeprefix("ClientsDisagreeError: ")
        print(f"CASE {name}: ClientsDisagreeError: {message}", flush=True)


def fit(model, x, y, *callbacks):
    return model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=list(callbacks))


model = build_on(strategy, "mlp", weights)


def same_program():
    monitor = tfmp.callbacks.GradientSyncMonitor()
    history = fit(model, x, y, monitor, tfmp.callbacks.InputOrderCheck())
    return (
        f"mismatched {history.history['sync/mismatched_variables']} "
        f"gradient_bytes {history.history['sync/gradient_bytes']} loss {history.history['loss']}"
    )


def one_copy_changed():
    if client == 1:  # every copy client 1 holds: only the other client's differ
        for handle in dtensor.unpack(model.get_layer("down").bias.value.handle):
            with tf.device(handle.device):
                copy = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32).numpy()
                copy[0] += 1.0
                tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(copy))
    monitor = tfmp.callbacks.GradientSyncMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, x, y, monitor)
    named = [str(w.message) for w in caught if "drifted apart" in str(w.message)]
    return f"mismatches {monitor.mismatches} warned {named}"


def other_rules():
    rules = mlp_layout_map(device_mesh)
    if client == 1:
        del rules["up/kernel"]
        rules["up/kernel"] = ("model", None)
    return fit(build_on(tfmp.ModelParallelStrategy(device_mesh, rules), "mlp", weights), x, y).history


def other_order():
    order = np.arange(len(x))
    if client == 1:  # batches 2 and 3 swapped
        order[16:32] = np.concatenate([order[24:32], order[16:24]])
    return fit(build_on(strategy, "mlp", weights), x[order], y[order], tfmp.callbacks.InputOrderCheck()).history


def custom_loop_other_seed():
    loop_strategy = tfmp.ModelParallelStrategy(device_mesh, mlp_layout_map(device_mesh))
    keras.utils.set_random_seed(10 + client)
    with loop_strategy.scope():
        net = build_mlp()
    step = tf.function(lambda batch: loop_strategy.run(net, args=(batch,)))
    batches = loop_strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(8))
    return step(next(iter(batches))).shape


def tf_keras_other_seed():
    import tf_keras

    tf_keras.utils.set_random_seed(20 + client)
    with strategy.scope():
        net = tf_keras.Sequential([tf_keras.Input((16,)), tf_keras.layers.Dense(8, name="head")])
        net.compile(optimizer="sgd", loss="mse")
    return net.fit(x, y, batch_size=8, epochs=1, verbose=0).history


case("same program", same_program)
case("one copy changed", one_copy_changed)
case("other rules", other_rules)
case("other order", other_order)
case("custom loop", custom_loop_other_seed)
case("tf_keras", tf_keras_other_seed)
keras.utils.set_random_seed(1 + client)
with strategy.scope():
    seeded = compile_mlp(build_mlp())
print("CASE other seed: fitting", flush=True)
fit(seeded, x, y)
print("CASE other seed: trained", flush=True)
