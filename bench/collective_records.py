"""Where the 2x4 step loop's memory goes: TensorFlow's per-step collective records.

TensorFlow's `CollectiveParamResolverLocal` keeps one record per collective
instance, keyed by (step_id, instance_key), and never erases one; DTensor runs
every call of a mesh function under a new step id. This benchmark shows that
these records are the whole growth: it calls a DTensor function with one
all-reduce over "batch" of a 2x4 mesh (4 groups of 2 devices) and prints the
RSS growth per 1,000 calls

- as TensorFlow runs it,
- with the calls run in a `tf.while_loop` of `--inner` iterations inside one
  call (the records are per call: the same instance key under the same step id
  reuses its record),
- with the records dropped every 100 calls by a small C++ op that clears the
  resolver's protected table (compiled here with g++ against the installed
  TensorFlow's headers; it reaches into TensorFlow's internals, so it is a
  measurement only and tfmp does not ship it).

Every variant runs in its own process. Usage (from the repository root):

    python bench/collective_records.py           # 3,000 calls per variant
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

VARIANTS = ("as_is", "while_loop", "records_dropped")

# Clears CollectiveParamResolverLocal::instance_table_ (protected). It relies on
# the class layout in the installed TensorFlow's headers and on no collective
# being in flight: a measurement, not something to run in a training job.
DROP_RECORDS_OP = r"""
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>
#include "tensorflow/core/framework/collective.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/common_runtime/collective_param_resolver_local.h"

namespace tensorflow {

// Both members are protected: reached through a subclass.
struct ExecutorMgrOf : CollectiveExecutor {
  static CollectiveExecutorMgrInterface* Get(CollectiveExecutor* executor) {
    return static_cast<ExecutorMgrOf*>(executor)->cem_;
  }
};

struct InstanceRecords : CollectiveParamResolverLocal {
  static int64_t Clear(ParamResolverInterface* resolver) {
    auto* local = static_cast<InstanceRecords*>(resolver);
    int64_t dropped = 0;
    mutex_lock lock(local->instance_mu_);
    for (auto& group : local->instance_table_) {
      dropped += group.second.size();
      group.second.clear();
    }
    return dropped;
  }
};

REGISTER_OP("DropCollectiveInstanceRecords")
    .Output("dropped: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape);

class DropCollectiveInstanceRecords : public OpKernel {
 public:
  explicit DropCollectiveInstanceRecords(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* ctx) override {
    CollectiveExecutor* executor = ctx->collective_executor();
    OP_REQUIRES(ctx, executor != nullptr, errors::Internal("no collective executor"));
    const int64_t dropped =
        InstanceRecords::Clear(ExecutorMgrOf::Get(executor)->GetParamResolver());
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = dropped;
  }
};
REGISTER_KERNEL_BUILDER(Name("DropCollectiveInstanceRecords").Device(DEVICE_CPU),
                        DropCollectiveInstanceRecords);
}  // namespace tensorflow
"""


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build_drop_records_op(directory: str) -> str:
    """Compiles the op against the installed TensorFlow; returns the library's path."""
    import tensorflow as tf

    source = os.path.join(directory, "drop_records.cc")
    library = os.path.join(directory, "drop_records.so")
    with open(source, "w") as out:
        out.write(DROP_RECORDS_OP)
    command = ["g++", "-w", "-shared", "-fPIC", "-O1", source, "-o", library,
               *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
    subprocess.run(command, check=True)
    return library


def measure(variant: str, calls: int, inner: int, library: str | None) -> dict:
    """Runs one variant in this process; returns MB per 1,000 calls."""
    import tfmp

    tfmp.simulate_devices(8)
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    mesh = dtensor.create_mesh([("batch", 2), ("model", 4)], device_type="CPU")
    x = dtensor.relayout(
        dtensor.copy_to_mesh(tf.ones((8, 4)), dtensor.Layout.replicated(mesh, 2)),
        dtensor.Layout(["batch", dtensor.UNSHARDED], mesh),
    )
    w = dtensor.DVariable(dtensor.copy_to_mesh(tf.ones((4,)), dtensor.Layout.replicated(mesh, 1)))
    iterations = inner if variant == "while_loop" else 1

    @tf.function
    def call(x):
        total = tf.constant(0.0)
        for _ in tf.range(iterations):
            total += tf.reduce_sum(x * w)  # batch-sharded: one all-reduce over "batch"
        return total

    drop_records = None
    if variant == "records_dropped":
        drop_records = tf.load_op_library(library).drop_collective_instance_records
    dropped = 0
    for _ in range(200):
        call(x).numpy()
    points = []
    for i in range(calls + 1):
        if i % 250 == 0:
            points.append((i, rss_mb()))
        if i == calls:
            break
        call(x).numpy()
        if drop_records is not None and i % 100 == 99:
            with tf.device("/CPU:0"):  # a plain op, outside the mesh
                dropped += int(drop_records().numpy())
    rates = sorted(1000 * (rss - before) / (i - j) for (j, before), (i, rss) in zip(points, points[1:]))
    return {"variant": variant, "mb_per_1000_calls": rates[len(rates) // 2],
            "steps_per_call": iterations, "records_dropped": dropped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--inner", type=int, default=10, help="while_loop iterations per call")
    parser.add_argument("--one", metavar="VARIANT", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.calls, args.inner, args.library)))
        return
    with tempfile.TemporaryDirectory() as directory:
        library = build_drop_records_op(directory)
        print(f"DTensor function, one all-reduce over 'batch' of a 2x4 mesh; {args.calls} calls\n")
        print("| variant | steps per call | MB per 1,000 calls | MB per 1,000 steps | records dropped |")
        print("|---|---:|---:|---:|---:|")
        for variant in VARIANTS:
            command = [sys.executable, __file__, "--one", variant, "--calls", str(args.calls),
                       "--inner", str(args.inner), "--library", library]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode:
                sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            per_call = result["mb_per_1000_calls"]
            print(f"| {variant} | {result['steps_per_call']} | {per_call:.2f} | "
                  f"{per_call / result['steps_per_call']:.2f} | {result['records_dropped']} |")


if __name__ == "__main__":
    main()
