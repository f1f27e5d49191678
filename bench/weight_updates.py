"""What reading a checkpoint's weights into a running worker costs (UpdateWeights, LLM.update_weights), beside
starting a worker from it: an in-process LLM is built from checkpoint A (its start-up timed: load, KV cache, warm-up,
graphs), then reads B, A, B... (--updates times), each timed, and the checkpoint's bytes over that time.

python -m bench weight-updates --preset qwen3-0.6b --device cuda
python -m bench weight-updates --preset qwen3-tiny --device cpu --updates 2   # a smoke test
"""
from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.record import record
from offline.llm import LLM
from scheduler_svc.sampling import SamplingParams
from worker_svc.checkpoints.writer import make_model


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--updates", type=int, default=4, help="weight updates timed, alternating between the two")
    ap.add_argument("--out", default="bench/results/weight_updates.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        dtype = "float32" if args.device == "cpu" else "bfloat16"
        folders = [make_model(args.preset, Path(tmp) / name, seed=seed, dtype=dtype) for seed, name in enumerate("ab")]
        size = sum(f.stat().st_size for f in folders[1].glob("*.safetensors"))
        extra = {"num_blocks": 64, "block_size": 16} if args.device == "cpu" else {}
        start = time.perf_counter()
        with LLM(folders[0], device=args.device, **extra) as llm:
            rows = [{"run": "start-up from a", "seconds": round(time.perf_counter() - start, 3), "gb_per_s": None}]
            greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            for k in range(args.updates):
                folder = folders[(k + 1) % 2]
                llm.generate([[1, 2, 3, 4]], greedy, use_tqdm=False)  # the worker has served since the last update
                start = time.perf_counter()
                llm.update_weights(folder)
                took = time.perf_counter() - start
                rows.append({"run": f"update {k + 1} (to {folder.name})", "seconds": round(took, 3),
                             "gb_per_s": round(size / took / 1e9, 2)})
    record(args.out, "weight_updates", {**vars(args), "checkpoint_bytes": size}, rows)


if __name__ == "__main__":
    main()
