"""Turning an LLM's tokens into text as they come.

A token is not a character: a byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) can end a token in
the middle of a character's UTF-8 bytes (an emoji, a CJK character, an accented letter), and a
SentencePiece tokenizer decides a word's leading space from the tokens around it. Decoding each
token alone sends replacement characters (U+FFFD) and lost spaces to whoever reads the stream.

``TokenText`` keeps the tokens of one generation and, for each new token, decodes a short window
of them (from the start of the last text it sent) and sends what the window adds past that text,
unless the window ends in U+FFFD, an unfinished character: then it holds until the token that
completes it. So the pieces, joined, are the decoding of all the tokens, and none holds a
replacement character that the whole text does not. ``end()`` sends what is still held (a
character the generation never finished is U+FFFD then: it is not text). Works with any
``decode(ids) -> str``: Hugging Face ``tokenizers``, llama.cpp's ``detokenize``.

``Utf8Text`` does the same for raw bytes (a stream of UTF-8 cut anywhere), with Python's
incremental UTF-8 decoder.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable

__all__ = ["TokenText", "Utf8Text"]

_REPLACEMENT = "\ufffd"


class TokenText:
    """Incremental detokenization of one generation (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # where the window starts: the tokens of the last text sent
        self._read = 0  # tokens up to here are in the text sent
        self._sent = ""  # the decoding of ids[_prefix:_read]

    def feed(self, ids: Iterable[int]) -> str:
        """Take new tokens; the text they complete ("" while a character is unfinished)."""
        self.ids.extend(int(i) for i in ids)
        if len(self.ids) == self._read:
            return ""
        sent = self._sent
        window = self._decode(self.ids[self._prefix :])
        if len(window) <= len(sent) or window.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or the last character is not finished
        self._prefix, self._read = self._read, len(self.ids)
        self._sent = self._decode(self.ids[self._prefix : self._read])
        return window[len(sent) :]

    def end(self) -> str:
        """What is still held, as it decodes (the generation is over)."""
        sent, window = self._sent, self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        self._sent = ""
        return window[len(sent) :] if len(window) > len(sent) else ""


class Utf8Text:
    """UTF-8 bytes cut anywhere, to text: a character split across chunks is held until its last
    byte comes; bytes that can never be UTF-8 become U+FFFD as soon as that is certain."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, data: bytes) -> str:
        return str(self._decoder.decode(data, final=False))

    def end(self) -> str:
        return str(self._decoder.decode(b"", final=True))
