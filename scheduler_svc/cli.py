"""`splitserve-scheduler`: the public gRPC service over one or more worker groups.

Workers join statically (--worker, connected at start-up) or at run time: a worker started with
`--scheduler HOST:PORT` registers itself through the Membership service on the same port. A worker is
declared dead when its Execute stream ends, when it does not answer a keepalive ping within
--worker-keepalive-timeout (pings every --worker-keepalive-time), or when a step's result is overdue by
max(--step-timeout, --step-timeout-factor x its recent step time); its requests then move to the other
workers by recompute, and its address is retried with backoff up to --reconnect-backoff-max.

Every gRPC link is TLS (--tls-cert/--tls-key, --tls-ca for mutual TLS) unless --plaintext is given; who
may register workers and call the public API: common/security.py and deploy/README.md."""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from common import limits, logs, security
from common.cli_help import json_object, use_everywhere
from common.lifetime import exit_with_launcher
from common.util import run_loop
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.sampling import generation_defaults

SWITCH_INTERVAL_S = 0.0005


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve-scheduler", description=__doc__)
    p.add_argument("--model", required=True, type=Path, help="checkpoint folder (tokenizer and config are read)")
    p.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                   help="a worker group's leader; repeat for several (or none: workers register themselves)")
    p.add_argument("--host", default="127.0.0.1", help="listen address of the public gRPC API (0.0.0.0: all interfaces)")
    p.add_argument("--port", type=int, default=50051, help="port of the public gRPC API")
    g = p.add_argument_group("the process tree")
    g.add_argument("--frontends", type=int, default=0,
                   help="front-end processes serving the public API on the one port (0: half the cores, 1 to 8; "
                        "the cores are $SPLITSERVE_CPUS, else the CPU affinity mask)")
    g.add_argument("--engines", type=int, default=0,
                   help="engine processes: one per worker group up to this many, then groups share them "
                        "(0: the number of cores)")
    limits.add_arguments(p)
    defaults = SchedulerConfig()
    p.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                   help="queued requests per group before refusing")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of a shared prompt prefix (vLLM's flag)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=defaults.long_prefill_token_threshold,
                   help="vLLM's: the most tokens a prompt's chunk takes in a step while other prompts wait for theirs "
                        "(what budget is left goes back to the cut chunks); 0: max(block size, "
                        "--max-num-batched-tokens / 4)")
    p.add_argument("--chat-template", metavar="TEMPLATE",
                   help="vLLM's: the jinja chat template requests' messages are rendered with in place of the "
                        "checkpoint's (a file, or the template itself)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="vLLM's: a request may bring a chat template of its own (ChatPrompt.chat_template, the "
                        "gateway's chat_template field), rendered in jinja's sandbox, which keeps it from the host but "
                        "not from spending the front-end's time; without it such requests get INVALID_ARGUMENT")
    p.add_argument("--pipeline-depth", type=int, default=defaults.pipeline_depth,
                   help="steps in flight per worker (1: wait for each step's result before planning)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve LoadLoraAdapter and UnloadLoraAdapter (the gateway's /v1/load_lora_adapter, "
                        "/v1/unload_lora_adapter; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): any caller of the API "
                        "may then have the workers read adapter folders off their file systems")
    p.add_argument("--allow-weight-updates", action="store_true",
                   help="serve UpdateWeights (the gateway's /update_weights_from_disk, SGLang's): any caller of the "
                        "API may then have the workers read a checkpoint folder off their file systems in place of "
                        "the weights they serve")
    p.add_argument("--lora-resolver-dir", default=None,
                   help="a request naming a LoRA adapter that no worker serves has the workers load the folder of "
                        "that name in this directory first, where there is one (vLLM's filesystem resolver, "
                        "VLLM_LORA_RESOLVER_CACHE_DIR); it takes turns in the workers' host memory with the others")
    p.add_argument("--generation-config", default="auto", metavar="{auto,vllm,FOLDER}",
                   help="auto: a request that leaves temperature, top_p, top_k, min_p, repetition_penalty or "
                        "max_tokens unset takes the model's generation_config.json value where it sets one (as "
                        "vLLM's default); vllm: the server's own defaults only; a folder: its generation_config.json's")
    p.add_argument("--override-generation-config", type=json_object, default=None, metavar="JSON",
                   help='generation_config.json fields set over those --generation-config reads, e.g. '
                        '\'{"temperature": 0.5, "max_new_tokens": 512}\' (as vLLM\'s)')
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics on this port (0: off)")
    p.add_argument("--debug-table-delay", type=float, default=0.0, help="testing only: front-ends other than the "
                   "first wait this many seconds before reading each table of worker groups the supervisor sends")
    g = p.add_argument_group("worker failure detection and membership (seconds)")
    g.add_argument("--worker-keepalive-time", type=float, default=10.0,
                   help="heartbeat: keepalive ping interval on each worker channel (default 10)")
    g.add_argument("--worker-keepalive-timeout", type=float, default=10.0,
                   help="a worker that does not acknowledge a ping within this is dead (default 10)")
    g.add_argument("--step-timeout", type=float, default=30.0,
                   help="a step whose result is overdue by max(this, --step-timeout-factor x the recent step "
                        "time) means the worker is dead, even with its socket open (default 30)")
    g.add_argument("--step-timeout-factor", type=float, default=50.0, help="see --step-timeout (default 50)")
    g.add_argument("--worker-connect-timeout", type=float, default=600.0,
                   help="how long start-up waits for each --worker to come up (default 600)")
    g.add_argument("--reconnect-timeout", type=float, default=10.0,
                   help="one attempt to reach a failed or registering worker (default 10)")
    g.add_argument("--reconnect-backoff-max", type=float, default=10.0,
                   help="retries of a failed worker's address back off from 0.5 s up to this (default 10)")
    security.add_tls_arguments(p, client_auth_option=True)
    g = p.add_argument_group("worker registration")
    security.add_registration_arguments(g)
    security.add_api_key_arguments(p)
    logs.add_arguments(p)
    return use_everywhere(p)


def watch_config(args: argparse.Namespace):
    from scheduler_svc.grpc_executor import WatchConfig

    return WatchConfig(keepalive_time=args.worker_keepalive_time, keepalive_timeout=args.worker_keepalive_timeout,
                       step_timeout=args.step_timeout, step_timeout_factor=args.step_timeout_factor)


def load_security(args: argparse.Namespace) -> None:
    """Reads the TLS material, registration secret and API keys into args (tls, registration_secret,
    api_keys). Raises security.SecurityConfigError."""
    args.tls = security.tls_from_args(args)
    args.registration_secret = security.registration_secret_from_args(args)
    args.api_keys = security.api_keys_from_args(args)


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags, the config and the security material; exits with status 2 on anything unusable."""
    args = parser.parse_args(argv)
    try:
        args.config = SchedulerConfig(limits=limits.from_args(args), max_waiting=args.max_waiting,
                                      enable_prefix_caching=args.enable_prefix_caching,
                                      long_prefill_token_threshold=args.long_prefill_token_threshold,
                                      pipeline_depth=args.pipeline_depth)
        args.sampling_defaults = generation_defaults(args.model, args.generation_config,
                                                     args.override_generation_config)
        if args.chat_template is not None:
            from scheduler_svc.tokenizer import read_chat_template

            args.chat_template = read_chat_template(args.chat_template)
        if args.frontends < 0 or args.engines < 0:
            raise ValueError("--frontends and --engines must be at least 0 (0: automatic)")
    except ValueError as e:
        parser.error(str(e))
    try:
        load_security(args)
    except security.SecurityConfigError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    return args


def parse_child_args(argv: list[str]) -> argparse.Namespace:
    """In a process of the tree: the supervisor's command line, parsed again (TLS files are read again, so
    each process watches them for rotation), with its logging set up."""
    args = _parse(build_parser(), argv)
    logs.setup(args.log_format, args.log_level)
    # A step's result must get the GIL at once, not after the default 5 ms switch interval of another thread.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from scheduler_svc import supervisor

    exit_with_launcher()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(build_parser(), argv)
    logs.setup(args.log_format, args.log_level)
    if args.sampling_defaults:
        logging.getLogger("splitserve.scheduler").info(
            "sampling defaults from the generation config (--generation-config %s): %s", args.generation_config,
            args.sampling_defaults)
    run_loop(supervisor.run(args, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
