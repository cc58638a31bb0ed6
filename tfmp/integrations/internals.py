"""The private names of Keras and TensorFlow that tfmp reads, in one file.

Outside `tfmp.integrations` (the patches) and `tfmp.lowering` (the rewrites
of Keras' backend functions, which take their targets' own helpers), tfmp
imports Keras' and TensorFlow's internals from here only
(`tests/test_architecture.py` checks it): when an upgrade moves one, importing
tfmp fails in this file, at the line that names it, and nowhere else. Each
name says what tfmp takes it for.
"""

# Keras: the classes tfmp recognizes models, layers and ops by, and the
# trainer's helpers it calls the way Keras' own loops do.
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask  # noqa: F401
from keras.src.backend.common.name_scope import current_path as keras_current_path  # noqa: F401
from keras.src.backend.tensorflow import distribution_lib as keras_tf_distribution_lib  # noqa: F401
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer, reduce_per_replica  # noqa: F401
from keras.src.layers.convolutional.base_conv import BaseConv  # noqa: F401
from keras.src.layers.convolutional.base_conv_transpose import BaseConvTranspose  # noqa: F401
from keras.src.layers.pooling.base_pooling import BasePooling  # noqa: F401
from keras.src.models.functional import Functional  # noqa: F401
from keras.src.ops.image import Resize  # noqa: F401
from keras.src.ops.nn import AveragePool, MaxPool  # noqa: F401
from keras.src.trainers.data_adapters import data_adapter_utils  # noqa: F401
from keras.src.trainers.epoch_iterator import EpochIterator  # noqa: F401
from keras.src.utils import io_utils as keras_io_utils  # noqa: F401

# TensorFlow: the eager context (devices, the coordination service), the
# tf.distribute base classes a strategy and its datasets derive from, the
# raw ops and iterators of graph input, the coordination service's config,
# and the tags of a function's error messages.
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2  # noqa: F401
from tensorflow.dtensor.python import api as dtensor_api  # noqa: F401
from tensorflow.python.data.ops import multi_device_iterator_ops  # noqa: F401
from tensorflow.python.distribute import distribute_lib, input_lib  # noqa: F401
from tensorflow.python.eager import context as eager_context  # noqa: F401
from tensorflow.python.framework import dtypes as tf_dtypes  # noqa: F401
from tensorflow.python.framework import error_interpolation as tf_error_interpolation  # noqa: F401
from tensorflow.python.framework import ops as tf_ops  # noqa: F401
from tensorflow.python.ops import gen_dataset_ops, gen_math_ops  # noqa: F401
from tensorflow.python.types import distribute as distribute_types  # noqa: F401
