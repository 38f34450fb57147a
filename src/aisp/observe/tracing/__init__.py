"""Per-event traces (OpenTelemetry): ``spans`` (the sampled events' spans through the graph) and
``config`` (``TraceConfig``: the ``--trace-*`` options or the standard environment)."""
