"""`python -m worker_svc.checkpoints`: write random-weight checkpoints and LoRA adapters (also `splitserve-worker
make-model`, `make-lora`, `list-presets`, `ensure-model`)."""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from worker_svc.checkpoints.presets import PRESETS


def _make_model(args: argparse.Namespace) -> int:
    from worker_svc.checkpoints.writer import make_model  # torch import only for this subcommand

    print(make_model(args.preset, args.out, seed=args.seed, max_shard_size=args.max_shard_size, dtype=args.dtype,
                     num_layers=args.num_layers))
    return 0


def _make_lora(args: argparse.Namespace) -> int:
    from worker_svc.checkpoints.writer import LORA_TARGETS, make_lora_adapter

    print(make_lora_adapter(args.model, args.out, rank=args.rank, alpha=args.alpha, seed=args.seed,
                            targets=tuple(args.targets or LORA_TARGETS)))
    return 0


def _list_presets(args: argparse.Namespace) -> int:
    for name, cfg in PRESETS.items():
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        print(
            f"{name:20} {cfg['architectures'][0]:20} hidden={cfg['hidden_size']} layers={cfg['num_hidden_layers']} "
            f"heads={cfg['num_attention_heads']}/{cfg.get('num_key_value_heads', cfg['num_attention_heads'])} "
            f"head_dim={head_dim} "
            f"intermediate={cfg.get('intermediate_size', 'none')} tied={cfg['tie_word_embeddings']} "
            f"dtype={cfg['dtype']}"
        )
    return 0


def _ensure_model(args: argparse.Namespace) -> int:
    from worker_svc.checkpoints.writer import ensure_model

    print(ensure_model(args.preset, seed=args.seed))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """The checkpoint commands, as subcommands of `sub` (this module's parser, and splitserve-worker's)."""
    p = sub.add_parser("make-model", help="write a random-weight checkpoint of a preset in Hugging Face layout")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="the architecture and shapes to write")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--seed", type=int, default=0, help="of the random weights")
    p.add_argument("--max-shard-size", default="2GB", help="e.g. 2GB, 500MB, 1GiB (default 2GB)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the preset's")
    p.add_argument("--num-layers", type=int, default=None,
                   help="keep only this many layers, each of the preset's shape (a model too large for the disk)")
    p.set_defaults(func=_make_model)

    p = sub.add_parser("make-lora", help="write a random LoRA adapter of a checkpoint in PEFT's layout (for "
                                         "`serve --lora-modules`)")
    p.add_argument("--model", required=True, type=Path, help="the checkpoint folder it adapts")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--rank", type=int, default=8, help="r: the rank of each A and B")
    p.add_argument("--alpha", type=float, default=16.0, help="lora_alpha: the delta is scaled by alpha / rank")
    p.add_argument("--targets", nargs="+", help="the projections it adapts, by name (default: every attention and MLP "
                                                "projection, q_proj ... down_proj)")
    p.add_argument("--seed", type=int, default=0, help="of the random weights")
    p.set_defaults(func=_make_lora)

    p = sub.add_parser("list-presets", help="list the named model configurations")
    p.set_defaults(func=_list_presets)

    p = sub.add_parser("ensure-model", help="write a preset's checkpoint into the cache once; print its folder")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="the architecture and shapes to write")
    p.add_argument("--seed", type=int, default=0, help="of the random weights")
    p.set_defaults(func=_ensure_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker_svc.checkpoints", description=__doc__)
    add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
