"""A pipeline as a network service: ``service`` (``PipelineService``: the pipeline with its
source replaced by an admission inbox), ``results`` (``Chunk`` and ``ResultTracker``: each
request's events followed to their answers) and ``topology`` (a new graph taking over at a
barrier)."""
