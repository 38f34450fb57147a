"""The captions example (`examples/captions/`) run for real: camera streams cut into 100 ms chunks
give what the whole streams give (final captions and on-screen text), the captions are close to
what was said and the screen text is the slide shown; after SIGKILLs at random moments and
restarts from checkpoints, the same again, each row once."""

from __future__ import annotations

import importlib.util
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aisp.bench.speech import normalise, word_error_rate
from tests.integration.test_exactly_once import ENV

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "captions"
STREAMS = 3


def _media() -> Any:
    spec = importlib.util.spec_from_file_location("captions_media_for_tests", EXAMPLE / "media.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def aisp_run(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "aisp.cli", "run", str(EXAMPLE / "pipeline.py"),
        "--param", f"streams={STREAMS}", "--output", str(out), "--dead-letter", str(out.with_suffix(".dl")),
        "--no-live", *extra,
    ]  # fmt: skip


def finals(out: Path) -> dict[tuple[str, str], list[tuple[float, float, str]]]:
    """(stream, kind) -> its final rows' (start, end, text), in time order."""
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    got: dict[tuple[str, str], list[tuple[float, float, str]]] = {}
    for r in rows:
        if r["final"]:
            got.setdefault((r["stream"], r["kind"]), []).append((r["start_s"], r["end_s"], r["text"]))
    return {k: sorted(v) for k, v in got.items()}


def same(
    a: dict[Any, list[tuple[float, float, str]]],
    b: dict[Any, list[tuple[float, float, str]]],
    text: Callable[[str], str] = str,
) -> None:
    """The same rows: the same ``text`` of each, times within one voice activity window (32 ms)."""
    assert set(a) == set(b)
    for key in a:
        assert [text(t) for *_, t in a[key]] == [text(t) for *_, t in b[key]], key
        for (s1, e1, _), (s2, e2, _) in zip(a[key], b[key], strict=True):
            assert abs(s1 - s2) <= 0.032 and abs(e1 - e2) <= 0.032, (key, s1, s2, e1, e2)


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], list[tuple[float, float, str]]]:
    """Each stream in one chunk."""
    out = tmp_path_factory.mktemp("captions") / "whole.jsonl"
    subprocess.run(aisp_run(out, "--param", "chunk_ms=1000000"), env=ENV, check=True, capture_output=True)
    assert out.with_suffix(".dl").read_text() == ""
    return finals(out)


def test_chunks_give_the_whole_streams_captions_and_screen_text(
    tmp_path: Path, whole: dict[tuple[str, str], list[tuple[float, float, str]]]
) -> None:
    out = tmp_path / "out.jsonl"
    subprocess.run(aisp_run(out, "--batch-rows", "7"), env=ENV, check=True, capture_output=True)
    got = finals(out)
    same(got, whole)
    media = _media()
    for s in range(STREAMS):
        name = f"cam-{s:02d}"
        _, truth = media.camera(s)
        said = " ".join(t for *_, t in got[(name, "caption")])
        assert word_error_rate([" ".join(t for *_, t in truth["speech"])], [said]) < 0.25, said
        screen = got[(name, "screen")]
        assert len(screen) >= int(truth["seconds"]) - 1  # a frame a second
        read = [text == media.slide(s, start) for start, _, text in screen]
        assert sum(read) >= 0.9 * len(read), screen  # the slide shown, read by OCR


def test_sigkill_and_restart_give_the_same_rows_once(
    tmp_path: Path, whole: dict[tuple[str, str], list[tuple[float, float, str]]]
) -> None:
    out = tmp_path / "out.jsonl"
    checkpoints = tmp_path / "chk"
    cmd = aisp_run(
        out, "--checkpoint-dir", str(checkpoints), "--checkpoint-interval-s", "0.3", "--rate", "60"
    )
    rng = random.Random(11)
    kills = 0
    for _ in range(2):  # each kill after a checkpoint the run made, at a random moment after it
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        seen = len(list(checkpoints.glob("chk-*"))) if checkpoints.exists() else 0
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if checkpoints.exists() and len(list(checkpoints.glob("chk-*"))) > seen:
                break
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.communicate()
    _, err = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE).communicate()
    assert kills == 2, err.decode()[-2000:]  # each mid-run: the run is seconds long
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    keys = [(r["stream"], r["kind"], r["start_s"], r["final"]) for r in rows if r["final"]]
    assert len(keys) == len(set(keys)), "a row was written twice"
    # the same words: a restored stream's sound differs from the whole's in the bands AAC coded
    # as noise (its decoder's random state is in no checkpoint), so Whisper may write a caption
    # with other capitals or punctuation
    same(finals(out), whole, text=normalise)


def test_served_over_a_websocket_each_chunk_is_answered_with_what_it_completed(
    whole: dict[tuple[str, str], list[tuple[float, float, str]]],
) -> None:
    """`aisp serve`: the cameras' chunks over one WebSocket, a garbage chunk among them; each
    chunk is answered, in order, with the captions and screen text it completed (the final
    caption of a sentence comes with the chunk whose sound ended it, before the stream ends),
    and the final captions are those of `aisp run`."""
    import base64
    import threading

    from websockets.sync.client import connect

    from tests.support.serving import aisp_serve, wait_http

    rows, _ = _media().rows(STREAMS)
    rows.insert(40, {"stream": "cam-99", "seq": 0, "video": b"not a transport stream " * 20})
    answers: list[tuple[float, Any]] = []
    with aisp_serve(
        str(EXAMPLE / "pipeline.py"), http=True, grpc=False, extra_args=("--param", "streams=0")
    ) as (
        addr,
        _,
    ):
        wait_http(addr["http"], timeout_s=120)
        with connect(f"ws://{addr['http']}/v1/pipelines/captions/ws", max_size=None) as ws:

            def read() -> None:
                for message in ws:
                    for line in (message.encode() if isinstance(message, str) else message).splitlines():
                        answers.append((time.monotonic(), json.loads(line)))

            reader = threading.Thread(target=read)
            reader.start()
            for r in rows:
                ws.send(json.dumps({**r, "video": base64.b64encode(r["video"]).decode()}))
                time.sleep(0.01)
            last_sent = time.monotonic()
            ws.send("")
            reader.join(120)
            assert not reader.is_alive()
    assert len(answers) == len(rows)  # one answer a chunk, in order
    assert "not an MPEG transport stream" in answers[40][1]["error"]
    made: list[tuple[float, dict[str, Any]]] = []
    for at, a in answers:
        made += [(at, x) for x in (a if isinstance(a, list) else [a]) if "kind" in x]
    captions: dict[tuple[str, str], list[tuple[float, float, str]]] = {}
    for _, x in made:
        if x["kind"] == "caption" and x["final"]:
            captions.setdefault((x["stream"], "caption"), []).append((x["start_s"], x["end_s"], x["text"]))
    same({k: sorted(v) for k, v in captions.items()}, {k: v for k, v in whole.items() if k[1] == "caption"})
    first_final = min(at for at, x in made if x["kind"] == "caption" and x["final"])
    assert first_final < last_sent  # streamed back as made, not at the end
    screen = {(x["stream"], x["start_s"], x["text"]) for _, x in made if x["kind"] == "screen"}
    assert screen <= {(k[0], s, t) for k, v in whole.items() if k[1] == "screen" for s, _, t in v}
    assert len(screen) >= sum(len(v) for k, v in whole.items() if k[1] == "screen") - 2 * STREAMS
