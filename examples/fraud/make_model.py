"""Build the workload-F fraud model (``examples/fraud/model.onnx``) from synthetic data.

Deterministic for a given ``--seed``: synthetic events are drawn with numpy, per-user running
state (count and mean amount, both counting the current event) is computed exactly as the
pipeline computes it, labels come from a hidden rule, an sklearn ``MLPClassifier`` (18 -> 64 ->
32 -> 1) is trained, and its weights are written into an ONNX graph by hand with
``onnx.helper`` (no skl2onnx):

    features[batch, 18] -> Sub(mean) -> Div(std) -> MatMul+Add+Relu (64)
                        -> MatMul+Add+Relu (32) -> MatMul+Add+Sigmoid (1) -> score[batch, 1]

Feature order: ``f[0..15]``, then the user's running count ``n``, then the user's running mean
amount ``mean_amount``. The normalisation constants are baked into the graph, so raw ``n`` and
``mean_amount`` are fed as they are.

Usage: ``python examples/fraud/make_model.py [--out PATH] [--seed N]``
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPClassifier

N_F = 16
N_FEATURES = N_F + 2
N_USERS = 100_000
STREAM_EVENTS = 500_000
TRAIN_ROWS = 50_000
FRAUD_RATE = 0.03
ALERT_THRESHOLD = 0.9
OPSET = 17
IR_VERSION = 8  # the lowest IR that carries opset 17; every onnxruntime >= 1.13 loads it
DEFAULT_OUT = Path(__file__).resolve().parent / "model.onnx"


def synth_stream(n: int, seed: int) -> dict[str, np.ndarray]:
    """Draw ``n`` workload-F events and their per-user running state, in event order.

    The event distribution is the one ``benchmarks/workload.py`` writes: users uniform over
    ``N_USERS``, ``amount ~ lognormal(3, 1)`` rounded to cents, ``f ~ N(0, 1)`` with ``f[1]``
    correlated with ``log(amount)`` (so the amount is partly visible to the model).
    """
    rng = np.random.default_rng(seed)
    user = rng.integers(0, N_USERS, size=n, dtype=np.int64)
    z_amount = rng.standard_normal(n)
    amount = np.maximum(np.round(np.exp(3.0 + z_amount), 2), 0.01)
    f = rng.standard_normal((n, N_F))
    f[:, 1] = 0.8 * z_amount + 0.6 * f[:, 1]  # still N(0, 1)
    count, mean_amount = running_state(user, amount)
    return {"user": user, "amount": amount, "f": f, "n": count, "mean_amount": mean_amount}


def running_state(user: np.ndarray, amount: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-event running count and running mean (float64 sum / count), counting the event."""
    order = np.argsort(user, kind="stable")
    u_sorted = user[order]
    a_sorted = amount[order]
    idx = np.arange(len(user))
    starts = np.r_[True, u_sorted[1:] != u_sorted[:-1]]
    group_start = np.maximum.accumulate(np.where(starts, idx, 0))
    count_sorted = idx - group_start + 1
    csum = np.cumsum(a_sorted)
    before = np.where(group_start > 0, csum[np.maximum(group_start - 1, 0)], 0.0)
    sum_sorted = csum - before  # equals the left-to-right per-user sum up to float rounding
    count = np.empty_like(count_sorted)
    total = np.empty_like(sum_sorted)
    count[order] = count_sorted
    total[order] = sum_sorted
    return count, total / count


def hidden_logit(ev: dict[str, np.ndarray]) -> np.ndarray:
    """The rule the labels come from (the model only sees f, n and mean_amount)."""
    f = ev["f"]
    logit: np.ndarray = (
        1.5 * f[:, 0]
        - 1.2 * f[:, 3]
        + 0.8 * f[:, 9]
        + 0.9 * f[:, 5] * f[:, 6]
        + 1.2 * np.log(ev["amount"] / ev["mean_amount"])
        + 0.4 * (np.log(ev["mean_amount"]) - 3.5)
        - 0.5 * np.log1p(ev["n"])
    )
    return logit


def make_dataset(seed: int) -> tuple[np.ndarray, np.ndarray]:
    ev = synth_stream(STREAM_EVENTS, seed)
    rng = np.random.default_rng(seed + 1)
    z = hidden_logit(ev) + 0.3 * rng.logistic(size=STREAM_EVENTS)
    y = (z > np.quantile(z, 1.0 - FRAUD_RATE)).astype(np.int64)
    x = np.column_stack([ev["f"], ev["n"], ev["mean_amount"]]).astype(np.float32)
    rows = rng.choice(STREAM_EVENTS, size=TRAIN_ROWS, replace=False)
    rows.sort()
    return x[rows], y[rows]


def train(x: np.ndarray, y: np.ndarray, seed: int) -> tuple[MLPClassifier, np.ndarray, np.ndarray]:
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=0).astype(np.float32)
    std = np.maximum(x64.std(axis=0), 1e-6).astype(np.float32)
    xn = (x64 - mean) / std
    clf = MLPClassifier(
        hidden_layer_sizes=(64, 32),
        activation="relu",
        alpha=1e-4,
        batch_size=256,
        learning_rate_init=1e-3,
        max_iter=40,
        random_state=seed,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(xn, y)
    return clf, mean, std


def to_onnx(clf: MLPClassifier, mean: np.ndarray, std: np.ndarray, seed: int) -> onnx.ModelProto:
    if clf.out_activation_ != "logistic" or len(clf.coefs_) != 3:
        raise ValueError("expected a binary MLPClassifier with two hidden layers")
    inits: list[TensorProto] = [
        numpy_helper.from_array(mean.reshape(1, -1).astype(np.float32), "norm_mean"),
        numpy_helper.from_array(std.reshape(1, -1).astype(np.float32), "norm_std"),
    ]
    for i, (w, b) in enumerate(zip(clf.coefs_, clf.intercepts_, strict=True), start=1):
        inits.append(numpy_helper.from_array(np.asarray(w, dtype=np.float32), f"W{i}"))
        inits.append(numpy_helper.from_array(np.asarray(b, dtype=np.float32), f"B{i}"))
    nodes = [
        helper.make_node("Sub", ["features", "norm_mean"], ["centered"], name="norm_sub"),
        helper.make_node("Div", ["centered", "norm_std"], ["x0"], name="norm_div"),
        helper.make_node("MatMul", ["x0", "W1"], ["h1_mm"], name="fc1_matmul"),
        helper.make_node("Add", ["h1_mm", "B1"], ["h1_pre"], name="fc1_add"),
        helper.make_node("Relu", ["h1_pre"], ["h1"], name="fc1_relu"),
        helper.make_node("MatMul", ["h1", "W2"], ["h2_mm"], name="fc2_matmul"),
        helper.make_node("Add", ["h2_mm", "B2"], ["h2_pre"], name="fc2_add"),
        helper.make_node("Relu", ["h2_pre"], ["h2"], name="fc2_relu"),
        helper.make_node("MatMul", ["h2", "W3"], ["out_mm"], name="out_matmul"),
        helper.make_node("Add", ["out_mm", "B3"], ["logit"], name="out_add"),
        helper.make_node("Sigmoid", ["logit"], ["score"], name="out_sigmoid"),
    ]
    graph = helper.make_graph(
        nodes,
        "fraud_mlp",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", N_FEATURES])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        initializer=inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="aisp-examples-fraud",
        producer_version="1",
        doc_string=(
            "Workload-F fraud MLP 18->64->32->1. Input 'features' [batch,18] float32: "
            "f[0..15], running count n, running mean amount (both counting the event). "
            "Output 'score' [batch,1] float32: fraud probability."
        ),
    )
    model.ir_version = IR_VERSION
    helper.set_model_props(
        model,
        {
            "feature_order": ",".join([f"f{i}" for i in range(N_F)] + ["n", "mean_amount"]),
            "alert_threshold": str(ALERT_THRESHOLD),
            "seed": str(seed),
        },
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def session(model_bytes: bytes) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the ONNX model")
    parser.add_argument("--seed", type=int, default=0, help="seed for data and training")
    args = parser.parse_args(argv)

    t0 = time.perf_counter_ns()
    x, y = make_dataset(args.seed)
    t1 = time.perf_counter_ns()
    clf, mean, std = train(x, y, args.seed)
    t2 = time.perf_counter_ns()
    model = to_onnx(clf, mean, std, args.seed)
    blob = model.SerializeToString()

    sess = session(blob)
    xn = (x.astype(np.float64) - mean) / std
    ref = clf.predict_proba(xn[:1000])[:, 1]
    got = sess.run(["score"], {"features": x[:1000]})[0][:, 0]
    max_err = float(np.max(np.abs(got.astype(np.float64) - ref)))
    if max_err > 1e-5:
        raise SystemExit(f"ONNX output differs from sklearn by {max_err:.3g} (> 1e-5)")

    scores = sess.run(["score"], {"features": x})[0][:, 0]
    info: dict[str, Any] = {
        "rows": len(y),
        "fraud_rate": round(float(y.mean()), 4),
        "alert_rate": round(float(np.mean(scores > ALERT_THRESHOLD)), 4),
        "train_accuracy": round(float(clf.score(xn, y)), 4),
        "iterations": int(clf.n_iter_),
        "max_abs_err_vs_sklearn": max_err,
        "data_s": round((t1 - t0) / 1e9, 2),
        "train_s": round((t2 - t1) / 1e9, 2),
        "bytes": len(blob),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(blob)
    for k, v in info.items():
        print(f"{k}: {v}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
