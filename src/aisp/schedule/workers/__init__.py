"""A pipeline run by several shared-nothing worker processes (``--workers N``): ``pool``
(``WorkerPool`` and the coordinator: blocks, relayed output, aligned checkpoints), ``worker``
(one worker process) and ``exchange`` (the stable key hash, a file's blocks, batches on pipes,
the messages between the processes)."""
