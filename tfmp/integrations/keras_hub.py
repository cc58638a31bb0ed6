"""KerasHub: its attention layers' choice between Keras' attention op and their own softmax."""

PACKAGE = "keras-hub"
MODULE = "keras_hub"
TESTED = ("0.32", "0.32")
