"""Speech whose words are known, for the speech-to-text checks, benchmark and example.

``speak`` has Debian's ``espeak-ng`` say a sentence and gives 16 kHz mono samples;
``conversation`` strings sentences of ``SENTENCES`` together between silences, optionally with
white noise at a signal-to-noise ratio, and says when each was spoken; ``word_error_rate``
scores captions against what was said (jiwer's word error rate, after the normalisation every
ASR evaluation does: lower case, punctuation out, spaces collapsed).
"""

from __future__ import annotations

import functools
import io
import re
import shutil
import subprocess
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from aisp.errors import ConfigError

__all__ = ["RATE", "SENTENCES", "conversation", "normalise", "speak", "with_noise", "word_error_rate"]

RATE = 16000
SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "please call the office before noon tomorrow",
    "the train to the city leaves from platform four",
    "she bought fresh bread and a bottle of milk",
    "we need a larger table for the meeting room",
    "the weather will be cold and windy this evening",
    "turn left at the bridge and follow the river",
    "my brother plays the guitar every sunday",
    "the children were reading books in the garden",
    "open the window and let the fresh air in",
    "the museum is closed on monday mornings",
    "he forgot his keys at the restaurant again",
    "the doctor said the results look very good",
    "our flight was delayed because of the storm",
    "they painted the kitchen a bright yellow color",
    "the new library has thousands of old maps",
)
"""A held set of plain sentences (no numbers or names whose spelling a model may choose)."""


def _espeak() -> str:
    path = shutil.which("espeak-ng")
    if path is None:
        raise ConfigError("espeak-ng is needed: apt-get install espeak-ng (make test's setup installs it)")
    return path


@functools.lru_cache(maxsize=256)
def _spoken(text: str, voice: str, words_per_minute: int) -> bytes:
    proc = subprocess.run(
        [_espeak(), "-v", voice, "-s", str(words_per_minute), "--stdout", text],
        capture_output=True,
        check=True,
        timeout=60,
    )
    return proc.stdout


def speak(text: str, *, voice: str = "en-us", words_per_minute: int = 160) -> npt.NDArray[np.float32]:
    """``text`` said by espeak-ng, as 16 kHz mono float32 samples."""
    import soundfile
    import soxr

    samples, rate = soundfile.read(io.BytesIO(_spoken(text, voice, words_per_minute)), dtype="float32")
    if samples.ndim > 1:
        samples = samples.mean(axis=1)
    if rate != RATE:
        samples = soxr.resample(samples, rate, RATE, quality="HQ")
    return np.asarray(samples, dtype=np.float32)


def with_noise(
    samples: npt.NDArray[np.float32], snr_db: float, rng: np.random.Generator
) -> npt.NDArray[np.float32]:
    """``samples`` with white noise at ``snr_db`` below the power of their non-silent part."""
    loud = samples[np.abs(samples) > 1e-3]
    power = float(np.mean(loud**2)) if loud.size else 1e-6
    noise = rng.normal(0.0, np.sqrt(power / 10 ** (snr_db / 10)), samples.shape)
    return (samples + noise).astype(np.float32)


def conversation(
    seed: int,
    sentences: Sequence[str] = SENTENCES,
    *,
    count: int = 4,
    gap_s: tuple[float, float] = (0.8, 1.6),
    snr_db: float | None = None,
) -> tuple[npt.NDArray[np.float32], list[tuple[float, float, str]]]:
    """``count`` sentences (drawn by ``seed``) between silences of ``gap_s`` seconds, with
    noise at ``snr_db`` if given; the samples and each sentence's ``(start_s, end_s, text)``,
    from its first sound to its last."""
    rng = np.random.default_rng(seed)
    chosen = [sentences[i] for i in rng.choice(len(sentences), size=count, replace=count > len(sentences))]
    parts: list[npt.NDArray[np.float32]] = []
    truth: list[tuple[float, float, str]] = []
    at = 0
    for text in chosen:
        gap = np.zeros(int(rng.uniform(*gap_s) * RATE), np.float32)
        parts.append(gap)
        at += len(gap)
        voice = speak(text, words_per_minute=int(rng.integers(145, 175)))
        said = np.flatnonzero(np.abs(voice) > 1e-3)  # espeak-ng's own silence before and after
        voice = voice[said[0] : said[-1] + 1] if said.size else voice
        parts.append(voice)
        truth.append((at / RATE, (at + len(voice)) / RATE, text))
        at += len(voice)
    parts.append(np.zeros(int(gap_s[1] * RATE), np.float32))
    samples = np.concatenate(parts)
    if snr_db is not None:
        samples = with_noise(samples, snr_db, rng)
    return samples, truth


_PUNCT = re.compile(r"[^\w\s']")


def normalise(text: str) -> str:
    """Lower case, punctuation out (apostrophes kept), spaces collapsed."""
    return " ".join(_PUNCT.sub(" ", text.lower()).split())


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Word error rate of ``hypotheses`` against ``references`` (each pair one utterance, or
    one stream's words joined), over all their words."""
    import jiwer

    refs = [normalise(r) for r in references]
    hyps = [normalise(h) for h in hypotheses]
    return float(jiwer.wer(refs, hyps))
