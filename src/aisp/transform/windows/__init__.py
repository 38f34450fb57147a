"""Event-time windows on keyed streams: ``spec`` (``WindowSpec`` and the tumbling and sliding
window operator), ``base`` (what every window operator shares: ``Tumbling``, ``Sliding``,
``Session``, late events, early results, checkpoints), ``state`` (open windows' slots and the
(key, window) -> slot index), ``sessions`` (session windows that merge), ``event_time``
(``EventTime`` and watermarks), ``aggregates`` (vectorised, mergeable aggregates) and
``sketches`` (HyperLogLog, KLL quantiles, top-k)."""
