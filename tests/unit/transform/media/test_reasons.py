"""Dead-letter reasons of the image and audio steps are plain words: no Python object or
address, and "corrupt" only for data that is, not for a format a library does not implement,
a size past a limit or an empty input."""

from __future__ import annotations

import re

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aisp.transform.media.common import plain
from tests.unit.transform.media.test_audio import SEED_AUDIO, Decoder, signal, wav
from tests.unit.transform.media.test_images import SEEDS, Harness

ADDRESS = re.compile(r"0x[0-9a-f]{6,}|<.* object at")
SIGNATURES = [b"RIFF\x24\x00\x00\x00WAVEfmt ", b"RIFF\xff\xff\xff\x7fWAVE", b"fLaC", b"OggS", b"\xff\xd8\xff",
              b"\x89PNG\r\n\x1a\n", b"RIFF\x00\x01\x00\x00WEBPVP8X"]  # fmt: skip


@st.composite
def hostile(draw: st.DrawFn) -> bytes:
    """A known signature followed by anything, a valid file with bytes overwritten or cut, or
    random bytes."""
    kind = draw(st.sampled_from(["signature", "mutated", "random"]))
    if kind == "signature":
        return draw(st.sampled_from(SIGNATURES)) + draw(st.binary(max_size=300))
    if kind == "random":
        return draw(st.binary(max_size=300))
    data = bytearray(draw(st.sampled_from([*SEED_AUDIO, *SEEDS.values()])))
    for _ in range(draw(st.integers(0, 8))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(hostile(), min_size=1, max_size=6))
def test_no_reason_names_a_python_object(payloads: list[bytes]) -> None:
    images, audio = Harness(size=(8, 8)), Decoder(max_seconds=5.0)
    images.run(payloads)
    audio.run(payloads)
    for reason in [*images.reasons().values(), *audio.dead.values()]:
        assert reason and not ADDRESS.search(reason), reason


def reason(data: bytes, **settings: object) -> str:
    d = Decoder(**settings)
    d.run([data])
    return d.dead[0]


def test_libsndfiles_words_say_what_kind_of_failure_it_is() -> None:
    assert reason(b"fLaC" + bytes(100)) == "unsupported audio: File contains data in an unimplemented format"
    malformed = bytearray(wav(signal(0.1)))
    malformed[20:22] = b"\x34\x12"  # a format tag the fmt chunk's size does not fit
    assert reason(bytes(malformed)) == "corrupt audio: Error in WAV/W64/RF64 file. Malformed 'fmt ' chunk"
    flac = wav(signal(0.5), fmt="FLAC")
    assert reason(flac[:60] + bytes(400) + flac[460:]).startswith("corrupt audio: ")  # lost sync, bad header


def test_limits_and_empty_input_are_not_called_corrupt() -> None:
    too_long = reason(wav(np.zeros(16000 * 3, dtype=np.float32)), max_seconds=2.0)
    assert too_long == "audio too long: 3.0 s (limit 2.0)"
    assert reason(wav(np.zeros(0, dtype=np.float32))) == "empty audio (no samples)"


def test_plain_takes_objects_and_addresses_out() -> None:
    assert plain("Error opening <_io.BytesIO object at 0x7f85a071a660>: Format not recognised.") == (
        "Error opening the input: Format not recognised"
    )
    assert plain("bad thing at 0x7f85a071a660 here") == "bad thing at the input here"
    assert plain("SOF type 0xc3") == "SOF type 0xc3"
    assert plain("") == "unknown error"
