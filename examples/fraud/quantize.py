"""Make the INT8 variant of the fraud model: ONNX Runtime dynamic quantization of its MatMuls.

Weights become int8; activations are quantized per batch at run time. Used for the bronze tier
(``examples/fraud/tiers.py``). Accuracy and speed against FP32: ``benchmarks/bench_int8.py``.

Usage: ``python examples/fraud/quantize.py [--model examples/fraud/model.onnx] [--out ...int8.onnx]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

from onnxruntime.quantization import QuantType, quantize_dynamic

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=HERE / "model.onnx")
    ap.add_argument("--out", type=Path, default=HERE / "model.int8.onnx")
    args = ap.parse_args(argv)
    quantize_dynamic(args.model, args.out, op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8)
    print(f"{args.out}: {args.out.stat().st_size} bytes (fp32: {args.model.stat().st_size})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
