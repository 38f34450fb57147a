"""Images, audio and video in the stream: ``images`` (``ImagePreprocess``, ``ImageBuckets``:
decode, fit, normalise into tensors), ``image_formats`` (what an encoded image's header says,
read without decoding it), ``audio`` (``AudioDecode``, ``AudioFeatures``), ``resample``
(``Resample`` for streams of chunks), ``vad`` (``SpeechSegments``: Silero VAD per stream),
``speech`` (``SpeechToText``: Whisper), ``video`` (``VideoDecode``: files and live MPEG-TS
streams into frames and sound; ``mpegts``, its push demuxer) and ``common`` (``MediaError``, the
counters and the decoding threads they share)."""
