"""transformers' model of a checkpoint folder, as a test's reference, in float32: quantized weights dequantised by
transformers' own code where it has some for a CPU (MXFP4: Mxfp4Config(dequantize=True); FP8 block scales: its
Fp8Dequantize op, into a float copy of the folder, since its FP8 loader needs accelerate; compressed-tensors: its
integration, float32 checkpoints only)."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch


def from_pretrained(model_dir: str | Path, **kwargs):
    """transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs), in float32 and eval mode."""
    import transformers  # not at module level: tests/test_tensor_parallel.py's spawned ranks import its importers

    model_dir = Path(model_dir)
    method = (json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}).get("quant_method")
    if method == "mxfp4":
        kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = _dequantized_fp8(model_dir, Path(tmp)) if method == "fp8" else model_dir
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    model, *info = loaded if isinstance(loaded, tuple) else (loaded,)  # (model, info) with output_loading_info
    if method == "compressed-tensors":  # decompressed by its integration (the compressed-tensors package) in the
        assert model.dtype == torch.float32  # checkpoint's dtype, which it will not cast
    else:
        model = model.float()
    model = model.eval()
    return (model, *info) if info else model


def _dequantized_fp8(model_dir: Path, out: Path) -> Path:
    """A copy of an FP8 block-scaled checkpoint with every weight and its weight_scale_inv as one float32 weight,
    dequantised by transformers' Fp8Dequantize, and no quantization_config."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    for path in model_dir.iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy(path, out / path.name)
    tensors = {}
    for path in model_dir.glob("*.safetensors"):
        tensors |= load_file(path)
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        tensors[weight] = Fp8Dequantize(None)._dequantize_one(tensors[weight], tensors.pop(name), torch.float32)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def merge_lora(state: dict[str, torch.Tensor], adapter: Path) -> dict[str, torch.Tensor]:
    """A state dict (transformers' names) with the PEFT adapter in `adapter` merged into its weights:
    W + alpha / r * B A for every module the adapter adapts."""
    from safetensors.torch import load_file

    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    tensors = load_file(Path(adapter) / "adapter_model.safetensors")
    scale = config["lora_alpha"] / config["r"]
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight").removeprefix("base_model.model.")
            state[f"{module}.weight"] += scale * tensors[key.replace("lora_A", "lora_B")] @ a
    return state
