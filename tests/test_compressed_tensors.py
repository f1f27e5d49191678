"""compressed-tensors checkpoints (model/compressed_tensors.py): qwen3-small quantized and written by the
compressed-tensors library itself (its quantization config applied to transformers' model, each weight's scales
and zero points from its min and max, compressed and saved by its ModelCompressor, as llm-compressor writes
RedHatAI's models), then served on the CPU in float32: every position's logits equal transformers' over the same
folder (its compressed-tensors integration decompresses it) as closely as over the unquantized folder, and differ
from the unquantized model's; each weight is what the library's own decompressor makes of its parts.
Schemes the worker does not serve are refused at start by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from common.limits import Limits
from tests.paged_driver import prefill_logits
from tests.quantized_checkpoints import assert_served_packed, hf_logits, prompts, served_logits
from worker_svc.checkpoints.writer import make_model
from worker_svc.model.compressed_tensors import CompressedTensors, unpack_int32
from worker_svc.model.loader import checkpoint_names, checkpoint_tensors
from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.timeout(300)

SCHEMES = {  # (format, weights' quantization args): the published kinds
    "w4a16 (groups of 32)": ("pack-quantized", dict(num_bits=4, type="int", strategy="group", group_size=32)),
    "w4a16 asymmetric": ("pack-quantized", dict(num_bits=4, type="int", strategy="group", group_size=64,
                                                symmetric=False)),
    "w8a8 int8 channels": ("int-quantized", dict(num_bits=8, type="int", strategy="channel")),
    "fp8 channels (FP8-dynamic)": ("float-quantized", dict(num_bits=8, type="float", strategy="channel")),
    "fp8 tensor": ("float-quantized", dict(num_bits=8, type="float", strategy="tensor")),
    "fp8 blocks": ("float-quantized", dict(num_bits=8, type="float", strategy="block", block_structure=[128, 128])),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_model("qwen3-small", tmp_path_factory.mktemp("ct") / "src", seed=0)


def _extremes(weight: torch.Tensor, strategy: str, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Each scale's weights' min and max, in the scale's shape."""
    if strategy == "tensor":
        return weight.amin().reshape(1), weight.amax().reshape(1)
    if strategy == "channel":
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    if strategy == "group":
        groups = weight.unflatten(-1, (-1, args.group_size))
        return groups.amin(-1), groups.amax(-1)
    rows, cols = args.block_structure
    padded = torch.nn.functional.pad(weight, (0, -weight.shape[1] % cols, 0, -weight.shape[0] % rows))
    blocks = padded.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols))
    return blocks.amin((1, 3)), blocks.amax((1, 3))


def compressed_checkpoint(source: Path, out: Path, fmt: str, weights: dict) -> Path:
    """`source` quantized and saved by the compressed-tensors library under one scheme for every Linear but the
    LM head."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    args = QuantizationArgs(**weights)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"],
        format=fmt))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        scale, zero = calculate_qparams(*_extremes(module.weight.data, args.strategy, args), args)
        module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.reshape(module.weight_zero_point.shape).to(
                module.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and not (out / path.name).exists():
            shutil.copy(path, out / path.name)
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_compressed_checkpoint_serves_transformers_logits(scheme, source, tmp_path):
    """Each module's weight as the library decompresses it, bit for bit; the logits as transformers computes them
    over the folder, as close as over the unquantized one (float32 sums in another order), and not those."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    fmt, weights = SCHEMES[scheme]
    folder = compressed_checkpoint(source, tmp_path / "q", fmt, weights)
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quantization["format"] == fmt
    decompress = BaseCompressor.get_value_from_registry(fmt).decompress
    library_scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    ours = CompressedTensors.parse(quantization)
    names = checkpoint_names(folder)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, get, _ in checkpoint_tensors(folder):
        prefix, _, part = name.rpartition(".")
        if f"{prefix}.weight_scale" in names:
            parts.setdefault(prefix, {})[part] = get()
    assert len(parts) == 4 * 7  # every projection of the 4 layers, the LM head left out
    for prefix, stored in parts.items():
        expected = decompress(dict(stored), library_scheme)["weight"]
        assert torch.equal(ours.dequantize(stored), expected.float()), prefix

    ours, theirs = served_logits(folder), hf_logits(folder)
    unquantized = (served_logits(source) - hf_logits(source)).abs().max().item()
    assert (ours - theirs).abs().max() <= max(2 * unquantized, 1e-4)
    assert (ours - served_logits(source)).abs().max() > 1e-2  # the codes, not the 16-bit weights, were served
    if fmt == "pack-quantized":
        assert_served_packed(folder, weights["num_bits"])


def test_packed_integers_unpack_across_word_boundaries():
    """Element i at bit i * num_bits of the row's words, offset to unsigned: 3-bit values straddle words."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    values = torch.randint(-4, 4, (5, 70), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    assert torch.equal(unpack_int32(pack_to_int32(values, 3), 3, 70), values.float())
    values = torch.randint(-8, 8, (3, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    assert torch.equal(unpack_int32(pack_to_int32(values, 4), 4, 64), values.float())


@pytest.mark.parametrize("change, why", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder"),
    (lambda q: q["config_groups"].update(group_1=q["config_groups"]["group_0"]), "one config group"),
    (lambda q: q.update(format="nvfp4-pack-quantized"), "format"),
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
])
def test_unserved_schemes_are_refused_by_name(change, why):
    quantization = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}
    assert CompressedTensors.parse(json.loads(json.dumps(quantization))).num_bits == 4
    change(quantization)
    with pytest.raises(ValueError, match=why):
        CompressedTensors.parse(quantization)


def test_auto_keeps_fp8_blocks_as_stored_and_dequantises_other_fp8(source, tmp_path, monkeypatch):
    """`--quantization auto` where the device has the block-scaled GEMM (said so here on the CPU, whose reference
    kernels compute it): an FP8 checkpoint in 128 x 128 blocks is served in FP8 with its codes as stored (o_proj's and
    down_proj's here: whole blocks of their own), one scaled per channel in 16 bits."""
    from worker_svc.runtime import model_runner

    monkeypatch.setattr(model_runner, "fp8_gemms", lambda device: True)
    blocks = compressed_checkpoint(source, tmp_path / "blocks", *SCHEMES["fp8 blocks"])
    channels = compressed_checkpoint(source, tmp_path / "channels", *SCHEMES["fp8 channels (FP8-dynamic)"])

    def runner(folder: Path) -> ModelRunner:
        return ModelRunner(folder, RunnerConfig(device="cpu", dtype="float32", block_size=16, num_blocks=64,
                                                limits=Limits(max_num_seqs=4)))

    assert runner(channels).fp8_linears == 0
    served = runner(blocks)
    assert served.fp8_linears == 4 * 4
    stored = {n: get() for n, get, _ in checkpoint_tensors(blocks) if ".layers.2." in n}
    layer = served.model.layers[2]
    for module, name in ((layer.self_attn.o_proj, "self_attn.o_proj"), (layer.mlp.down_proj, "mlp.down_proj")):
        codes, scale = stored[f"model.layers.2.{name}.weight"], stored[f"model.layers.2.{name}.weight_scale"]
        assert torch.equal(module.weight.view(torch.uint8), codes.view(torch.uint8))
        torch.testing.assert_close(module.weight_scale, scale.float(), rtol=2 ** -20, atol=0)


def test_a_moe_checkpoints_quantized_experts_load_as_the_library_decompresses_them(tmp_path):
    """Qwen3-MoE as published (each expert's gate, up and down its own Linear): every projection, experts included
    and the router left out, in w4a16 groups compressed by the library's own compressor; served, it computes what
    the same model computes over a float32 checkpoint of the library's decompressed weights, bit for bit."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    source = make_model("qwen3-moe-fp8", tmp_path / "src", seed=0)
    fmt, weights = SCHEMES["w4a16 (groups of 32)"]
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    compressed, decompressed = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if not name.endswith("_proj.weight"):
            compressed[name] = decompressed[name] = tensor
            continue
        scale, zero = calculate_qparams(*_extremes(tensor, "group", args), args)
        parts = compressor.compress({"weight": tensor, "weight_scale": scale, "weight_zero_point": zero}, scheme)
        prefix = name.removesuffix(".weight")
        compressed |= {f"{prefix}.{part}": t for part, t in parts.items()}
        decompressed[name] = compressor.decompress(dict(parts), scheme)["weight"].float()
    assert any(".experts.3.down_proj.weight_packed" in n for n in compressed)
    for folder, tensors in (("q", compressed), ("dq", decompressed)):
        shutil.copytree(source, tmp_path / folder)
        save_file(tensors, tmp_path / folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": args.model_dump(mode="json")}}, "ignore": ["lm_head"]}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    assert torch.equal(served_logits(tmp_path / "q"), served_logits(tmp_path / "dq"))


def test_quantization_fp8_puts_a_compressed_checkpoints_weights_into_fp8_blocks(source, tmp_path):
    """`--quantization fp8` over a w4a16 checkpoint: its 16 projections in FP8 blocks, quantised from the dequantised
    weights, so it serves exactly what an FP8 runner over a float32 checkpoint of those weights serves."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file, save_file

    fmt, weights = SCHEMES["w4a16 (groups of 32)"]
    folder = compressed_checkpoint(source, tmp_path / "q", fmt, weights)
    decompress = BaseCompressor.get_value_from_registry(fmt).decompress
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    stored, plain = load_file(folder / "model.safetensors"), {}
    for name, tensor in stored.items():
        prefix, _, part = name.rpartition(".")
        if f"{prefix}.weight_scale" not in stored:
            plain[name] = tensor
        elif part == "weight_packed":
            parts = {p: stored[f"{prefix}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
            plain[f"{prefix}.weight"] = decompress(parts, scheme)["weight"].float()
    shutil.copytree(source, tmp_path / "dq")
    save_file(plain, tmp_path / "dq" / "model.safetensors", metadata={"format": "pt"})

    def fp8(model_dir: Path) -> tuple[int, torch.Tensor]:
        runner = ModelRunner(model_dir, RunnerConfig(device="cpu", dtype="float32", block_size=16, num_blocks=64,
                                                     limits=Limits(max_num_seqs=4), quantization="fp8"))
        return runner.fp8_linears, torch.cat(prefill_logits(runner, prompts()))

    (count, ours), (plain_count, theirs) = fp8(folder), fp8(tmp_path / "dq")
    assert count == plain_count == 4 * 4
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("algo, strategy, described_in", [
    ("FP8", "tensor", "config.json"), ("FP8", "tensor", "hf_quant_config.json"),
    ("FP8_PER_CHANNEL_PER_TOKEN", "channel", "config.json"), ("FP8_PER_CHANNEL_PER_TOKEN", "channel",
                                                              "hf_quant_config.json"),
    ("AutoFP8", "tensor", "config.json"), ("fbgemm_fp8", "channel", "config.json")])
def test_a_scaled_fp8_checkpoint_serves_as_its_compressed_tensors_twin(algo, strategy, described_in, source,
                                                                       tmp_path):
    """NVIDIA ModelOpt's FP8 layout is float-quantized compressed-tensors' (e4m3 `weight`, `weight_scale` per tensor
    or channel) with a static `input_scale` beside each and the KV cache's scales on k_proj and v_proj; AutoFP8's is
    its per-tensor one (`quant_method: fp8` without blocks), FBGEMM's the per-channel one with a bound of the
    activations' scale (`input_scale_ub`). The library's folder rewritten so serves its logits exactly (those proven
    against transformers above), whether config.json or only hf_quant_config.json (nvidia's earlier -FP8 models)
    describes it, and an fp8 cache takes the k_proj / v_proj scales as the attention's."""
    from safetensors.torch import load_file, save_file

    twin = compressed_checkpoint(source, tmp_path / "ct", "float-quantized",
                                 dict(num_bits=8, type="float", strategy=strategy))
    folder = shutil.copytree(twin, tmp_path / "modelopt")
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        tensors[name] = tensors[name].reshape(() if strategy == "tensor" else -1)  # as ModelOpt stores them
        tensors[name.replace(".weight_scale", ".input_scale")] = torch.tensor(0.02)
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.5 + i)
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(0.25)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    quantization = {"quant_algo": algo, "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    del config["quantization_config"]
    if algo == "AutoFP8":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    elif algo == "fbgemm_fp8":  # Meta's: an upper bound of the activations' scale in place of a static one
        config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                         "modules_to_not_convert": ["lm_head"]}
        tensors = load_file(folder / "model.safetensors")
        for name in [n for n in tensors if n.endswith(".input_scale")]:
            tensors[name.replace(".input_scale", ".input_scale_ub")] = tensors.pop(name) * 0 + 1200.0
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    elif described_in == "config.json":
        config["quantization_config"] = {"quant_method": "modelopt", **quantization}
    else:
        (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                                 "quantization": quantization}))
    (folder / "config.json").write_text(json.dumps(config))

    assert torch.equal(served_logits(folder), served_logits(twin))
    fp8 = ModelRunner(folder, RunnerConfig(device="cpu", dtype="float32", block_size=16, num_blocks=64,
                                           limits=Limits(max_num_seqs=4), kv_cache_dtype="fp8"))
    assert [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in fp8.model.layers] == [
        (0.5 + i, 0.25) for i in range(layers)]


def test_other_modelopt_algorithms_are_refused_by_name():
    assert CompressedTensors.scaled_fp8({"quant_method": "modelopt", "quantization": {"quant_algo": "fp8"}}).strategy \
        == "tensor"
    for algo in ("NVFP4", "W4A8_AWQ", None):
        with pytest.raises(ValueError, match="unsupported ModelOpt checkpoint"):
            CompressedTensors.scaled_fp8({"quant_method": "modelopt", "quant_algo": algo})
