"""Ops DTensor has no layout rule for: run replicated by DTensor's switch, or
rewritten by `tfmp.lowering`, side by side in one process.

For each op, forward and gradient on a 2x4 ("batch", "model") mesh of 8 CPU
devices, the input split as a model splits it, each way timed (median of
interleaved calls) and checked against one device: "raw", the op replicated
by DTensor's switch, which gathers its inputs itself; "raw again", the same
in another function (the machine's noise); "gathered", the inputs gathered
one mesh axis at a time first (`tfmp.lowering.replicated`); "rewrite", an
op-specific form of `tfmp.lowering` where one exists.
"raw" of a depthwise convolution is DTensor's own DepthwiseConv2dNative with
its gradients (DepthwiseConv2dNativeBackpropFilter and BackpropInput, neither
with a rule) run replicated. A kernel that a case splits is a
variable laid out as a model splits it, and its gradient is checked and timed
with the input's. docs/layouts.md has the
numbers of a run.

    PYTHONPATH=$PWD python bench/generic_path.py [--calls 20] [--only _conv]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# The switch for every op that a case runs replicated.
_NO_RULE_OPS = (
    "MatrixBandPart", "Roll", "ReverseV2", "MatrixDiagV3", "ImageProjectiveTransformV3",
    "MatrixInverse", "MatrixSolve", "AvgPoolGrad", "AvgPool3DGrad",
    "DepthwiseConv2dNativeBackpropFilter", "DepthwiseConv2dNativeBackpropInput",
)
for _op in _NO_RULE_OPS:
    os.environ["DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF." + _op.upper()] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import tfmp  # noqa: E402

tfmp.simulate_devices(8)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

from tfmp.forward import forward_on  # noqa: E402
from tfmp.lowering import lowerings, registry  # noqa: E402
from tfmp.lowering.replicated import gathered_first  # noqa: E402

U = dtensor.UNSHARDED


def _cases(rng: np.random.Generator) -> list[dict]:
    rows = rng.normal(size=(8, 64, 64)).astype("float32")
    depthwise_kernel = rng.normal(size=(3, 3, 8, 1)).astype("float32")
    pointwise_kernel = rng.normal(size=(1, 1, 8, 16)).astype("float32")
    images = rng.uniform(size=(8, 32, 32, 8)).astype("float32")
    transforms = np.tile(np.array([[0.9, 0.1, 1.5, -0.1, 1.1, -2.0, 0.0, 0.0]], "float32"), (8, 1))
    start = np.tile(np.array([[[0, 0], [31, 0], [31, 31], [0, 31]]], "float32"), (8, 1, 1))
    end = start + rng.uniform(-2, 2, size=start.shape).astype("float32")
    cases = [
        dict(name="tril", fn=("numpy", "tril"), args=lambda x: (x, -1), x=rows, spec=["batch", "model", U]),
        dict(name="triu", fn=("numpy", "triu"), args=lambda x: (x, 2), x=rows, spec=["batch", "model", U]),
        dict(name="tril (columns)", fn=("numpy", "tril"), args=lambda x: (x, -1), x=rows,
             spec=["batch", U, "model"]),
        dict(name="roll", fn=("numpy", "roll"), args=lambda x: (x, 3, 1), x=rows, spec=["batch", "model", U]),
        dict(name="flip", fn=("numpy", "flip"), args=lambda x: (x, 1), x=rows, spec=["batch", "model", U]),
        dict(name="eye", fn=("numpy", "eye"), args=lambda x: (64,), x=rows, spec=["batch", "model", U],
             combine=lambda x, y: x * y),
        dict(name="affine_transform", fn=("image", "affine_transform"),
             args=lambda x: (x, tf.constant(transforms), "bilinear", "reflect"), x=images,
             spec=["batch", U, U, U]),
        dict(name="affine_transform (channels)", fn=("image", "affine_transform"),
             args=lambda x: (x, tf.constant(transforms), "nearest", "wrap"), x=images,
             spec=["batch", U, U, "model"]),
        dict(name="perspective_transform", fn=("image", "perspective_transform"),
             args=lambda x: (x, tf.constant(start), tf.constant(end)), x=images, spec=["batch", U, U, U]),
        dict(name="average_pool (batch)", fn=("nn", "average_pool"),
             args=lambda x: (x, 2, 2, "valid"), x=images, spec=["batch", U, U, U]),
        dict(name="average_pool (channels)", fn=("nn", "average_pool"),
             args=lambda x: (x, 2, 2, "valid"), x=images, spec=["batch", U, U, "model"]),
    ]
    for layout, spec, channels in (
        ("batch", ["batch", U, U, U], U),
        ("channels", [U, U, U, "model"], "model"),
        ("batch, channels", ["batch", U, U, "model"], "model"),
    ):
        depthwise = (depthwise_kernel, [U, U, channels, U])
        cases += [
            dict(name=f"depthwise_conv ({layout})", fn=("nn", "depthwise_conv"),
                 args=lambda x, k: (x, k, 1, "same"), x=images, spec=spec, kernels=[depthwise]),
            dict(name=f"separable_conv ({layout})", fn=("nn", "separable_conv"),
                 args=lambda x, k, p: (x, k, p, 1, "same"), x=images, spec=spec,
                 kernels=[depthwise, (pointwise_kernel, [U, U, channels, U])]),
        ]
    return cases


def _functions(case: dict) -> dict:
    family, name = case["fn"]
    module = f"keras.src.backend.tensorflow.{family}"
    raw = registry.keras_original(module, name)
    # The raw op traced again: the spread of two timings of one thing.
    ways = {"raw": raw, "raw again": raw, "gathered": gathered_first(module, name, case["name"].split()[0])}
    for lowering in lowerings():
        if (lowering.target, lowering.attribute) == (module, name) and lowering.wrapper.__module__ != (
            "tfmp.lowering.replicated"
        ):
            ways["rewrite"] = lowering.wrapper
    return ways


def _step(fn, case: dict, mesh, weights, kernels: list):
    combine = case.get("combine", lambda x, y: y)

    def forward_and_gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            with forward_on(mesh):
                y = combine(x, fn(*case["args"](x, *kernels)))
            loss = tf.reduce_sum(y * weights)
        return y, tape.gradient(loss, [x, *kernels])

    return tf.function(forward_and_gradient)


def _one_device(case: dict, x: tf.Tensor, weights) -> tuple[tf.Tensor, list]:
    kernels = [tf.Variable(value) for value, _ in case.get("kernels", [])]
    fn = _functions(case)["raw"]
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = case.get("combine", lambda x, y: y)(x, fn(*case["args"](x, *kernels)))
        loss = tf.reduce_sum(y * (0 if weights is None else weights))
    return y, [g.numpy() for g in tape.gradient(loss, [x, *kernels])]


def _mesh_kernels(case: dict, mesh) -> list:
    """The case's kernels as variables laid out as a model splits them; tfmp's
    convolutions read the layout from `compute_layout`, as on a tfmp variable."""
    kernels = []
    for value, spec in case.get("kernels", []):
        layout = dtensor.Layout(spec, mesh)
        whole = dtensor.copy_to_mesh(tf.constant(value), dtensor.Layout.replicated(mesh, value.ndim))
        variable = dtensor.DVariable(dtensor.relayout(whole, layout))
        variable.compute_layout = layout
        kernels.append(variable)
    return kernels


def _whole(value: tf.Tensor, mesh) -> tf.Tensor:
    """`value` replicated, gathered one mesh axis at a time (tfmp's real
    gathers take one axis per relayout), eagerly."""
    spec = list(dtensor.fetch_layout(value).sharding_specs)
    for dim, axis in enumerate(spec):
        if axis != U:
            spec[dim] = U
            value = dtensor.relayout(value, dtensor.Layout(spec, mesh))
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="3 calls per way (bench/run_all.py --quick)")
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    options = parser.parse_args()
    if options.quick:
        options.calls = 3
    mesh = tfmp.DeviceMesh((2, 4), ("batch", "model")).dtensor_mesh
    # The lowerings are in while a strategy lives.
    strategy = tfmp.ModelParallelStrategy(tfmp.DeviceMesh((2, 4), ("batch", "model")))  # noqa: F841
    rng = np.random.default_rng(0)
    for case in _cases(rng):
        if options.only not in case["name"]:
            continue
        x = tf.constant(case["x"])
        one_y, _ = _one_device(case, x, None)
        weights = rng.normal(size=one_y.shape).astype("float32")
        one_y, one_grads = _one_device(case, x, weights)
        on_mesh = dtensor.relayout(
            dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh, x.shape.rank)),
            dtensor.Layout(case["spec"], mesh),
        )
        mesh_weights = dtensor.copy_to_mesh(tf.constant(weights), dtensor.Layout.replicated(mesh, weights.ndim))
        kernels = _mesh_kernels(case, mesh)
        row = {"op": case["name"]}
        steps = {}
        for way, fn in _functions(case).items():
            try:
                steps[way] = _step(fn, case, mesh, mesh_weights, kernels)
                y, grads = steps[way](on_mesh)
                row[f"{way} max |dy|"] = float(np.max(np.abs(_whole(y, mesh).numpy() - one_y.numpy())))
                row[f"{way} max |grad|"] = max(
                    float(np.max(np.abs(_whole(g, mesh).numpy() - want))) for g, want in zip(grads, one_grads)
                )
            except Exception as error:  # noqa: BLE001 (a way that fails is a result)
                steps.pop(way, None)
                row[way] = f"fails: {str(error).splitlines()[0][:160]}"
        times = {way: [] for way in steps}
        for _ in range(options.calls):
            for way, step in steps.items():
                start = time.perf_counter()
                for gradient in step(on_mesh)[1]:
                    for shard in dtensor.unpack(gradient):
                        shard.numpy()
                times[way].append(time.perf_counter() - start)
        for way, samples in times.items():
            row[f"{way} ms"] = round(1000 * statistics.median(samples), 2)
        print(json.dumps(row), flush=True)
        _print_result(row, _tfmp_way(case))


def _tfmp_way(case: dict) -> str:
    """The way tfmp runs the case's function: its registered lowering, else raw."""
    module = f"keras.src.backend.tensorflow.{case['fn'][0]}"
    for lowering in lowerings():
        if (lowering.target, lowering.attribute) == (module, case["fn"][1]):
            return "gathered" if lowering.wrapper.__module__ == "tfmp.lowering.replicated" else "rewrite"
    return "raw"


def _print_result(row: dict, way: str) -> None:
    """tfmp's way against the fastest way, as a line bench/run_all.py reads."""
    times = {key[: -len(" ms")]: value for key, value in row.items() if key.endswith(" ms")}
    if way not in times:
        print(f'RESULT measure="{row["op"]}: tfmp\'s way ({way}) failed" ratio=nan')
        return
    fastest = min(times, key=times.get)
    print(
        f'RESULT measure="{row["op"]}: tfmp\'s way ({way}) ms / fastest ({fastest})" '
        f"ratio={times[way] / times[fastest]:.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
