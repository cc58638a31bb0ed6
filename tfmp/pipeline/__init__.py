"""tfmp.pipeline: layer-wise model parallelism."""
