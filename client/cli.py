"""`splitserve` command line: talk to a scheduler, or start one with a local worker (`up`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from pathlib import Path

import grpc

from client.channel import add_security_arguments, security_from_args
from client.client import GENERATION_SERVICE, Client, CompletionCollector, Delta
from client.launcher import LocalCluster
from common.cli_help import use_everywhere

DEFAULT_ADDRESS = os.environ.get("SPLITSERVE_ADDRESS", "127.0.0.1:50051")
DEFAULT_PRESET = "qwen3-small"
SAMPLE_PROMPT = "The capital of France is"
READY_TIMEOUT_S = 180.0


class _UsageError(Exception):
    """A command line that cannot be sent; reported like a gRPC error, without a traceback."""


def _this_command() -> str:
    """How to run this CLI again from the user's shell: `splitserve` where it is on PATH, else its full path
    (a virtual environment's bin/ is often not on PATH), else through Python."""
    if shutil.which("splitserve"):
        return "splitserve"
    me = Path(sys.argv[0])
    return str(me.resolve()) if me.name == "splitserve" else f"{sys.executable} -m client.cli"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _client(args: argparse.Namespace) -> Client:
    """A client of --address with the connection flags (TLS, API key)."""
    try:
        return Client(args.address, timeout=args.timeout, **security_from_args(args).kwargs())
    except ValueError as e:  # an unreadable certificate or key file, a half client certificate
        raise _UsageError(str(e)) from None


def _generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.token_ids is None):
        raise _UsageError("give exactly one of PROMPT or --token-ids")
    if args.token_ids is not None and args.chat:
        raise _UsageError("--chat needs a PROMPT, not --token-ids")
    if args.no_thinking and not args.chat:
        raise _UsageError("--no-thinking applies to --chat only")
    if args.max_tokens == 0 and args.prompt_logprobs is None:
        raise _UsageError("--max-tokens 0 needs --prompt-logprobs (it scores the prompt, generating nothing)")
    if args.chat:
        prompt = {"messages": [{"role": "user", "content": args.prompt}],
                  "enable_thinking": False if args.no_thinking else None}
    elif args.prompt is not None:
        prompt = {"prompt": args.prompt}
    else:
        prompt = {"token_ids": args.token_ids}
    with _client(args) as client:
        try:
            stream = client.generate(
                **prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos,
                min_tokens=args.min_tokens, logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs, n=args.n,
                priority=args.priority, bad_words=args.bad_word,
            )
        except ValueError as e:  # e.g. a number out of its protobuf field's range
            raise _UsageError(str(e)) from None
        with closing(stream):
            if args.json:
                _print_json(stream)
            else:
                _print_text(stream, args.n or 1)
    return 0


def _print_json(stream: Iterator[Delta]) -> None:
    """One object per delta; after a completion's last delta, one with its whole text, tokens and usage."""
    collector = CompletionCollector()
    for delta in stream:
        collector.add(delta)
        _write(json.dumps({"type": "delta", **dataclasses.asdict(delta)}, ensure_ascii=False) + "\n")
        if delta.finish_reason is not None:
            completion = collector.completion(delta.index)
            _write(json.dumps({"type": "completion", **dataclasses.asdict(completion)}, ensure_ascii=False) + "\n")


def _print_text(stream: Iterator[Delta], n: int) -> None:
    """Streams completion 0 as it arrives; with n > 1 the others follow it, each under a header."""
    others: dict[int, list[str]] = {}
    if n > 1:
        _write("--- completion 0 ---\n")
    tail = "\n"
    for delta in stream:
        if delta.index == 0:
            _write(delta.text)
            tail = delta.text[-1:] or tail
        else:
            others.setdefault(delta.index, []).append(delta.text)
    if tail != "\n":
        _write("\n")
    for index in sorted(others):
        text = "".join(others[index])
        _write(f"--- completion {index} ---\n{text}" + ("" if text.endswith("\n") else "\n"))


def _info(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(json.dumps(client.model_info(), indent=2))
    return 0


def _lora(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.path is not None:
            served = client.load_lora_adapter(args.name, args.path)
        else:
            served = client.unload_lora_adapter(args.name)
    print(json.dumps(served))  # the adapters served after the call
    return 0


def _reset_prefix_cache(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(client.reset_prefix_cache())  # the cached blocks dropped
    return 0


def _update_weights(args: argparse.Namespace) -> int:
    with _client(args) as client:
        # the worker groups that read them
        print(client.update_weights(args.path, abort_requests=args.abort_requests, weight_version=args.weight_version))
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    with _client(args) as client:
        ids = client.tokenize(args.text)
    print(",".join(map(str, ids)))  # the format `generate --token-ids` reads
    return 0


def _embed(args: argparse.Namespace) -> int:
    with _client(args) as client:
        got = client.embed(args.texts, dimensions=args.dimensions, lora=args.lora)
    for vector in got.vectors:
        print(json.dumps(vector))  # one JSON array a line, in the order of the texts
    return 0


def _classify(args: argparse.Namespace) -> int:
    with _client(args) as client:
        got = client.classify(args.texts, lora=args.lora)
    for probs in got.probs:
        print(json.dumps(dict(zip(got.labels, probs))))  # label -> probability, a line each, in the texts' order
    return 0


def _score(args: argparse.Namespace) -> int:
    with _client(args) as client:
        got = client.score(args.query, args.documents, lora=args.lora)
    for score in got.scores:
        print(f"{score:.6f}")
    return 0


def _health(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            status = client.health(args.service)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            print(f"error: the server has no health service {args.service!r} (it serves \"\" for the whole "
                  f"server and {GENERATION_SERVICE!r})", file=sys.stderr)
            return 2
    print(status)
    return 0 if status == "SERVING" else 1


# --- up: a scheduler and one local worker as child processes -------------------------------------------


def _resolve_model(model: str) -> Path | None:
    """A checkpoint folder as given, or the one `worker_svc.cli ensure-model` writes (or finds) for a preset."""
    if Path(model).is_dir():
        return Path(model).resolve()
    print(f"preparing model {model!r} ...", flush=True)
    done = subprocess.run([sys.executable, "-m", "worker_svc.cli", "ensure-model", "--preset", model],
                          stdout=subprocess.PIPE, text=True)  # stderr (progress, errors) goes to the terminal
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines or not Path(lines[-1].strip()).is_dir():
        print(f"error: {model!r} is neither a model folder nor a preset that could be prepared", file=sys.stderr)
        return None
    return Path(lines[-1].strip())


def _sample(client: Client) -> None:
    _write(f"sample (greedy, 32 tokens): {SAMPLE_PROMPT}")
    try:
        for delta in client.generate(SAMPLE_PROMPT, max_tokens=32, temperature=0.0, timeout=120):
            _write(delta.text)
        _write("\n")
    except grpc.RpcError as e:
        _write("\n")
        print(f"error: sample generation failed: {e.code().name}: {e.details()}", file=sys.stderr)


def _up(args: argparse.Namespace) -> int:
    # Ctrl-C, SIGTERM and SIGHUP stop it, also where it was started with SIGINT ignored (a background job)
    previous = {sig: signal.signal(sig, signal.default_int_handler)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    cluster: LocalCluster | None = None
    try:
        model = _resolve_model(args.model)
        if model is None:
            return 1
        cluster = LocalCluster(model, device=args.device or "cpu", port=args.port or 0,
                               worker_ports=[args.worker_port] if args.worker_port else [],
                               log_dir=Path(tempfile.mkdtemp(prefix="splitserve-up-")))
        print(f"starting a worker and a scheduler on {model}; logs in {cluster.log_dir}", flush=True)
        print("local demo: plaintext gRPC (--plaintext) on 127.0.0.1 only; for TLS and authentication see "
              "deploy/README.md", flush=True)
        started = time.monotonic()
        try:
            cluster.start(timeout=READY_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"ready after {time.monotonic() - started:.1f} s", flush=True)
        if not args.no_sample:
            with Client(cluster.address, **cluster.security.kwargs()) as client:
                _sample(client)
        print(f"serving at {cluster.address} (worker at 127.0.0.1:{cluster.worker_ports[0]}); Ctrl-C stops",
              flush=True)
        print(f'try: {_this_command()} generate --address {cluster.address} "Hello"', flush=True)
        while (dead := cluster.exited()) is None:
            time.sleep(0.5)
        print(f"error: the {dead.name} exited with code {dead.popen.returncode}; last lines of {dead.log_path}:\n"
              f"{dead.tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        if cluster is not None:
            cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# --- parser ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default=DEFAULT_ADDRESS,
                        help=f"scheduler HOST:PORT (default $SPLITSERVE_ADDRESS or {DEFAULT_ADDRESS})")
    common.add_argument("--timeout", type=float, help="deadline of the call in seconds")
    add_security_arguments(common)

    p = sub.add_parser("generate", parents=[common], help="stream a generation")
    p.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt text (or give --token-ids)")
    p.add_argument("--token-ids", type=_token_ids, metavar="1,2,3", help="prompt as token ids instead of text")
    p.add_argument("--chat", action="store_true", help="send PROMPT as one user message through the chat template")
    p.add_argument("--no-thinking", action="store_true", help="with --chat: Qwen3's enable_thinking=False")
    p.add_argument("--max-tokens", type=_non_negative_int,
                   help="most tokens to generate (default 16, capped by the model length; 0 only with "
                        "--prompt-logprobs: score the prompt alone)")
    p.add_argument("--min-tokens", type=_non_negative_int, help="tokens before EOS may end it (default 0)")
    p.add_argument("--temperature", type=float, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, help="nucleus sampling: the smallest set of tokens with this much "
                                               "probability (default 1.0 = off)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens (default 0 = off)")
    p.add_argument("--min-p", type=float, help="drop tokens below this share of the top token's probability "
                                               "(default 0 = off)")
    p.add_argument("--repetition-penalty", type=float, help="> 1 discourages tokens of the prompt and output "
                                                            "(default 1.0 = off)")
    p.add_argument("--presence-penalty", type=float, help="in [-2, 2]: subtracted once from tokens already "
                                                          "generated (default 0)")
    p.add_argument("--frequency-penalty", type=float, help="in [-2, 2]: subtracted per earlier occurrence in "
                                                           "the output (default 0)")
    p.add_argument("--seed", type=_non_negative_int, help="reproducible sampling (default: random)")
    p.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=int, metavar="ID", help="stop token (repeatable)")
    p.add_argument("--bad-word", action="append", metavar="WORD",
                   help="a word the output may not contain (vLLM's bad_words; repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate past EOS, to --max-tokens")
    p.add_argument("--n", type=_positive_int, help="completions of the prompt (default 1)")
    p.add_argument("--logprobs", type=_non_negative_int, metavar="N", help="logprobs of the sampled token and top N")
    p.add_argument("--prompt-logprobs", type=_non_negative_int, metavar="N",
                   help="logprobs of the prompt's tokens (after the first) and the top N, in --json output")
    p.add_argument("--priority", type=int, default=0, help="larger is more urgent")
    p.add_argument("--json", action="store_true", help="one JSON object per delta, then one per completion")
    p.set_defaults(func=_generate)

    p = sub.add_parser("info", parents=[common], help="print the served model's description")
    p.set_defaults(func=_info)

    p = sub.add_parser("load-lora", parents=[common],
                       help="load a LoRA adapter on every worker (a scheduler run with --allow-runtime-lora-updating); "
                            "print the adapters served then")
    p.add_argument("name", metavar="NAME", help="the adapter's name, as requests give it (--lora)")
    p.add_argument("path", metavar="PATH", help="its PEFT folder, as the workers see their file systems")
    p.set_defaults(func=_lora)

    p = sub.add_parser("unload-lora", parents=[common],
                       help="unload a LoRA adapter from every worker once the requests running under it have ended; "
                            "print the adapters served then")
    p.add_argument("name", metavar="NAME", help="the adapter's name")
    p.set_defaults(func=_lora, path=None)

    p = sub.add_parser("reset-prefix-cache", parents=[common],
                       help="drop every cached prefix no running request holds, on every worker (benchmark runs "
                            "that start cold); print how many cached blocks went")
    p.set_defaults(func=_reset_prefix_cache)

    p = sub.add_parser("update-weights", parents=[common],
                       help="have every worker read the model's weights again from another checkpoint of it (a "
                            "scheduler run with --allow-weight-updates), once the requests before have finished; "
                            "print how many worker groups did")
    p.add_argument("path", metavar="PATH", help="the checkpoint folder, as the workers see their file systems")
    p.add_argument("--abort-requests", action="store_true",
                   help="end the requests in flight at once (finish reason abort) instead of waiting for them")
    p.add_argument("--weight-version", default="", metavar="NAME",
                   help="a name for the new weights (e.g. the training step that saved them), which every completion "
                        "they compute carries (default: PATH)")
    p.set_defaults(func=_update_weights)

    p = sub.add_parser("tokenize", parents=[common], help="print the token ids of TEXT")
    p.add_argument("text", metavar="TEXT", help="the text to tokenize")
    p.set_defaults(func=_tokenize)

    p = sub.add_parser("embed", parents=[common], help="print each TEXT's embedding, a JSON array a line")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="the texts to embed")
    p.add_argument("--dimensions", type=int, help="the first n values of each (then normalised)")
    p.add_argument("--lora", default="", help="a LoRA adapter the workers serve, by name (default: the base model)")
    p.set_defaults(func=_embed)

    p = sub.add_parser("classify", parents=[common],
                       help="print a sequence classifier's probability of each label for each TEXT, a JSON object "
                            "a line")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="the texts to classify")
    p.add_argument("--lora", default="", help="a LoRA adapter the workers serve, by name (default: the base model)")
    p.set_defaults(func=_classify)

    p = sub.add_parser("score", parents=[common],
                       help="print QUERY's score against each DOCUMENT, a line each: the cosine similarity of their "
                            "embeddings, or a cross-encoder's probability")
    p.add_argument("query", metavar="QUERY", help="the text each DOCUMENT is scored against")
    p.add_argument("documents", nargs="+", metavar="DOCUMENT", help="the texts to score")
    p.add_argument("--lora", default="", help="a LoRA adapter the workers serve, by name (default: the base model)")
    p.set_defaults(func=_score)

    p = sub.add_parser("health", parents=[common], help="print the serving status; exit 0 when SERVING")
    p.add_argument("--service", default=GENERATION_SERVICE, help='health service name ("" = whole server)')
    p.set_defaults(func=_health)

    p = sub.add_parser("up", help="start a scheduler and one local worker, and run until interrupted")
    p.add_argument("--model", default=DEFAULT_PRESET, help=f"checkpoint folder or preset (default {DEFAULT_PRESET})")
    p.add_argument("--port", type=int, help="scheduler port (default: a free one)")
    p.add_argument("--worker-port", type=int, help="worker port (default: a free one)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="worker device (default: the worker's)")
    p.add_argument("--no-sample", action="store_true", help="skip the sample generation")
    p.set_defaults(func=_up)
    return use_everywhere(parser)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    except _UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
