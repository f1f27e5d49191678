"""How long a new call waits for a grpc.aio server that is busy streaming, with no scheduler behind it: the server
writes one message to each of --streams open calls every --tick seconds (an engine step's tokens), a load client
reads them, and once the load runs a probe client opens --new-calls calls at once; each reports when its handler
started against when it was sent. Once the server is saturated the wait grows with the streams it writes to
(bench/NOTES.md).

    python -m bench grpc-accept [--streams 64,192,512] [--new-calls 256]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import time
from collections.abc import Sequence

from bench import common
from bench.grpc_stream import METHOD, _loop_runner, start_server
from client.channel import CHANNEL_OPTIONS  # a connection per channel


def _server(tick: float, write_slots: int, ports, delays) -> None:
    from protos import splitserve_pb2 as api

    waiting: list[asyncio.Future] = []
    new: list[float] = []
    slots = asyncio.Semaphore(write_slots) if write_slots else contextlib.nullcontext()

    async def generate(request, context) -> None:
        if request.request_id:  # a probe: its send time
            new.append(time.time() - float(request.request_id))
            return
        while True:
            tick_done = asyncio.get_running_loop().create_future()
            waiting.append(tick_done)
            await tick_done
            async with slots:
                await context.write(api.GenerateResponse(text="x", token_ids=[1]))

    async def ticker() -> None:
        while True:
            await asyncio.sleep(tick)
            ready, waiting[:] = list(waiting), []
            for f in ready:
                if not f.done():
                    f.set_result(None)

    async def serve() -> None:
        server, port = await start_server(generate)  # held by this frame until the process is killed
        ports.put(port)
        asyncio.get_running_loop().create_task(ticker())
        while True:
            await asyncio.sleep(0.05)
            if new:
                delays.put(list(new))
                new.clear()

    _loop_runner("uvloop")(serve())


async def _calls(port: int, count: int, probe: bool, stop) -> int:
    """Opens `count` calls on 4 connections: the load's (read until `stop` is set; returns messages read) or the
    probe's (each carries its send time)."""
    import grpc

    from protos import splitserve_pb2 as api

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) for _ in range(4)]
    for channel in channels:
        await channel.channel_ready()
    calls = [c.unary_stream(METHOD, request_serializer=api.GenerateRequest.SerializeToString,
                            response_deserializer=api.GenerateResponse.FromString) for c in channels]
    read = 0

    async def one(i: int) -> None:
        nonlocal read
        async for _ in calls[i % 4](api.GenerateRequest(request_id=f"{time.time()}" if probe else "")):
            read += 1

    tasks = [asyncio.ensure_future(one(i)) for i in range(count)]
    if probe:
        await asyncio.gather(*tasks)
    else:
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        for t in tasks:
            t.cancel()
    for channel in channels:
        await channel.close()
    return read


def _client(port: int, count: int, probe: bool, stop, results) -> None:
    start = time.perf_counter()
    read = _loop_runner("uvloop")(_calls(port, count, probe, stop))
    results.put(read / (time.perf_counter() - start))


def measure(streams: int, new_calls: int, tick: float, write_slots: int = 0, warm_s: float = 3.0) -> dict:
    ctx = multiprocessing.get_context("spawn")
    ports, delays, results, stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_server, args=(tick, write_slots, ports, delays), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        load = ctx.Process(target=_client, args=(port, streams, False, stop, results))
        load.start()
        time.sleep(warm_s)
        probe = ctx.Process(target=_client, args=(port, new_calls, True, stop, results))
        probe.start()
        got: list[float] = []
        while len(got) < new_calls:
            got += delays.get(timeout=600)
        probe.join()
        results.get()  # the probe's
        stop.set()
        load_rate = results.get(timeout=60)
        load.join()
    finally:
        server.kill()
    got.sort()
    return {"streams": streams, "new_calls": new_calls, "tick_s": tick, "write_slots": write_slots,
            "load_messages_per_s": round(load_rate),
            "wait_ms_p50": round(got[len(got) // 2] * 1e3), "wait_ms_p90": round(got[int(len(got) * 0.9)] * 1e3),
            "wait_ms_max": round(got[-1] * 1e3)}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="64,192,512", help="open streams the server writes to every tick")
    ap.add_argument("--new-calls", type=int, default=256)
    ap.add_argument("--tick", type=float, default=0.005, help="seconds between the server's rounds of writes")
    ap.add_argument("--write-slots", type=int, default=0,
                    help="writes in flight at once over all streams (0: one per stream)")
    ap.add_argument("--out", default="bench/results/grpc_accept.json")
    args = ap.parse_args(argv)
    rows = []
    for streams in common.csv_numbers(args.streams, int):
        rows.append(measure(streams, args.new_calls, args.tick, args.write_slots))
        print(rows[-1], flush=True)
    args.model = "none (no model behind the streams)"
    common.save("bench.grpc_accept", argv, args.out, "grpc_accept", args, rows)


if __name__ == "__main__":
    main()
