"""Speech whose words are known: espeak-ng sentences between silences, with noise at a chosen
SNR, and the word error rate that scores captions against them."""

from __future__ import annotations

import numpy as np

from aisp.bench.speech import RATE, conversation, normalise, speak, with_noise, word_error_rate


def test_word_error_rate_counts_words_after_normalising() -> None:
    assert normalise("  Open the Window, please!  ") == "open the window please"
    assert word_error_rate(["open the window"], ["Open the window."]) == 0.0
    assert word_error_rate(["open the window"], ["open a window"]) == 1 / 3
    assert word_error_rate(["a b", "c d e f"], ["a b", "c d"]) == 2 / 6  # over all the words


def test_a_conversation_says_when_each_sentence_is_spoken() -> None:
    y, truth = conversation(3, count=2)
    assert y.dtype == np.float32 and len(truth) == 2
    for start, end, _ in truth:
        inside = y[int(start * RATE) : int(end * RATE)]
        before = y[int((start - 0.5) * RATE) : int(start * RATE)]
        assert np.abs(inside).max() > 0.05 and np.abs(before).max() < 1e-6
    assert conversation(3, count=2)[1] == truth  # seeded


def test_noise_is_at_the_asked_ratio() -> None:
    y = speak("open the window")
    noisy = with_noise(y, 10.0, np.random.default_rng(0))
    loud = np.abs(y) > 1e-3
    snr = 10 * np.log10(np.mean(y[loud] ** 2) / np.mean((noisy - y) ** 2))
    assert abs(snr - 10.0) < 0.5
