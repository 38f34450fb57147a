"""The reference HTTP apps that ``bench_serve.py`` measures ``aisp serve`` against.

* ``hello``: answers ``POST /v2/models/{m}/infer`` with a fixed OIP response after reading the
  body: the HTTP stack's ceiling (no decoding, no model).
* ``unbatched``: the same OIP request parsing and response encoding as ``aisp serve``, but one
  ONNX Runtime call per request, in the request's own handler (no batcher).
* ``asgi_hello`` and ``asgi_unbatched``: the same two as plain ASGI apps (no framework): the
  ceiling of the HTTP server itself, and the cheapest unbatched server on it.
* ``grpc_hello``: a grpc.aio server whose ModelInfer answers a constant: the ceiling of the
  Python gRPC stack, for perf_analyzer (it prints ``grpc 127.0.0.1:PORT``).

Run one: ``python benchmarks/serve_apps.py APP PORT [uvicorn|uvicorn-aisp|granian] [MODEL]`` (APP:
one of the five above; ``uvicorn-aisp``: uvicorn with ``aisp serve``'s own protocol, which sends
a response in one write); it prints ``http 127.0.0.1:PORT`` once it listens.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "fraud" / "model.onnx"
HELLO = (
    b'{"model_name":"fraud","model_version":"1","outputs":'
    b'[{"name":"score","datatype":"FP32","shape":[1,1],"data":[0.5]}]}'
)


def hello() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def infer(request: Request) -> Response:
        await request.body()
        return Response(HELLO, media_type="application/json")

    return Starlette(routes=[Route("/v2/models/{model}/infer", infer, methods=["POST"])])


def _answerer(model: Path) -> Any:
    """``answer(body, header_length) -> (body, headers)``: the OIP request decoded as ``aisp
    serve`` decodes it, one ONNX Runtime call, the response encoded as it encodes it."""
    import onnxruntime as ort

    from aisp.serve.oip.http_codec import encode_response, parse_request
    from aisp.serve.oip.request import Signature, TensorSignature

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    sig = Signature(
        "fraud", 512, (TensorSignature("features", "FP32", (18,)),), (TensorSignature("score", "FP32", (1,)),)
    )

    def answer(body: bytes, header_length: str | None) -> tuple[bytes, dict[str, str]]:
        req = parse_request(body, header_length, sig)
        (score,) = session.run(["score"], {"features": req.inputs[0].array})
        return encode_response(req, sig, "1", {"score": score})

    return answer


def unbatched(model: Path = MODEL) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from aisp.serve.oip.http_codec import HEADER_LENGTH

    answer = _answerer(model)

    async def infer(request: Request) -> Response:
        body, headers = answer(await request.body(), request.headers.get(HEADER_LENGTH))
        return Response(body, headers=headers)

    return Starlette(routes=[Route("/v2/models/{model}/infer", infer, methods=["POST"])])


async def _asgi_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _asgi_answer(send: Any, body: bytes, headers: dict[str, str]) -> None:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def asgi_hello() -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await _asgi_body(receive)
        await _asgi_answer(send, HELLO, {"content-type": "application/json"})

    return app


def asgi_unbatched(model: Path = MODEL) -> Any:
    from aisp.serve.oip.http_codec import HEADER_LENGTH

    answer = _answerer(model)
    header = HEADER_LENGTH.lower().encode()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        length = next((v.decode() for k, v in scope["headers"] if k == header), None)
        await _asgi_answer(send, *answer(await _asgi_body(receive), length))

    return app


APPS = {"hello": hello, "unbatched": unbatched, "asgi_hello": asgi_hello, "asgi_unbatched": asgi_unbatched}


def grpc_hello(port: int) -> None:
    """A grpc.aio server on uvloop whose ModelInfer answers a constant (the fraud model's output
    shape): the Python gRPC stack's own ceiling, for perf_analyzer. Prints ``grpc 127.0.0.1:PORT``."""
    import grpc
    import numpy as np
    from tritonclient.grpc import model_config_pb2 as mc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    answer = pb.ModelInferResponse(model_name="fraud", model_version="1")
    answer.outputs.add(name="score", datatype="FP32", shape=[1, 1])
    answer.raw_output_contents.append(np.zeros(1, np.float32).tobytes())
    config = mc.ModelConfig(name="fraud", platform="onnxruntime_onnx", max_batch_size=512)
    config.input.add(name="features", data_type=mc.TYPE_FP32, dims=[18])
    config.output.add(name="score", data_type=mc.TYPE_FP32, dims=[1])
    meta = pb.ModelMetadataResponse(name="fraud", versions=["1"], platform="onnxruntime_onnx")
    meta.inputs.add(name="features", datatype="FP32", shape=[-1, 18])
    meta.outputs.add(name="score", datatype="FP32", shape=[-1, 1])

    class Servicer(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
        async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
            rows = request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 1
            if rows == 1:
                return answer
            many = pb.ModelInferResponse(model_name="fraud", model_version="1")
            many.outputs.add(name="score", datatype="FP32", shape=[rows, 1])
            many.raw_output_contents.append(np.zeros(rows, np.float32).tobytes())
            return many

        async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
            return meta

        async def ModelConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ModelConfigResponse(config=config)

        async def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ServerMetadataResponse(name="grpc_hello", version="1")

        async def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ServerReadyResponse(ready=True)

        async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ModelReadyResponse(ready=True)

    async def serve() -> None:
        srv = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), srv)
        bound = srv.add_insecure_port(f"127.0.0.1:{port}")
        await srv.start()
        print(f"grpc 127.0.0.1:{bound}", flush=True)
        await srv.wait_for_termination()

    import uvloop

    uvloop.run(serve())  # as aisp serve's gRPC loop: the stack at its fastest


def main() -> None:
    kind, port = sys.argv[1], int(sys.argv[2])
    if kind == "grpc_hello":
        grpc_hello(port)
        return
    server = sys.argv[3] if len(sys.argv) > 3 else "uvicorn"
    if server == "granian":
        from granian import Granian
        from granian.constants import Interfaces, Loops

        print(f"http 127.0.0.1:{port}", flush=True)
        Granian(
            f"serve_apps:{kind}",
            address="127.0.0.1",
            port=port,
            interface=Interfaces.ASGI,
            loop=Loops.uvloop,
            factory=True,
            log_enabled=False,
            working_dir=Path(__file__).parent,
        ).serve()
        return
    import uvicorn

    sock = socket.create_server(("127.0.0.1", port))
    print(f"http 127.0.0.1:{sock.getsockname()[1]}", flush=True)
    make = APPS[kind]
    app = make(Path(sys.argv[4])) if len(sys.argv) > 4 and kind.endswith("unbatched") else make()
    http: Any = "httptools"
    if server == "uvicorn-aisp":  # uvicorn with aisp serve's protocol (a response in one write)
        from aisp.serve.http.errors import JsonErrorsHttpTools

        http = JsonErrorsHttpTools
    config = uvicorn.Config(app, log_level="warning", http=http, loop="uvloop", lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
