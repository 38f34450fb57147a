"""Images and audio in the stream: ``images`` (``ImagePreprocess``, ``ImageBuckets``: decode,
fit, normalise into tensors), ``image_formats`` (what an encoded image's header says, read
without decoding it), ``audio`` (``AudioDecode``, ``AudioFeatures``), ``resample`` (``Resample``
for streams of chunks), ``vad`` (``SpeechSegments``: Silero VAD per stream) and ``common``
(``MediaError``, the counters and the decoding threads they share)."""
