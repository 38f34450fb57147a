"""What a run shows to the outside: ``metrics`` (``PipelineCollector``: Prometheus families read
from the executor's counters at scrape time), ``llm`` (the LLM steps' families), ``operators``
(counters operators keep of their own work), ``rollouts`` (live canary rollouts) and ``scrape``
(readings of a ``/metrics`` page and the window between two of them). The HTTP server that
serves them and the dashboard is ``aisp.observe.server``."""
