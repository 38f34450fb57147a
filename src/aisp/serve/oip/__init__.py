"""Open Inference Protocol v2, whatever the transport: ``request`` (``InferRequest``,
``InferInput``, ``Signature`` and the checks every request passes), the wire forms
``http_codec`` (JSON and Triton's binary tensor extension) and ``grpc_codec``
(``ModelInferRequest``/``ModelInferResponse``), ``tensors`` (many requests' tensors as one batch
and back) and ``shm`` (Triton's system shared-memory regions).

Like every sub-package here, it imports none of its modules itself: a codec is imported alone,
without the other transport's dependencies."""
