"""Where the pipeline meets Keras' trainer: a pipeline model's steps.

This module declares `pipelined` as the wrapper of Keras'
`train_step` and `test_step`: a model under a strategy whose mesh has a
`"stage"` axis runs them stage by stage (`tfmp.pipeline.steps`); any other
model runs Keras' own.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import tensorflow as tf

from tfmp import integrations
from tfmp.integrations import Patch
from tfmp.pipeline import steps
from tfmp.pipeline.strategy_hooks import PipelineStages
from tfmp.strategy.extended import extended_of


def is_pipeline(model: Any) -> bool:
    """Whether `model` runs under a tfmp strategy whose mesh has stages."""
    extended = extended_of(getattr(model, "_distribute_strategy", None))
    return extended is not None and isinstance(extended.stages, PipelineStages)


def pipelined(step: Callable) -> Callable:
    """Runs a pipeline model's training and test steps stage by stage."""

    @functools.wraps(step)
    def wrapper(self, data):
        if not is_pipeline(self):
            return step(self, data)
        if tf.executing_eagerly():
            raise ValueError(
                f"Model {self.name!r} is a pipeline, whose stages meet inside one "
                "compiled function: compile it without run_eagerly=True."
            )
        return getattr(steps, step.__name__)(self, data)

    return wrapper


integrations.declare(
    __name__,
    (
        Patch(
            "keras.src.backend.tensorflow.trainer:TensorFlowTrainer",
            name,
            pipelined,
            "A pipeline model's steps run stage by stage.",
            parameters=("data",),
        )
        for name in ("train_step", "test_step")
    ),
)
