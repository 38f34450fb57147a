"""What a run shows to the outside: ``metrics`` (``PipelineCollector``: Prometheus families read
from the executor's counters at scrape time), ``llm`` (the LLM steps' families), ``operators``
(counters operators keep of their own work), ``rollouts`` (live canary rollouts), ``server`` (the
one HTTP server of a run for ``/metrics`` and the dashboard) and ``scrape`` (readings of a
``/metrics`` page and the window between two of them)."""
