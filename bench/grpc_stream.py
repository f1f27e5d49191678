"""The floor under a streamed token: CPU per message of a grpc.aio server-streaming call, on the writing side (a
front-end) and the reading side (a client), with no scheduler behind it. One server process writes --messages
GenerateResponses of one token on each of --streams concurrent calls; one client process reads them. Each event
loop (asyncio's own, uvloop) is measured in turn, alternating, --repeats times.

    python -m bench grpc-stream [--streams 256] [--messages 200] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from collections.abc import Sequence

from bench import common

METHOD = "/splitserve.v1.Generation/Generate"


def _loop_runner(loop: str):
    if loop == "uvloop":
        import uvloop

        return uvloop.run
    return asyncio.run


def _cpu_seconds(pid: int) -> float:
    import os

    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def start_server(generate):
    """A started grpc.aio server on a free loopback port whose Generate is the server-streaming `generate`
    (request, context), and that port."""
    import grpc

    from protos import splitserve_pb2 as api

    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(
        generate, request_deserializer=api.GenerateRequest.FromString,
        response_serializer=api.GenerateResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("splitserve.v1.Generation",
                                                                          {"Generate": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _server(loop: str, messages: int, ports) -> None:
    from protos import splitserve_pb2 as api

    async def generate(request, context) -> None:
        for i in range(messages):
            await context.write(api.GenerateResponse(request_id="r", text="x", token_ids=[i]))

    async def serve() -> None:
        server, port = await start_server(generate)
        ports.put(port)
        await server.wait_for_termination()

    _loop_runner(loop)(serve())


async def _read_all(port: int, streams: int) -> int:
    import grpc

    from protos import splitserve_pb2 as api

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(METHOD, request_serializer=api.GenerateRequest.SerializeToString,
                                    response_deserializer=api.GenerateResponse.FromString)

        async def one() -> int:
            return sum([1 async for _ in call(api.GenerateRequest())])

        return sum(await asyncio.gather(*(one() for _ in range(streams))))


def measure(loop: str, streams: int, messages: int) -> dict:
    """One server process and this process as the client, both on `loop`: us of CPU per message each side."""
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_server, args=(loop, messages, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        run = _loop_runner(loop)
        run(_read_all(port, 8))  # connection up, both sides warm
        server_cpu, client_cpu, start = _cpu_seconds(server.pid), time.process_time(), time.perf_counter()
        count = run(_read_all(port, streams))
        seconds = time.perf_counter() - start
        server_us = (_cpu_seconds(server.pid) - server_cpu) / count * 1e6
        client_us = (time.process_time() - client_cpu) / count * 1e6
    finally:
        server.kill()
    assert count == streams * messages, count
    return {"loop": loop, "messages": count, "seconds": round(seconds, 2), "messages_per_s": round(count / seconds),
            "server_cpu_us_per_message": round(server_us, 1), "client_cpu_us_per_message": round(client_us, 1)}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--messages", type=int, default=200, help="messages per stream")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loops", default="asyncio,uvloop")
    ap.add_argument("--out", default="bench/results/grpc_stream.json")
    args = ap.parse_args(argv)
    rows = []
    for repeat in range(1, args.repeats + 1):
        for loop in args.loops.split(","):
            rows.append({"repeat": repeat, **measure(loop, args.streams, args.messages)})
            print(rows[-1], flush=True)
    args.model = "none (no model behind the stream)"
    common.save("bench.grpc_stream", argv, args.out, "grpc_stream", args, rows)


if __name__ == "__main__":
    main()
