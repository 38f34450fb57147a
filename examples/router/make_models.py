"""Build the router example's two small models from workload-F synthetic data.

* ``triage.onnx``: a logistic regression that estimates how risky an event is (``risk`` =
  P(fraud), trained with balanced classes so suspicious events score high). It decides which
  scorer an event goes to.
* ``linear.onnx``: the cheap scorer, a plain logistic regression (output ``score``).

The expensive scorer is the fraud MLP of ``examples/fraud``. Both models here take the same
``features`` input (float32 [batch, 18]) and are written with ``onnx.helper``: Sub(mean),
Div(std), Gemm, Sigmoid. Deterministic for a seed.

Usage: ``python examples/router/make_models.py [--seed N]``
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from sklearn.linear_model import LogisticRegression

HERE = Path(__file__).resolve().parent
FRAUD = HERE.parent / "fraud" / "make_model.py"


def fraud_dataset(seed: int) -> tuple[np.ndarray, np.ndarray]:
    spec = importlib.util.spec_from_file_location("fraud_make_model", FRAUD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x, y = module.make_dataset(seed)
    return x, y


def logistic_onnx(clf: LogisticRegression, mean: np.ndarray, std: np.ndarray, output: str) -> onnx.ModelProto:
    inits = [
        numpy_helper.from_array(mean.reshape(1, -1).astype(np.float32), "mean"),
        numpy_helper.from_array(std.reshape(1, -1).astype(np.float32), "std"),
        numpy_helper.from_array(clf.coef_.T.astype(np.float32), "w"),
        numpy_helper.from_array(clf.intercept_.astype(np.float32), "b"),
    ]
    nodes = [
        helper.make_node("Sub", ["features", "mean"], ["centered"]),
        helper.make_node("Div", ["centered", "std"], ["scaled"]),
        helper.make_node("Gemm", ["scaled", "w", "b"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], [output]),
    ]
    graph = helper.make_graph(
        nodes,
        output,
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 18])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", 1])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    x, y = fraud_dataset(args.seed)
    x64 = x.astype(np.float64)
    mean, std = x64.mean(axis=0), np.maximum(x64.std(axis=0), 1e-6)
    xn = (x64 - mean) / std
    for name, output, weight in (("triage", "risk", "balanced"), ("linear", "score", None)):
        clf = LogisticRegression(max_iter=500, class_weight=weight).fit(xn, y)
        model = logistic_onnx(clf, mean, std, output)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        got = sess.run(None, {"features": x[:1000]})[0][:, 0]
        want = clf.predict_proba(xn[:1000])[:, 1]
        assert np.abs(got - want).max() < 1e-4, "ONNX graph disagrees with sklearn"
        onnx.save(model, str(HERE / f"{name}.onnx"))
        share = np.mean(sess.run(None, {"features": x})[0] > 0.5)
        print(f"{name}.onnx: {output} > 0.5 for {share:.1%} of events")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
