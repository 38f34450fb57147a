"""Root-cause diagnosis from a running pipeline's metrics (``aisp diagnose``): ``pipeline`` (the
findings, scored and ordered, with their evidence and a suggestion) and ``llm`` (the LLM steps'
own causes: queueing for a slot or slow generation)."""
