"""TensorFlow and its DTensor."""

PACKAGE = "tensorflow"
MODULE = "tensorflow"
TESTED = ("2.21", "2.21")
