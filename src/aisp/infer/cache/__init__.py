"""Response caches in front of a model stage: ``response`` (``ResponseCache``: exact inputs, in
this process), ``redis`` (the same answers in Redis, shared by workers) and ``semantic``
(``SemanticCache``: the answer of a close enough embedding)."""
