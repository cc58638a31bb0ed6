"""Keras 3 (TensorFlow backend): where tfmp meets models, trainers and variables."""

PACKAGE = "keras"
MODULE = "keras"
TESTED = ("3.12", "3.15")
