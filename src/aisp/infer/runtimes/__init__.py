"""What a batcher calls with a formed batch: ``base`` (the ``Runtime`` interface, ``OnnxRuntime``,
``PythonRuntime``, what a call costs), ``torch`` (PyTorch models), ``remote`` (a model on another
OIP v2 server, over gRPC), ``pool`` (one model on several such servers), ``text_encoder``
(sentence embeddings) and ``ocr`` (text detection, direction and recognition)."""
