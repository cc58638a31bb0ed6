"""Orbit's training and evaluation loops over tfmp datasets.

Orbit (the loop under TF Model Garden's `train_lib.run_experiment`) calls
`next(iterator)` inside its compiled step, or inside a `tf.while_loop` of
steps. tfmp's batches are read on the host and packed onto the mesh, which a
trace would read once and keep as a constant. Runners whose dataset is a tfmp
dataset instead loop in Python: each batch is read eagerly and handed to the
same compiled step (`train_step` / `eval_step`, as the runner defines it), one
call per batch. `use_tf_while_loop` therefore runs as a Python loop of
compiled steps: the numbers are the same, and each step costs one host round
trip.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import tensorflow as tf

from tfmp.strategy.input import MeshDataset, OneBatch

def _fed_loop(
    create_loop_fn: Callable, dataset_name: str, step_name: str, options_name: str
) -> Callable:
    @functools.wraps(create_loop_fn)
    def wrapper(self, *args, **kwargs):
        datasets = tf.nest.flatten(getattr(self, dataset_name, None))
        if not any(isinstance(dataset, MeshDataset) for dataset in datasets):
            return create_loop_fn(self, *args, **kwargs)
        from orbit.utils import loop_fns

        step = getattr(self, step_name)
        if getattr(self, options_name).use_tf_function:
            step = tf.function(step)

        def fed_step(iterators: Any) -> Any:
            return step(tf.nest.map_structure(lambda it: OneBatch(next(it)), iterators))

        return loop_fns.create_loop_fn(fed_step)

    return wrapper


def fed_train_loop(create_train_loop_fn: Callable) -> Callable:
    """`StandardTrainer.create_train_loop_fn`, feeding tfmp batches from Python."""
    return _fed_loop(create_train_loop_fn, "train_dataset", "train_step", "_train_options")


def fed_eval_loop(create_eval_loop_fn: Callable) -> Callable:
    """`StandardEvaluator.create_eval_loop_fn`, feeding tfmp batches from Python."""
    return _fed_loop(create_eval_loop_fn, "eval_dataset", "eval_step", "_eval_options")
