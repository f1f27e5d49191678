"""`splitserve-scheduler`: the public gRPC service over one or more worker groups."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from scheduler_svc.engine import EngineConfig

SWITCH_INTERVAL_S = 0.0005


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve-scheduler", description=__doc__)
    p.add_argument("--model", required=True, type=Path, help="checkpoint folder (tokenizer and config are read)")
    p.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                   help="a worker group's leader; repeat for several")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=0, help="0: the worker's")
    p.add_argument("--max-waiting", type=int, default=4096, help="queued requests per group before refusing")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-pipeline", action="store_true", help="wait for each step's result before planning")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    return p


async def _main(args: argparse.Namespace) -> None:
    from scheduler_svc.server import serve

    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, max_waiting=args.max_waiting,
                          enable_prefix_caching=not args.no_prefix_caching, pipeline=not args.no_pipeline)
    server, service, port = await serve(args.model, args.worker, args.host, args.port, config)
    logging.getLogger("splitserve.scheduler").info("serving on %s:%d with %d worker group(s)", args.host, port,
                                                   len(service.groups))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.drain(args.drain_timeout)
    await server.stop(grace=1.0)
    for group in service.groups:
        group.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.worker:
        raise SystemExit("splitserve-scheduler: give at least one --worker HOST:PORT")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # The engine thread must get the GIL back as soon as a step's result arrives, not after the default
    # 5 ms switch interval of the event loop thread: that wait would stall the worker every step.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
