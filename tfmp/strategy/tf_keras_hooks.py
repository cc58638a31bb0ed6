"""Where tfmp meets tf_keras (Keras 2): its step functions and legacy optimizers.

Model Garden and other tf_keras code train under a tfmp strategy as they are;
two things tf_keras does cannot run on a mesh, and tfmp changes them for
models and optimizers under a tfmp strategy only:
- its step functions read batches inside `tf.function` (see `fed_batches`);
- its legacy optimizers apply an embedding's sparse gradient with scatters
  and sparse kernels that DTensor cannot lay out (see `dense_gradients`).
Both are installed through `tfmp.integrations.tf_keras`.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import tensorflow as tf

from tfmp.strategy.extended import extended_of
from tfmp.strategy.input import OneBatch
from tfmp.strategy.variable import dense_rows


def fed_batches(make_function: Callable) -> Callable:
    """tf_keras' `make_*_function`: under a tfmp strategy the step function
    reads each batch eagerly and hands it to the same compiled step.

    tf_keras' step function calls `next(iterator)` inside its `tf.function`;
    the strategy's iterator is a Python one (each batch packed onto the mesh on
    the host), which a trace would read once and keep as a constant.
    """
    attribute = make_function.__name__.replace("make_", "")

    @functools.wraps(make_function)
    def wrapper(self, force=False):
        function = make_function(self, force)
        extended = extended_of(self.distribute_strategy)
        if extended is None or getattr(function, "_tfmp_fed", False):
            return function
        extended.check_clients_agree([self])  # before its first step, as for Keras 3 models
        steps = self._steps_per_execution  # noqa: SLF001
        if self.autotune_steps_per_execution or (
            steps is not None and int(steps.numpy()) != 1
        ):
            raise ValueError(
                f"tf_keras model {self.name!r} under tfmp: compile it with "
                "steps_per_execution=1 (tf_keras reads several batches inside one "
                "compiled step only from a tf.data iterator, which DTensor cannot "
                "lay out)."
            )

        def fed(iterator):
            return function(OneBatch(next(iterator)))

        fed._tfmp_fed = True  # noqa: SLF001
        setattr(self, attribute, fed)
        return fed

    return wrapper


def dense_gradients(apply_gradients: Callable) -> Callable:
    """A legacy optimizer under tfmp applies a sparse gradient made dense.

    Its sparse path scatters into the variable's handle (`ResourceScatterAdd`)
    or runs sparse kernels, neither of which DTensor can lay out. For the
    optimizers whose sparse update equals their dense one, the dense gradient
    gives the same update; the others update only the rows in the batch, so
    they are refused rather than silently changed.
    """

    @functools.wraps(apply_gradients)
    def wrapper(self, grads_and_vars, *args, **kwargs):
        if extended_of(tf.distribute.get_strategy()) is None:
            return apply_gradients(self, grads_and_vars, *args, **kwargs)
        grads_and_vars = list(grads_and_vars)
        if any(isinstance(gradient, tf.IndexedSlices) for gradient, _ in grads_and_vars):
            _check_sparse_update_is_dense(self)
            grads_and_vars = [
                (
                    dense_rows(gradient, var.shape[0])
                    if isinstance(gradient, tf.IndexedSlices)
                    else gradient,
                    var,
                )
                for gradient, var in grads_and_vars
            ]
        return apply_gradients(self, grads_and_vars, *args, **kwargs)

    return wrapper


def _check_sparse_update_is_dense(optimizer: Any) -> None:
    """Raises unless `optimizer`'s update for a sparse gradient equals its
    update for that gradient made dense: legacy Adam (and Model Garden's
    AdamWeightDecay, which decays every row and then runs Adam's update),
    Adagrad (rows without gradient stay put either way) and SGD without
    momentum."""
    legacy = sys.modules["tf_keras"].optimizers.legacy
    if isinstance(optimizer, legacy.SGD):
        is_dense = not optimizer._momentum  # noqa: SLF001
    else:
        dense_updates = {legacy.Adam._resource_apply_sparse, legacy.Adagrad._resource_apply_sparse}
        adamw = sys.modules.get("official.modeling.optimization.legacy_adamw")
        if adamw is not None:
            dense_updates.add(adamw.AdamWeightDecay._resource_apply_sparse)
        is_dense = type(optimizer)._resource_apply_sparse in dense_updates  # noqa: SLF001
    if not is_dense:
        name = type(optimizer).__name__
        raise ValueError(
            f"tf_keras' legacy {name} updates only the rows of a sparse gradient "
            "(an embedding's) that the batch touches, with sparse kernels DTensor "
            "cannot lay out; applied dense, every row would move. Use the new "
            f"optimizer (tf_keras.optimizers.{name}; in a Model Garden config the "
            "'sgd_experimental' or 'adam_experimental' types), or legacy Adam, "
            "AdamWeightDecay ('adamw'), Adagrad or SGD without momentum."
        )
