"""Orbit (the loops of TF Model Garden's `run_experiment`)."""

PACKAGE = "tf-models-official"
MODULE = "orbit"
TESTED = ("2.20", "2.20")
