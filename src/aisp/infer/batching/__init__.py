"""Dynamic batching: ``batcher`` (``DynamicBatcher``: rows from many micro-batches into
well-sized model calls), ``queue`` (``BatchQueue``: per-tier queues, flush rules, expiry and
shedding over an injected clock), ``config`` (``BatcherConfig``), ``adaptive`` (``AdaptiveTuner``:
online search of the batching settings) and ``in_order`` (results handed on in the order their
batches were formed)."""
