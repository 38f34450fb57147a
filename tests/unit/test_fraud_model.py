"""The workload-F fraud model, event generator, reference and baselines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.baselines import compare_outputs, is_valid, run_hand, run_naive, run_validating  # noqa: E402
from benchmarks.workload import BAD_KINDS, parse_valid, reference_outputs, write_events  # noqa: E402

MODEL = ROOT / "examples" / "fraud" / "model.onnx"
KEYS = {"id", "user", "amount", "ts", "f"}
OUT_KEYS = {"id", "user", "score", "alert", "n", "mean_amount"}


@pytest.fixture(scope="module")
def sess() -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(MODEL), opts, providers=["CPUExecutionProvider"])


def test_model_signature(sess: ort.InferenceSession) -> None:
    (inp,) = sess.get_inputs()
    (out,) = sess.get_outputs()
    assert inp.name == "features"
    assert inp.type == "tensor(float)"
    assert inp.shape[1] == 18 and isinstance(inp.shape[0], str)
    assert out.name == "score"
    assert out.type == "tensor(float)"
    assert out.shape[1] == 1 and isinstance(out.shape[0], str)
    assert MODEL.stat().st_size < 100_000


def test_scores_are_probabilities(sess: ort.InferenceSession) -> None:
    rng = np.random.default_rng(1)
    x = np.empty((512, 18), dtype=np.float32)
    x[:, :16] = rng.standard_normal((512, 16)) * 3
    x[:, 16] = rng.integers(1, 50, 512)
    x[:, 17] = rng.lognormal(3.5, 1.5, 512)
    x[:3] = [[0.0] * 18, [50.0] * 16 + [1e6, 1e6], [-50.0] * 16 + [1.0, 0.01]]
    batched = sess.run(["score"], {"features": x})[0]
    assert batched.shape == (512, 1) and batched.dtype == np.float32
    assert np.all(np.isfinite(batched)) and np.all((batched >= 0) & (batched <= 1))
    assert 0.0 < float(batched.mean()) < 0.5
    single = np.concatenate([sess.run(["score"], {"features": x[i : i + 1]})[0] for i in range(32)])
    np.testing.assert_allclose(single, batched[:32], rtol=0, atol=1e-6)


def test_generator_is_deterministic_and_prefix_stable(tmp_path: Path) -> None:
    a, b, c, d = (tmp_path / n for n in ("a", "b", "c", "d"))
    write_events(a, 70_000, seed=3)
    write_events(b, 70_000, seed=3)
    write_events(c, 100, seed=3)
    write_events(d, 100, seed=4)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes().startswith(c.read_bytes())
    assert c.read_bytes() != d.read_bytes()
    lines = a.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 70_001
    assert lines[69_999].startswith(b'{"id":69999,')


def test_generator_format(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    write_events(path, 3000, seed=0)
    users = set()
    for i, line in enumerate(path.read_text().splitlines()):
        ev = json.loads(line)
        assert set(ev) == KEYS and ev["id"] == i
        # exactly what json.dumps writes without spaces: floats always carry a '.'
        assert json.dumps(ev, separators=(",", ":")) == line
        assert type(ev["amount"]) is float and ev["amount"] >= 0.01
        assert round(ev["amount"], 2) == ev["amount"]
        assert type(ev["ts"]) is int and ev["ts"] >= 1_700_000_000_000
        assert len(ev["f"]) == 16 and all(type(v) is float for v in ev["f"])
        assert ev["user"].startswith("u") and 0 <= int(ev["user"][1:]) < 100_000
        assert parse_valid(line) == ev
        users.add(ev["user"])
    assert len(users) > 2500


def test_generator_plants_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    k = 5
    write_events(path, 12 * k, seed=0, bad_every=k)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 12 * k
    bad = [i for i, line in enumerate(lines) if parse_valid(line) is None]
    assert bad == [i for i in range(12 * k) if (i + 1) % k == 0]
    kinds = {}
    for j, i in enumerate(bad):
        kinds[BAD_KINDS[j % len(BAD_KINDS)]] = lines[i]
    assert len(kinds) == 6
    with pytest.raises(ValueError):
        json.loads(kinds["not_json"])
    assert "user" not in json.loads(kinds["missing_field"])
    assert type(json.loads(kinds["wrong_type"])["amount"]) is str
    assert len(json.loads(kinds["short_f"])["f"]) == 15
    assert b'"amount":1e999,' in kinds["non_finite"]
    assert type(json.loads(kinds["float_id"])["id"]) is float


EDGE_LINES = [
    b'{"id":1,"user":"a","amount":1,"ts":5,"f":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}',  # ints: valid
    b'{"id":2,"user":"a","amount":2.5,"ts":5,"f":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,true]}',
    b'{"id":3,"user":"a","amount":2.5,"ts":5,"f":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,"1"]}',
    b'{"id":4,"user":"a","amount":2.5,"ts":5,"f":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,null]}',
    b'{"id":5,"user":"a","amount":2.5,"ts":5,"f":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,[1]]}',
    b'{"id":6,"user":"a","amount":true,"ts":5,"f":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}',
    b'{"id":true,"user":"a","amount":2.5,"ts":5,"f":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}',
    b'{"id":99999999999999999999,"user":"a","amount":2.5,"ts":5,"f":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}',
    b'{"id":9,"user":"a","amount":NaN,"ts":5,"f":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}',
    b'{"id":10,"user":7,"amount":2.5,"ts":5,"f":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}',
    b'{"id":11,"user":"true","amount":-2.5,"ts":5,"f":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15],"x":1}',
    b"[1,2,3]",
    b'"text"',
    b'{"id":14,"user":"a","amount":2.5,"ts":5.0,"f":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}',
    b'{"id":15,"user":"a","amount":2.5,"ts":5,"f":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,1e999]}',
    b'{"id":16,"user":"a","amount":2.5,"ts":5,"f":{"0":1}}',
    b"",
]


def test_validity_rules_agree(tmp_path: Path) -> None:
    parsed = [parse_valid(line) for line in EDGE_LINES]
    assert [ev["id"] for ev in parsed if ev is not None] == [1, 11]
    assert all(is_valid(ev) for ev in parsed if ev is not None)
    path = tmp_path / "edge.jsonl"
    path.write_bytes(b"\n".join(EDGE_LINES) + b"\n")
    for run in (run_naive, run_validating):
        out = tmp_path / f"{run.__name__}.jsonl"
        res = run(path, out, MODEL)
        assert res["events"] == 2 and res["invalid"] == len(EDGE_LINES) - 2
        got = [json.loads(line) for line in out.read_text().splitlines()]
        assert [g["id"] for g in got] == [1, 11]
        assert [(g["n"], g["mean_amount"]) for g in got] == [(1, 1.0), (1, -2.5)]


def test_baselines_agree_with_each_other_and_the_reference(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    write_events(path, 2000, seed=7, bad_every=50)
    out_naive, out_tuned = tmp_path / "naive.jsonl", tmp_path / "validating.jsonl"
    r_naive = run_naive(path, out_naive, MODEL)
    r_tuned = run_validating(path, out_tuned, MODEL)
    for r, name in ((r_naive, "naive"), (r_tuned, "validating")):
        assert r["name"] == name
        assert r["events"] == 1960 and r["invalid"] == 40
        assert r["events_per_s"] > 0 and r["p99_ms"] > 0 and r["peak_rss_mb"] > 0
    assert compare_outputs(out_naive, out_tuned) == []

    ref = reference_outputs(path, MODEL)
    assert len(ref) == 1960
    got = [json.loads(line) for line in out_tuned.read_text().splitlines()]
    assert [g["id"] for g in got] == sorted(ref)
    for g in got:
        assert set(g) == OUT_KEYS
        exp = ref[g["id"]]
        assert (g["user"], g["n"], g["mean_amount"]) == (exp["user"], exp["n"], exp["mean_amount"])
        assert abs(g["score"] - exp["score"]) <= 1e-6
        assert g["alert"] == (g["score"] > 0.9)


@pytest.mark.parametrize("seed", [3, 11, 29])
def test_the_hand_loop_agrees_with_the_validating_loop_on_clean_files(tmp_path: Path, seed: int) -> None:
    """Sizes around the 512-line chunk, few users (each user many times in a chunk: every rank
    level of the state update), seeded."""
    rng = np.random.default_rng(seed)
    events = int(rng.choice([1, 511, 512, 513, 1500])) + int(rng.integers(0, 3))
    path = tmp_path / "ev.jsonl"
    write_events(path, events, seed=seed)
    users = rng.integers(0, int(rng.integers(1, 40)), size=events).tolist()
    lines = [
        json.loads(line) | {"user": f"u{u}"}
        for line, u in zip(path.read_text().splitlines(), users, strict=True)
    ]
    path.write_text("".join(json.dumps(ev) + "\n" for ev in lines))
    out_hand, out_valid = tmp_path / "hand.jsonl", tmp_path / "valid.jsonl"
    r_hand = run_hand(path, out_hand, MODEL)
    r_valid = run_validating(path, out_valid, MODEL)
    assert r_hand["name"] == "hand" and r_hand["events"] == r_valid["events"] == events, f"seed {seed}"
    assert compare_outputs(out_valid, out_hand) == [], f"seed {seed}"
