"""LLM stages: ``client`` (``OpenAIClient``: an OpenAI-compatible streaming client over several
endpoints), ``local`` (llama-cpp-python in this process), ``server`` (the packaged model behind
llama-cpp-python's server), ``stage`` (the ``llm`` step: prompts streamed token by token) and
``admission`` (admission by predicted time to first token)."""
