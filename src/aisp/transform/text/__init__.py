"""Text and vectors in the stream: ``tokenize`` (a text column into token-id columns),
``vectors`` (``VectorIndex``: documents upserted and queried by the stream) and ``router``
(``EmbeddingRouter``: rows to the branch whose examples their embedding is closest to)."""
