"""Checkpoints of a running pipeline: ``coordinator`` (``Flight``: rows in flight and the pause
at the barrier; ``CheckpointCoordinator``: capture, write, restore points, partition handoff),
``keyed_state`` (the executor's keyed state outside the hot path: checkpoints, the bounded hot
layer, state that follows partitions), ``restores`` (partitions restored in the background while
the others flow) and ``savepoints`` (one version's state carried into another)."""
