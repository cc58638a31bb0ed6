"""tfmp.pipeline: layer-wise model parallelism, applied on top of the strategy.

Importing the package registers its `StageHooks` with the strategy
(`tfmp.strategy.stage_hooks` says why a registration) and declares its
patches of Keras' trainer (`tfmp.pipeline.keras_hooks`): from then on a
`ModelParallelStrategy` whose mesh has a `"stage"` axis runs a pipeline.
"""

from tfmp.pipeline import keras_hooks  # noqa: F401  (declares the pipeline's patches)
from tfmp.pipeline.strategy_hooks import make_stage_hooks
from tfmp.strategy.stage_hooks import register_stages

register_stages(make_stage_hooks)
