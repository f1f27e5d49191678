"""`splitserve-gateway`: an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
/health) in front of a splitserve scheduler, served by uvicorn."""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from client.channel import add_security_arguments, security_from_args
from common.cli_help import use_everywhere
from common.util import available_cpus, freeze_heap
from gateway import harmony
from gateway.reasoning import REASONING_PARSERS
from gateway.tool_parsers import PARSERS

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gateway.app import GatewayConfig

DEFAULT_PORT = 8000
API_KEY_ENV = "SPLITSERVE_API_KEY"  # one key, or several separated by commas (e.g. from a Secret)
SCHEDULER_API_KEY_ENV = "SPLITSERVE_SCHEDULER_API_KEY"  # the key the gateway presents to the scheduler
ARGV_ENV = "SPLITSERVE_GATEWAY_ARGV"  # how uvicorn's worker processes get the command line (JSON list)


def default_workers(cpus: int) -> int:
    """HTTP worker processes by cores: a streamed token costs a gateway process about what it costs a
    scheduler front-end, so the gateway gets as many of them as the scheduler tree could feed."""
    return max(2, min(8, cpus // 2))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve-gateway", description=__doc__)
    p.add_argument("--scheduler", default=os.environ.get("SPLITSERVE_ADDRESS", "127.0.0.1:50051"),
                   metavar="HOST:PORT", help="the scheduler's public gRPC address (default: $SPLITSERVE_ADDRESS "
                                             "or 127.0.0.1:50051)")
    add_security_arguments(p, "scheduler-", api_key_env=SCHEDULER_API_KEY_ENV, tls_env=False,
                           title="connection to the scheduler (gRPC)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address (0.0.0.0: all interfaces)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT})")
    p.add_argument("--workers", type=int, default=0,
                   help="HTTP server processes sharing the port, each with its own connection to the scheduler "
                        "(0: half the cores, $SPLITSERVE_CPUS or the affinity mask, 2 to 8)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every route but /health, /ping, /version, /metrics "
                        "and the API's document; repeat for several. Keys also "
                        f"come from ${API_KEY_ENV} (comma-separated) and --api-key-file. Without any, the "
                        "API is open")
    p.add_argument("--api-key-file", action="append", default=[], type=Path, metavar="PATH",
                   help="a file of API keys, one a line (e.g. a mounted secret); repeat for several")
    p.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="model name(s) clients use (default: the scheduler's, its checkpoint folder's name)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="checkpoint folder or tokenizer.json, to name logprob tokens by their text "
                        "(default: `token_id:N`)")
    p.add_argument("--reasoning-parser", choices=(*REASONING_PARSERS, harmony.REASONING_PARSER),
                   help="return a thinking model's reasoning apart, as reasoning_content: qwen3 (an answer "
                        "that opens <think>), deepseek_r1 (an answer that starts inside it: DeepSeek-R1, GLM-4.5, "
                        "Qwen3-Thinking-2507), openai_gptoss (gpt-oss's harmony messages: its analysis channel, and "
                        "its calls as with --tool-call-parser openai)")
    p.add_argument("--tool-call-parser", choices=sorted((*PARSERS, harmony.TOOL_CALL_PARSER)), default="hermes",
                   help="how tool_choice auto finds the calls a model writes (qwen3_coder: Qwen3-Coder's and Qwen3.5's "
                        "<function=...> blocks; minimax_m2: MiniMax-M2's <invoke> blocks; glm45 / glm47: GLM-4.5 to "
                        "4.7's <arg_key> / <arg_value> blocks; all with values read by the tool's schema; "
                        "deepseek_v3 / deepseek_v31: DeepSeek-V3's and R1's / V3.1's tool-call tokens; kimi_k2: "
                        "Kimi-K2's tool-call section, its ids kept; llama3_json: "
                        "Llama 3.1-3.3's answers that are JSON calls; mistral: Mistral's [TOOL_CALLS]; openai: "
                        "gpt-oss's harmony messages to functions.NAME, and its analysis channel as reasoning; hermes: "
                        "Qwen2.5 / Qwen3 <tool_call> JSON blocks; default)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="taken for vLLM's command lines, which need it for tool_choice auto: here auto always reads "
                        "calls with --tool-call-parser")
    p.add_argument("--request-timeout", type=float, metavar="SECONDS",
                   help="deadline of one generation; past it the answer is 504 (default: none)")
    p.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser calls (CORS) from this origin; `*` for any; repeat for several")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long running requests get to finish (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="of the gateway's log on stderr")
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    return use_everywhere(p)


def read_api_keys(keys: Sequence[str], files: Sequence[Path], env: str | None = None) -> frozenset[str]:
    out = {k.strip() for k in [*keys, *(env or "").split(",")] if k.strip()}
    for path in files:
        out |= {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}
    return frozenset(out)


def load(argv: Sequence[str]) -> tuple[argparse.Namespace, "GatewayConfig"]:
    """The command line checked and turned into the app's config; a bad one exits with a message."""
    from gateway.app import GatewayConfig

    args = build_parser().parse_args(argv)
    if args.workers < 0:
        raise SystemExit("splitserve-gateway: --workers must be at least 0 (0: by the cores)")
    try:
        keys = read_api_keys(args.api_key, args.api_key_file, os.environ.get(API_KEY_ENV))
    except OSError as e:
        raise SystemExit(f"splitserve-gateway: --api-key-file: {e}") from None
    if (args.api_key or args.api_key_file) and not keys:
        raise SystemExit("splitserve-gateway: --api-key / --api-key-file given, but no key in them")
    try:
        scheduler_security = security_from_args(args, "scheduler-")
    except ValueError as e:
        raise SystemExit(f"splitserve-gateway: {e}") from None
    config = GatewayConfig(scheduler=args.scheduler, scheduler_security=scheduler_security, api_keys=keys,
                           served_model_names=tuple(args.served_model_name),
                           tokenizer=args.tokenizer, reasoning_parser=args.reasoning_parser,
                           tool_call_parser=args.tool_call_parser, request_timeout=args.request_timeout,
                           allowed_origins=tuple(args.allowed_origin))
    return args, config


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode


def app_from_env() -> "FastAPI":
    """uvicorn's app factory, called in each HTTP worker process: the app of the command line in $ARGV_ENV."""
    from gateway.app import create_app

    args, config = load(json.loads(os.environ[ARGV_ENV]))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(config)
    freeze_heap()
    return app


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The HTTP workers' metrics meet in one folder (gateway/metrics.py), fresh for each start; set before
    # prometheus_client is first imported, which reads it then.
    metrics_dir = None
    if not os.environ.get(MULTIPROC_ENV):
        metrics_dir = os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="splitserve-gateway-metrics-")
    try:
        args, _ = load(argv)  # a bad command line fails here, before any worker process starts
        import uvicorn

        os.environ[ARGV_ENV] = json.dumps(argv)
        # uvloop, as every asyncio process of the project (common.util.run_loop); h11 is uvicorn's pure-Python
        # HTTP/1.1. With several workers uvicorn binds the port once and its processes accept from it; it
        # replaces one that dies.
        uvicorn.run("gateway.cli:app_from_env", factory=True,
                    workers=args.workers or default_workers(available_cpus()),
                    host=args.host, port=args.port, loop="uvloop", http="h11", lifespan="on",
                    log_level=args.log_level, access_log=not args.no_access_log,
                    timeout_graceful_shutdown=args.shutdown_timeout)
    finally:  # a caller in the same process (a test) must not inherit multiprocess mode
        if metrics_dir:
            os.environ.pop(MULTIPROC_ENV, None)
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
