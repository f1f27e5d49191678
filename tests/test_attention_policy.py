"""`auto` attention's choice per step (worker_svc/kernels/attention.py): the decode kernel for decode-only
steps; for steps with prefills, the Triton prefill kernel below FLASH_ATTN_MIN_FLOPS of attention per layer and
flash-attn-4 above, decided once per step (at its first layer) for every layer."""
from __future__ import annotations

import pytest
import torch

from worker_svc.kernels import attention
from worker_svc.kernels.attention import AttentionMetadata, PagedAttention, attention_flops, prefill_kernel

HEADS, DIM = 16, 128


def meta(query_lens: list[int], context_lens: list[int]) -> AttentionMetadata:
    z = torch.zeros(1, dtype=torch.int32)
    return AttentionMetadata(z, z, z, z, max(query_lens), query_lens, context_lens)


def test_flops_count_causal_pairs():
    # a 4-token prompt: 1 + 2 + 3 + 4 pairs; a 2-token chunk over 10 cached: 11 + 12; a decode at 7: 7
    assert attention_flops(meta([4, 2, 1], [4, 12, 7]), HEADS, DIM) == 4 * HEADS * DIM * (10 + 23 + 7)


def test_small_steps_take_triton_and_large_ones_flash_attn():
    pairs_needed = attention.FLASH_ATTN_MIN_FLOPS / (4 * HEADS * DIM)
    long = int((2 * pairs_needed) ** 0.5) + 2  # one prompt just over the threshold
    assert prefill_kernel(meta([long], [long]), HEADS, DIM) == "flash_attn"
    assert prefill_kernel(meta([long - 4], [long - 4]), HEADS, DIM) == "triton"
    assert prefill_kernel(meta([128] * 8 + [1] * 200, [128] * 8 + [900] * 200), HEADS, DIM) == "triton"
    # twice the heads, half the tokens' worth of pairs: the same work
    assert prefill_kernel(meta([long // 2 + 2] * 2, [long // 2 + 2] * 2), 4 * HEADS, DIM) == "flash_attn"


def test_heads_wider_than_flash_attn_takes_keep_it_out_of_every_step(monkeypatch):
    """DeepSeek's cached latent (576 wide): `auto` is Triton's alone, so no step (the warm-up's forced ones included)
    reaches flash-attn-4, and asking for flash_attn names why it cannot be."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(attention, "flash_attn_available", lambda device: True)
    monkeypatch.setattr(attention, "cuda_capability_at_least", lambda device, major: True)
    assert attention.resolve("auto", cuda, head_dim=256) == "auto"
    assert attention.resolve("auto", cuda, head_dim=576) == "triton"
    with pytest.raises(ValueError, match="heads up to 256 wide and this model caches 576"):
        attention.resolve("flash_attn", cuda, head_dim=576)


def test_a_cache_flash_attn_cannot_read_keeps_it_out_of_every_step(monkeypatch):
    """flash-attn-4 reads fp16 and bf16 caches only: a float32 model (the GPU checks against transformers run one)
    or an fp8 cache is Triton's alone under `auto`, and asking for flash_attn names why it cannot be."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(attention, "flash_attn_available", lambda device: True)
    monkeypatch.setattr(attention, "cuda_capability_at_least", lambda device, major: True)
    assert attention.resolve("auto", cuda, torch.float16) == "auto"
    for dtype in (torch.float32, torch.float8_e4m3fn):
        assert attention.resolve("auto", cuda, dtype) == "triton"
    with pytest.raises(ValueError, match="cannot read a float32 KV cache"):
        attention.resolve("flash_attn", cuda, torch.float32)


class Recorder:
    def __init__(self, name: str, calls: list[str]):
        self.name, self.calls = name, calls

    def __call__(self, q, *rest):
        self.calls.append(self.name)
        return q


def backend(calls: list[str]) -> PagedAttention:
    return PagedAttention("auto", {"triton": Recorder("triton", calls), "flash_attn": Recorder("flash_attn", calls)},
                          Recorder("decode", calls))


@pytest.mark.parametrize("lens,expected", [(([1] * 5, [30] * 5), "decode"), (([3, 1], [3, 40]), "triton"),
                                           (([8192], [8192]), "flash_attn")])
def test_each_step_runs_one_kernel_in_every_layer(lens, expected):
    calls: list[str] = []
    paged, step = backend(calls), meta(*lens)
    q = torch.zeros(sum(lens[0]), HEADS, DIM)
    for _ in range(3):  # three layers of one step
        paged.forward(q, None, None, step, 1.0)
    assert calls == [expected] * 3
    assert sum(paged.steps.values()) == (expected != "decode")


def test_the_choice_is_made_again_for_the_next_step_and_forced_wins():
    calls: list[str] = []
    paged = backend(calls)
    q = torch.zeros(1, HEADS, DIM)
    paged.forward(q, None, None, meta([3, 1], [3, 40]), 1.0)
    paged.forward(q, None, None, meta([8192], [8192]), 1.0)
    paged.forced = "flash_attn"
    paged.forward(q, None, None, meta([3, 1], [3, 40]), 1.0)
    assert calls == ["triton", "flash_attn", "flash_attn"]
    assert paged.steps == {"triton": 1, "flash_attn": 2}


def test_auto_is_a_choice_per_step_only_where_flash_attn_runs():
    cpu = torch.device("cpu")
    assert attention.resolve("auto", cpu) == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention.resolve("fast", cpu)
