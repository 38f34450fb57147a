"""The HTTP transport: ``app`` (``create_app``: the ASGI app with health, metadata, metrics and
the dashboard), ``models`` (the OIP v2 model routes and model control), ``events`` (served
pipelines' NDJSON and WebSocket ingest) and ``errors`` (every error as JSON with its status)."""
