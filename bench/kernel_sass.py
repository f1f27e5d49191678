"""The split-KV decode kernel compiled for a GPU on any machine (Triton's own ptxas, no GPU needed): registers,
shared memory and the instructions of its tile loop by opcode, per configuration: what a change removes, counted
before a GPU times it. A count is not a time: the fp16 dots took a quarter of the fp8 loop's instructions away
and, alone, no time, as each tile's latency bounds that kernel (bench/NOTES.md). Counts come from the Triton
installed here, which may differ from the GPU machine's.

python -m bench kernel-sass                                             # fp8: pointer loads, TMA, TMA + fp16 dots
python -m bench kernel-sass --configs bf16:128:512,bf16:128:512:tma --arch 90
(run with TRITON_INTERPRET unset: under the interpreter the kernel is not compiled)
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.record import record

CONFIGS = "fp8:64:256,fp8:64:256:tma,fp8:64:256:tma:f16"
TYPES = {"bf16": "bf16", "fp8": "fp8e4nv"}


def compile_kernel(kv: str, block_n: int, split: int, tma: bool, f16: bool, arch: int, num_warps: int = 4,
                   num_stages: int = 3, heads: int = 16, kv_heads: int = 8):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from worker_svc.kernels.decode_attention import _split_kernel, query_rows

    group = heads // kv_heads
    const = dict(KV_HEADS=kv_heads, GROUP=group, BLOCK_H=query_rows(group), HEAD_DIM=128, HEAD_PAD=128,
                 PAGE=256, BLOCK_N=block_n, SPLIT=split, TMA=tma, F16_DOTS=f16, SOFTCAP=False, SINKS=False)
    cache = f"tensordesc<{TYPES[kv]}[{block_n}, 128]>" if tma else f"*{TYPES[kv]}"
    pointers = {"Q": "*bf16", "Out": "*bf16", "K": cache, "V": cache, "PageTable": "*i32", "SeqUsed": "*i32",
                "Counters": "*i32", "Sinks": "*fp32", "PartO": "*fp32", "PartLse": "*fp32", "scale_log2e": "fp32",
                "v_scale": "fp32",
                "softcap_log2": "fp32"}
    signature = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in _split_kernel.arg_names}
    return triton.compile(ASTSource(_split_kernel, signature, constexprs=const), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_tool(name: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes of the tile loop: the longest span of a conditional backward branch (unconditional ones are the
    trampolines back from waits the compiler places after the kernel's end)."""
    instructions, labels, pending = [], {}, None
    for line in sass.splitlines():
        if m := re.match(r"^\s*\.(L_x_\d+):", line):
            pending = m.group(1)
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            address = int(m.group(1), 16)
            instructions.append((address, m.group(2)))
            if pending:
                labels[pending], pending = address, None
    loops = [(labels[m.group(1)], a) for a, text in instructions
             if (m := re.search(r"^@!?P\d+\s+BRA.*`\(\.(L_x_\d+)\)", text)) and labels.get(m.group(1), a) < a]
    first, last = max(loops, key=lambda span: span[1] - span[0])
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
                               for a, text in instructions if first <= a <= last)


def measure(config: str, arch: int) -> dict:
    kv, block_n, split, *flags = config.split(":")
    kernel = compile_kernel(kv, int(block_n), int(split), "tma" in flags, "f16" in flags, arch)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([ptxas_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([ptxas_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    ops = loop_opcodes(sass)
    return {"config": config, "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "shared_bytes": kernel.metadata.shared, "loop_instructions": sum(ops.values()),
            "conversions": sum(n for op, n in ops.items() if op.startswith(("F2F", "I2F", "F2I"))),
            "top_opcodes": " ".join(f"{op}:{n}" for op, n in ops.most_common(8))}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=CONFIGS, help="kv:block_n:split[:tma][:f16], comma-separated")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    ap.add_argument("--out", default="bench/results/kernel_sass.json")
    args = ap.parse_args(argv)
    record(args.out, "kernel_sass", vars(args), [measure(c, args.arch) for c in args.configs.split(",")])


if __name__ == "__main__":
    main()
