"""`splitserve-worker` command line: `serve` a model, `simulate` a worker without one, and the checkpoint
writer's commands (worker_svc/checkpoints)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from common import limits
from common.cli_help import json_object, use_everywhere
from common.lifetime import exit_now, exit_with_launcher
from common.util import freeze_heap
from worker_svc.checkpoints.__main__ import add_commands as add_checkpoint_commands
from worker_svc.checkpoints.presets import PRESETS

# worker_svc.kernels.attention.NAMES, without importing torch for the parser
ATTENTION_NAMES = ("auto", "triton", "flash_attn", "torch")
KV_CACHE_DTYPE_NAMES = ("auto", "fp8")  # worker_svc.model.config.KV_CACHE_DTYPES
QUANTIZATION_NAMES = ("auto", "fp8", "packed", "none")  # worker_svc.runtime.model_runner.QUANTIZATIONS


def resolve_model(model: str) -> Path:
    """A checkpoint folder, or a preset name whose checkpoint is written once into the cache."""
    if Path(model).is_dir():
        return Path(model)
    if model in PRESETS:
        from worker_svc.checkpoints.writer import ensure_model  # torch import only for a preset

        return ensure_model(model)
    raise SystemExit(f"--model {model!r} is neither a checkpoint folder nor a preset ({', '.join(PRESETS)})")


KERNEL_CACHE_ENV = "SPLITSERVE_KERNEL_CACHE"


def use_kernel_cache(folder: str | None) -> None:
    """Compiled GPU kernels kept in `folder` across restarts: Triton's cache and flash-attn-4's (off by default).
    Before torch, Triton or flash-attn-4 are imported: they read these at import; tensor-parallel ranks inherit
    them."""
    if not folder:
        return
    os.environ["TRITON_CACHE_DIR"] = str(Path(folder) / "triton")
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] = str(Path(folder) / "flash_attn")


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def lora_modules(specs: list[str]) -> dict[str, str]:
    """--lora-modules NAME=PATH ... (or vLLM's JSON objects with "name" and "path") as a dict; SystemExit naming a
    malformed or repeated one."""
    out: dict[str, str] = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                entry = json.loads(spec)
                name, path = str(entry["name"]), str(entry["path"])
            except (ValueError, KeyError, TypeError):
                name = path = ""
        else:
            name, _, path = spec.partition("=")
        if not name or not path or name in out:
            raise SystemExit(f"splitserve-worker serve: --lora-modules takes distinct NAME=PATH pairs (or JSON objects "
                             f"with a name and a path), got {spec!r}")
        out[name] = path
    return out


def _serve(args: argparse.Namespace) -> int:
    import logging

    use_kernel_cache(args.kernel_cache_dir)

    from common import logs
    from worker_svc.model.config import ModelConfig
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    logs.setup(args.log_format, args.log_level)
    model_dir = resolve_model(args.model)
    try:
        # an architecture, a rope or a classifier this worker does not serve: say so, and stop
        ModelConfig.from_dir(model_dir, args.hf_overrides)
    except (ValueError, KeyError) as e:
        raise SystemExit(f"splitserve-worker serve: {model_dir}: {e}") from None
    config = RunnerConfig(
        device=args.device, dtype=args.dtype, block_size=args.block_size, num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        limits=args.limits, attention=args.attention, cuda_graphs=not args.no_cuda_graphs,
        kv_cache_dtype=args.kv_cache_dtype, kv_offload_bytes=int(args.kv_offload_gib * (1 << 30)),
        lora_modules=lora_modules(args.lora_modules), max_loras=args.max_loras, enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras, hf_overrides=args.hf_overrides,
        quantization=args.quantization)
    if args.tensor_parallel_size > 1:
        # This process is rank 0 (the leader); it spawns and drives ranks 1..N-1.
        from worker_svc.runtime.tensor_parallel import TensorParallelRunner

        runner = TensorParallelRunner(model_dir, config, args.tensor_parallel_size)
    else:
        runner = ModelRunner(model_dir, config)
    try:
        server = _start(runner, args)
        from worker_svc.runtime.kernel_builds import BUILDS

        BUILDS.serving_from_now()
        info = runner.describe()
        logging.getLogger("splitserve.worker").info(
            "serving %s on %s:%d: %s %s, KV cache %s, %d blocks of %d (and %d on the host), max_model_len %d, "
            "attention %s, TP %d, epoch %d", info.model, args.host, server.port, info.device, info.dtype,
            info.kv_cache_dtype, info.num_blocks, info.block_size, info.num_host_blocks, info.max_model_len,
            runner.kernels.attention.name,
            info.tensor_parallel_size, info.epoch)
        _run_until_signal(server, args)
    finally:
        runner.close()  # and the other tensor-parallel ranks
    return 0


def _simulate(args: argparse.Namespace) -> int:
    import logging

    from common import logs
    from worker_svc.runtime.simulated import SimulatedRunner, StepCost

    logs.setup(args.log_format, args.log_level)
    runner = SimulatedRunner(args.model, args.num_blocks, args.block_size, args.limits,
                             StepCost(args.base_ms, args.per_token_us, args.per_context_token_ns,
                                      args.host_copy_gb_s), int(args.kv_offload_gib * (1 << 30)))
    server = _start(runner, args)
    logging.getLogger("splitserve.worker").info("simulated worker on %s:%d, %d blocks of %d (and %d on the host)",
                                                args.host, server.port, args.num_blocks, args.block_size,
                                                runner.num_host_blocks)
    _run_until_signal(server, args)
    return 0


def _start(runner, args: argparse.Namespace):
    """The gRPC server over the runner, with metrics and the test knob when asked for."""
    from worker_svc.service.server import serve

    if args.debug_step_delay:
        _slow_down(runner, args.debug_step_delay)
    if args.metrics_port:
        from worker_svc.service.metrics import serve_metrics

        serve_metrics(runner, args.metrics_port, args.host)
    freeze_heap()
    return serve(runner, args.host, args.port, tls=args.tls)


def _slow_down(runner, seconds: float) -> None:
    """Testing only (--debug-step-delay): every step sleeps first, so tests can act while a request runs."""
    execute = runner.execute

    def slow_execute(plan):
        time.sleep(seconds)
        return execute(plan)

    runner.execute = slow_execute


def _run_until_signal(server, args: argparse.Namespace) -> None:
    """Serves until SIGTERM/SIGINT, registered with --scheduler if given; then drains: the scheduler is told
    first (Deregister: nothing new comes, running requests get --shutdown-grace, the rest moves to other
    workers), and the server stops after. Without --scheduler the server stops within --shutdown-grace and
    the scheduler moves what was left when the stream ends."""
    import signal
    import threading

    from worker_svc.service.registrar import Registrar, advertise_address

    service = server.service
    registrar = None
    if args.scheduler:
        address = args.advertise_address or advertise_address(args.host, server.port)
        registrar = Registrar(service, args.scheduler, address, args.register_backoff_max, tls=args.tls,
                              secret=args.registration_secret).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    grace = args.shutdown_grace
    if registrar is not None and registrar.deregister(grace):
        grace = 1.0  # the scheduler has closed the stream already
    service.drain()
    if registrar is not None:
        registrar.close()
    server.server.stop(grace=grace).wait()


def _add_membership_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheduler", metavar="HOST:PORT",
                   help="register with this scheduler (retrying with backoff, again after it restarts) and "
                        "deregister on SIGTERM; without it, the scheduler's --worker list names this worker")
    p.add_argument("--advertise-address", metavar="HOST:PORT",
                   help="where the scheduler reaches this worker (default: --host:--port, or the host name "
                        "when listening on all interfaces)")
    p.add_argument("--register-backoff-max", type=float, default=10.0,
                   help="registration retries back off from 0.5 s up to this many seconds (default 10)")
    p.add_argument("--shutdown-grace", type=float, default=5.0,
                   help="on SIGTERM, seconds running requests may still run here before they move to other "
                        "workers (default 5)")


def _add_security_arguments(p: argparse.ArgumentParser) -> None:
    """TLS on this worker's port and on its registration link (common/security.py)."""
    from common import security

    security.add_tls_arguments(p)
    security.add_registration_arguments(p)


def _load_security(args: argparse.Namespace) -> None:
    """args.tls and args.registration_secret, from the flags; raises SecurityConfigError."""
    from common import security

    args.tls = security.tls_from_args(args)
    args.registration_secret = security.registration_secret_from_args(args)


def _add_observability_arguments(p: argparse.ArgumentParser) -> None:
    from common import logs

    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics on this port (0: off)")
    logs.add_arguments(p)


def _add_service_arguments(p: argparse.ArgumentParser) -> None:
    """What `serve` and `simulate` share beyond the model: the test knob, membership, security, observability."""
    p.add_argument("--debug-step-delay", type=float, default=0.0,
                   help="testing only: sleep this many seconds before every step")
    _add_membership_arguments(p)
    _add_security_arguments(p)
    _add_observability_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve-worker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_checkpoint_commands(sub)

    p = sub.add_parser("serve", help="run the worker gRPC service")
    p.add_argument("--model", required=True, help="checkpoint folder, or a preset name (written once)")
    p.add_argument("--host", default="127.0.0.1", help="listen address of the worker's gRPC service")
    p.add_argument("--port", type=int, default=50061, help="port of the worker's gRPC service")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    p.add_argument("--block-size", type=int, help="tokens per KV block; default 256 on a GPU, 16 on a CPU")
    p.add_argument("--num-blocks", type=int, help="KV blocks; default: from the memory budget")
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="KV bytes on a CPU")
    p.add_argument("--kv-offload-gib", "--kv-offloading-size", type=float, default=0.0, metavar="GIB",
                   dest="kv_offload_gib",
                   help="host (pinned) memory for KV blocks behind the GPU's: preempted sequences and evicted "
                        "prefixes come back from it instead of being recomputed (0: off). On a GPU the worker "
                        "drops it at start where a block's copy in takes longer than its prefill (it logs both). "
                        "The second spelling: vLLM's")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory this worker may use in all (weights, activations, KV, graphs)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters to serve beside the weights (PEFT folders: adapter_config.json, "
                        "adapter_model.safetensors), each by its name; a request names one (GenerateRequest.lora, "
                        "the gateway's `model`); vLLM's JSON form too: '{\"name\": ..., \"path\": ...}'")
    p.add_argument("--enable-lora", action="store_true",
                   help="vLLM's: LoRA slots even with no --lora-modules, for adapters loaded while serving "
                        "(--max-loras then defaults to 1)")
    p.add_argument("--max-loras", type=_non_negative, default=0, metavar="N",
                   help="LoRA adapter slots on the device: the most adapters one step runs under; the scheduler "
                        "moves the adapters requests need into them; every adapted step computes all slots' ranks "
                        "(default: as many as --lora-modules; 0 of them: no LoRA)")
    p.add_argument("--max-cpu-loras", type=_non_negative, default=0, metavar="N",
                   help="LoRA adapters held in host memory, ready for a slot, of those served (--lora-modules and "
                        "adapters loaded while serving): the scheduler drops the least recently used one for room and "
                        "has it read again from its folder when a request needs it (default: --max-loras or as many "
                        "as --lora-modules, whichever is more)")
    p.add_argument("--max-lora-rank", type=_non_negative, default=0, metavar="R",
                   help="the largest adapter rank a slot takes (default: 16, or the largest of --lora-modules)")
    p.add_argument("--hf-overrides", type=json_object, default="{}", metavar="JSON",
                   help="a JSON object over config.json's top-level keys as this worker reads them (vLLM's "
                        "--hf-overrides: the architecture, shapes, rope, a classifier head; the scheduler learns the "
                        "model's length and labels from the worker); Qwen3-Reranker as published, as a cross-encoder: "
                        "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                        "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}' "
                        "(default: none)")
    limits.add_arguments(p)
    p.add_argument("--attention", default="auto", choices=ATTENTION_NAMES,
                   help="flash_attn: flash-attn-4 for prefills (Hopper/Blackwell), splitserve's split-KV Triton "
                        "kernel for decodes; triton: Triton kernels for both (any CUDA GPU from Ampere); torch: "
                        "the reference; auto: flash_attn where it imports (not over an fp8 KV cache), else triton "
                        "on a GPU, else torch")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_NAMES,
                   help="auto: K and V in the model's dtype; fp8: e4m3 with a scale per layer and tensor (the "
                        "checkpoint's k_scale / v_scale, else 1): about twice the KV blocks, outputs not "
                        "bit-identical to the model's dtype")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_NAMES,
                   help="the projections' GEMMs. auto: an FP8 checkpoint's (128 x 128 blocks: Qwen3's -FP8, "
                        "DeepSeek-V3's) in FP8 where the GPU has cuBLAS's block-scaled GEMM (sm_90, CUDA >= 12.9), "
                        "each input quantised per token and 128 columns; dequantised to 16 bits elsewhere; fp8: any "
                        "checkpoint's projections quantised to such blocks at load (half their memory; outputs not "
                        "bit-identical); packed: an AWQ, GPTQ or pack-quantized checkpoint's 2/4/8-bit integer "
                        "groups kept as stored (a quarter of the 16-bit memory at 4 bits; each GEMM dequantises its "
                        "weight first, about twice a 16-bit one's time at decode rows); none: 16-bit GEMMs. MoE "
                        "experts of whole blocks in FP8 too; embeddings, the LM head, routers and MLA's absorbed "
                        "kv_b_proj stay 16-bit")
    p.add_argument("--kernel-cache-dir", default=os.environ.get(KERNEL_CACHE_ENV) or None, metavar="PATH",
                   help="keep compiled GPU kernels (Triton's and flash-attn-4's) here across restarts: a restarted "
                        f"worker loads them instead of compiling (default: ${KERNEL_CACHE_ENV}; without it Triton's "
                        "~/.triton/cache and flash-attn-4 in memory only)")
    p.add_argument("--no-cuda-graphs", "--enforce-eager", action="store_true", dest="no_cuda_graphs",
                   help="run decode steps eagerly, not as CUDA graphs (the second spelling: vLLM's)")
    p.add_argument("--tensor-parallel-size", "--tp", "-tp", type=int, default=1,
                   help="ranks (GPUs cuda:K..cuda:K+N-1, or CPU processes) in this worker group; "
                        "this process is rank 0 and spawns the others")
    _add_service_arguments(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("simulate", help="run a simulated worker: same protocol, no model, GPU-like step times")
    p.add_argument("--model", required=True, help="checkpoint folder (only config.json is read)")
    p.add_argument("--host", default="127.0.0.1", help="listen address of the worker's gRPC service")
    p.add_argument("--port", type=int, default=50061, help="port of the worker's gRPC service")
    p.add_argument("--block-size", type=int, default=256, help="tokens per (simulated) KV block")
    p.add_argument("--num-blocks", type=int, default=4096, help="(simulated) KV blocks reported at handshake")
    limits.add_arguments(p, limits.Limits(max_num_seqs=512, max_num_batched_tokens=16384))
    from worker_svc.runtime.simulated import StepCost  # protobuf only, no torch

    cost = StepCost()
    p.add_argument("--base-ms", type=float, default=cost.base_ms, help="a step's fixed time, ms")
    p.add_argument("--per-token-us", type=float, default=cost.per_token_us, help="a step's time per token run, us")
    p.add_argument("--per-context-token-ns", type=float, default=cost.per_context_token_ns,
                   help="a step's time per context token its decodes read, ns")
    p.add_argument("--kv-offload-gib", type=float, default=0.0, metavar="GIB",
                   help="a (simulated) host KV tier of this many GiB of the model's bfloat16 blocks (0: off); "
                        "none where a block's copy costs more than its prefill by the cost model")
    p.add_argument("--host-copy-gb-s", type=float, default=cost.host_copy_gb_s,
                   help="a block copy's speed between the GPU and the host tier, GB/s")
    _add_service_arguments(p)
    p.set_defaults(func=_simulate)
    return use_everywhere(parser)


def main(argv: Sequence[str] | None = None) -> int:
    exit_with_launcher()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("serve", "simulate"):  # refuse to start without TLS material or --plaintext
        from common.security import SecurityConfigError

        try:
            args.limits = limits.from_args(args)
            _load_security(args)
        except (ValueError, SecurityConfigError) as e:
            parser.exit(2, f"{parser.prog} {args.command}: error: {e}\n")
        exit_now(args.func(args))
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
