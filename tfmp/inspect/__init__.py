"""Read-only views of a parallel model: layouts, shard sizes, bytes per device."""
