"""Models served from a repository, independent of the transport: ``server`` (``ModelServer``:
each model behind its dynamic batcher), ``served`` (``Served``: a live version and the requests
waiting on it), ``control`` (``ModelControl``: loads, unloads, the repository index),
``versions`` (``ModelVersions``: the versions a policy keeps live, rollouts' routing) and
``stats`` (Triton's statistics extension)."""
