"""Sampling: seeded draws independent of the batch, filters that keep only allowed tokens,
penalties, logprobs."""
from __future__ import annotations

import pytest
import torch

from common.limits import Limits
from protos import worker_pb2 as pb
from tests.paged_driver import PagedDriver
from worker_svc import kernels
from worker_svc.kernels.reference import uniform_noise
from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig
from worker_svc.runtime.sampler import Penalties, SamplingBatch, sample

CPU = kernels.select("cpu")


def _batch(n, temperature=1.0, top_k=None, top_p=None, min_p=None, seeds=None, logprobs=-1):
    def col(v, dtype):
        return None if v is None else torch.full((n,), v, dtype=dtype)
    return SamplingBatch(
        temperature=torch.full((n,), temperature), seeds=seeds if seeds is not None else torch.arange(n),
        positions=torch.zeros(n, dtype=torch.int64), top_k=col(top_k, torch.int64),
        top_p=col(top_p, torch.float32), min_p=col(min_p, torch.float32),
        all_greedy=temperature == 0, max_logprobs=logprobs)


def test_noise_is_a_function_of_seed_position_and_token():
    seeds, pos = torch.tensor([1, 2, 1, 2**40 + 1]), torch.tensor([5, 5, 6, 5])
    u = uniform_noise(seeds, pos, 1000)
    assert ((u > 0) & (u < 1)).all()
    again = uniform_noise(seeds[[1, 0]], pos[[1, 0]], 1000)
    assert torch.equal(u[[1, 0]], again)
    assert not torch.equal(u[0], u[2]) and not torch.equal(u[0], u[3])
    assert abs(u.mean().item() - 0.5) < 0.02


def test_noise_stays_inside_the_unit_interval_at_the_hashs_extremes():
    """The largest hash must not round to u = 1.0 (infinite Gumbel noise: a token drawn whatever its logit)."""
    from worker_svc.kernels.reference import unit_interval

    u = unit_interval(torch.tensor([0, 1, (1 << 32) - 1, (1 << 32) - 512, (1 << 31)]))
    assert ((u > 0) & (u < 1)).all() and torch.isfinite(-torch.log(-torch.log(u))).all()


@pytest.mark.parametrize("use_kernel", [False, True])
def test_a_token_far_ahead_is_drawn_every_time(use_kernel):
    """151,936 tokens with one 1,000 nats ahead: 300 rows of random seeds all draw it (the noise used to reach
    1.0 for one token in 2^24, which sent ~0.9 % of draws over this vocabulary to a uniformly random token); 24 rows
    through the kernel (Triton's interpreter)."""
    rows, vocab = 300 if not use_kernel else 24, 151936
    logits = torch.zeros(rows, vocab)
    logits[:, 1234] = 1000.0
    seeds = torch.randint(0, 2**62, (rows,), generator=torch.Generator().manual_seed(0))
    batch = _batch(rows, seeds=seeds)
    if use_kernel:
        from worker_svc.kernels.gumbel import gumbel_argmax

        tokens = gumbel_argmax(logits, batch.temperature, batch.seeds, batch.positions)
    else:
        tokens = sample(logits, batch, CPU).token_ids
    assert (tokens == 1234).all()


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    out = sample(probs.log().expand(n, 4).contiguous(), _batch(n), CPU)
    freq = torch.bincount(out.token_ids, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


@pytest.mark.parametrize("kw,allowed", [
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.7}, {0, 1}),           # 0.5 + 0.3 reaches 0.7: tokens 0 and 1
    ({"top_p": 0.5}, {0}),
    ({"min_p": 0.25}, {0, 1, 2}),        # p >= 0.25 * 0.5
    ({"top_k": 3, "top_p": 0.9, "min_p": 0.35}, {0, 1}),
])
def test_filters_keep_only_allowed_tokens(kw, allowed):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 2000
    out = sample(probs.log().expand(n, 4).contiguous(), _batch(n, **kw), CPU)
    assert set(out.token_ids.tolist()) == allowed


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    out = sample(logits, _batch(2, temperature=0.0, logprobs=2), CPU)
    assert out.token_ids.tolist() == [1, 0]
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, ref[[0, 1], [1, 0]])
    assert out.top_ids.tolist() == [[1, 2], [0, 1]]


def test_penalties():
    pen = Penalties(rows=2, vocab=4, device=torch.device("cpu"))
    pen.reset_row(0, torch.tensor([1]), torch.tensor([2, 2]))
    logits = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    out = pen.apply(logits, torch.tensor([0]), torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    # token 1: in prompt -> repetition only; token 2: twice in output -> all three
    assert torch.allclose(out, torch.tensor([[1.0, 0.5, 0.5 - 0.5 - 0.5, -1.0]]))
    pen.record(torch.tensor([0]), torch.tensor([3]))
    assert pen.counts[0].tolist() == [0, 0, 2, 1]


def test_seeded_sampling_is_independent_of_the_batch(tiny_model_dir):
    """The same seeded request samples the same tokens alone and inside different batches."""
    def params(seed):
        return pb.SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=seed, repetition_penalty=1.0,
                                 logprobs=-1)

    def run(prompts_and_seeds, chunk):
        runner = ModelRunner(tiny_model_dir, RunnerConfig(dtype="float32", num_blocks=64, limits=Limits(max_num_seqs=8)))
        driver = PagedDriver(runner, chunk=chunk)
        seqs = [driver.add(p, 12, params(seed)) for p, seed in prompts_and_seeds]
        driver.run_all()
        return [s.generated for s in seqs]

    target = ([11, 12, 13, 14, 15], 1234)
    alone = run([target], chunk=100)[0]
    mixed = run([([7] * 20, 1), target, ([9, 8, 7], 99)], chunk=4)[1]
    assert alone == mixed
    assert run([([11, 12, 13, 14, 15], 4321)], chunk=100)[0] != alone
