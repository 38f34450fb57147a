"""Models from a repository: ``repository`` (``ModelRepository`` and ``ModelConfig``: Triton's
layout and config.pbtxt), ``versions`` (``ServedModel``: a model whose serving version changes
while the pipeline runs) and ``rollout`` (``Rollout``: a canary with automatic rollback)."""
