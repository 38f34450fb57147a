"""Sample audio for the audio example: streams of synthetic speech (vowels from a pulse train
through formant resonances, syllable by syllable) and silence, with the times the speech is at.

    python examples/audio/voices.py DIR --streams 4   # DIR/stream-00.wav ... and DIR/truth.jsonl
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

RATE = 16000
VOWELS = {"a": (730, 1090, 2440), "i": (270, 2290, 3010), "u": (300, 870, 2240), "e": (530, 1840, 2480),
          "o": (570, 840, 2410)}  # fmt: skip
"""Formant frequencies (Hz) of five vowels."""


def _syllable(rng: np.random.Generator, seconds: float) -> np.ndarray:
    """One voiced syllable: a glottal pulse train at a wavering pitch, shaped by three formant
    resonances (their frequency response applied in the frequency domain)."""
    n = int(seconds * RATE)
    t = np.arange(n) / RATE
    pitch = rng.uniform(100, 180) * (1 + 0.05 * np.sin(2 * np.pi * 3 * t))
    pulses = np.diff(np.floor(np.cumsum(pitch / RATE)), prepend=0.0)
    freqs = np.fft.rfftfreq(2 * n, 1 / RATE)
    z = np.exp(-2j * np.pi * freqs / RATE)
    response = 1 / (1 - 0.95 * z)  # the glottal source's tilt
    for formant, width in zip(VOWELS[str(rng.choice(list(VOWELS)))], (80, 100, 120), strict=True):
        r, theta = np.exp(-np.pi * width / RATE), 2 * np.pi * formant / RATE
        response = response * (1 - r) / (1 - 2 * r * np.cos(theta) * z + r * r * z * z)
    voiced = np.fft.irfft(np.fft.rfft(pulses, 2 * n) * response)[:n]
    voiced *= np.sin(np.pi * np.arange(n) / n) ** 0.5 / max(np.abs(voiced).max(), 1e-9)
    if rng.random() < 0.6:  # a consonant before the vowel: a burst of high-passed noise
        m = int(rng.uniform(0.03, 0.08) * RATE)
        hiss = np.fft.irfft(np.fft.rfft(rng.standard_normal(m)) * (np.fft.rfftfreq(m, 1 / RATE) > 2500), m)
        voiced = np.concatenate([0.25 * hiss * np.hanning(m), voiced])
    return voiced


def stream(seed: int, seconds: float = 8.0) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """``seconds`` of one speaker: stretches of speech between silences, as float32 samples, and
    the (start, end) seconds of each stretch."""
    rng = np.random.default_rng(seed)
    parts, spans, at = [], [], 0.0
    while True:
        quiet = rng.uniform(0.6, 1.5)
        talk = rng.uniform(0.8, 2.0)
        if at + quiet + talk > seconds - 0.6:
            break
        parts.append(np.zeros(int(quiet * RATE)))
        at += quiet
        speech, said = [], 0.0
        while said < talk:
            speech.append(_syllable(rng, rng.uniform(0.15, 0.3)))
            said += len(speech[-1]) / RATE
        voiced = np.concatenate(speech)
        parts.append(0.3 * voiced / np.abs(voiced).max())
        spans.append((round(at, 3), round(at + len(voiced) / RATE, 3)))
        at += len(voiced) / RATE
    parts.append(np.zeros(int(seconds * RATE) - sum(len(p) for p in parts)))
    y = np.concatenate(parts) + 0.003 * rng.standard_normal(int(seconds * RATE))
    return y.astype(np.float32), spans


def chunks(streams: int, seconds: float = 8.0, chunk_ms: int = 100) -> list[dict[str, Any]]:
    """Rows ``{"stream", "seq", "audio"}``: every stream's audio in ``chunk_ms`` pieces of 16-bit
    PCM, interleaved as many concurrent callers would send them."""
    step = RATE * chunk_ms // 1000
    total = int(seconds * RATE)
    pcm = [(np.clip(stream(s, seconds)[0], -1, 1) * 32767).astype("<i2") for s in range(streams)]
    return [
        {"stream": f"caller-{s:03d}", "seq": k, "audio": pcm[s][k * step : (k + 1) * step].tobytes()}
        for k in range((total + step - 1) // step)
        for s in range(streams)
    ]


def write(directory: Path, streams: int, seconds: float = 8.0) -> None:
    import soundfile

    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "truth.jsonl").open("w") as truth:
        for s in range(streams):
            y, spans = stream(s, seconds)
            buf = io.BytesIO()
            soundfile.write(buf, y, RATE, format="WAV", subtype="PCM_16")
            (directory / f"stream-{s:02d}.wav").write_bytes(buf.getvalue())
            truth.write(json.dumps({"stream": f"caller-{s:03d}", "speech": spans}) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    write(args.directory, args.streams, args.seconds)
