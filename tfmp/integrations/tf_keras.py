"""tf_keras (Keras 2, under TF Model Garden): step functions and legacy optimizers."""

PACKAGE = "tf-keras"
MODULE = "tf_keras"
TESTED = ("2.21", "2.21")
