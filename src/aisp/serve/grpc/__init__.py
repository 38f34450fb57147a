"""The gRPC transport: ``server`` (``GrpcServer``: OIP v2's ``GRPCInferenceService`` on
``tritonclient``'s generated stubs) and ``events`` (a served pipeline's ingest stream)."""
