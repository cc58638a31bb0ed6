"""Orbit (the loops of TF Model Garden's `run_experiment`)."""

from tfmp.integrations import Patch

PACKAGE = "tf-models-official"
MODULE = "orbit"
TESTED = ("2.20", "2.20")

PATCHES = tuple(
    Patch(
        f"orbit:{runner}",
        factory,
        f"tfmp.strategy.orbit_loops:{wrapper}",
        "Orbit reads batches inside its compiled step or tf.while_loop, where "
        "tfmp's host-read batches would be traced once as constants.",
    )
    for runner, factory, wrapper in (
        ("StandardTrainer", "create_train_loop_fn", "fed_train_loop"),
        ("StandardEvaluator", "create_eval_loop_fn", "fed_eval_loop"),
    )
)
