from __future__ import annotations

import math

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common.limits import Limits
from protos import worker_pb2
from scheduler_svc.adapters import AdapterError, Adapters
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.scheduler import QueueFullError, Scheduler
from scheduler_svc.sequence import Sequence, SequenceStatus
from tests.fake_worker import FakeWorker, ProtocolViolation, fake_logprob, weights_id

EOS = 0


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    cap: int = 0,
    max_num_seqs: int = 16,
    max_model_len: int = 128,
    caching: bool = True,
    max_waiting: int = 100,
    vocab_size: int = 1000,
    token_fn=None,
    num_host_blocks: int = 0,
    sliding_window: int = 0,
    lora_slots: int = 0,
    lora_capacity: int = 0,
) -> tuple[Scheduler, FakeWorker]:
    cfg = SchedulerConfig(
        limits=Limits(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len),
        long_prefill_token_threshold=cap,
        max_waiting=max_waiting,
        enable_prefix_caching=caching,
    )
    worker = FakeWorker(num_blocks, block_size, max_model_len, vocab_size=vocab_size, token_fn=token_fn,
                        num_host_blocks=num_host_blocks, sliding_window=sliding_window, lora_slots=lora_slots,
                        lora_capacity=lora_capacity)
    info = worker.describe(worker_pb2.DescribeRequest(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget))
    return Scheduler(cfg, num_blocks, block_size, eos_token_ids=[EOS], epoch=worker.epoch,
                     num_host_blocks=num_host_blocks, sliding_window=sliding_window,
                     adapters=Adapters(list(info.lora_adapters), list(info.lora_slots), info.max_cpu_loras)), worker


def seq(seq_id: int, prompt, **params) -> Sequence:
    params.setdefault("ignore_eos", True)
    params.setdefault("seed", 1000 + seq_id)
    return Sequence(seq_id, list(prompt), SamplingParams(**params))


def expected_output(worker: FakeWorker, s: Sequence, weights: int = 0) -> tuple[list[int], str]:
    """What the sequence must generate, whatever the batching: token = f(seed, position), under the model's weights
    of that id (tests/fake_worker.py)."""
    out = []
    n = s.prompt_len
    while True:
        tok = worker.token_fn(s.params.seed ^ weights, n)
        out.append(tok)
        n += 1
        if tok in s.stop_ids and n >= s.min_len:
            return out, "stop"
        if n >= s.max_len:
            return out, "length"


class Driver:
    """Runs a scheduler against a fake worker with `depth` plans in flight at most."""

    def __init__(self, sched: Scheduler, worker: FakeWorker, depth: int = 2):
        self.sched, self.worker, self.depth = sched, worker, depth
        self.plans: list[worker_pb2.StepPlan] = []
        self.finished: list[Sequence] = []

    def step(self) -> list[Sequence]:
        plan = self.sched.schedule()
        if plan is not None:
            self.plans.append(plan)
            self.worker.submit(plan)
        self.sched.check()
        if self.worker.num_in_flight and (plan is None or self.worker.num_in_flight >= self.depth):
            out = self.sched.update(self.worker.receive())
            self.finished += [s for s in out if s.finish_reason]
            self.sched.check()
            return out
        return []

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not (self.sched.has_unfinished() or self.worker.num_in_flight):
                return
            self.step()
        raise AssertionError("no progress")


def scheduled(plan: worker_pb2.StepPlan) -> dict[int, int]:
    """seq id -> tokens scheduled in the plan."""
    out = {ns.seq_id: ns.num_scheduled_tokens for ns in plan.new_seqs}
    out.update(zip(plan.seq_ids, plan.num_scheduled_tokens))
    return out


# --- examples ------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2])
def test_decode_first_budget_accounting(depth):
    sched, worker = make(budget=16, cap=16)
    d = Driver(sched, worker, depth)
    for i in range(3):
        sched.add(seq(i, range(10 + i * 4, 14 + i * 4), max_tokens=20))
    d.step()
    if depth == 2:
        d.step()  # decodes are scheduled for the tokens still in flight
    sched.add(seq(9, range(100, 140), max_tokens=4))
    d.step()
    plan = d.plans[-1]
    assert list(plan.seq_ids) == [0, 1, 2] and list(plan.num_scheduled_tokens) == [1, 1, 1]
    assert [ns.seq_id for ns in plan.new_seqs] == [9]
    assert plan.new_seqs[0].num_scheduled_tokens == 13  # the budget left after the decodes
    d.run()
    for s in d.finished:
        assert s.output_token_ids == expected_output(worker, s)[0]


def test_two_long_prompts_chunked_side_by_side():
    sched, worker = make(budget=16, cap=8)
    d = Driver(sched, worker, 1)
    sched.add(seq(1, range(1, 41), max_tokens=2))
    sched.add(seq(2, range(101, 141), max_tokens=2))
    for _ in range(5):
        d.step()
        assert scheduled(d.plans[-1]) == {1: 8, 2: 8}
    d.run()
    assert {s.seq_id for s in d.finished} == {1, 2}


def test_chunk_cap_does_not_starve_others_and_leftover_goes_to_the_oldest():
    sched, worker = make(budget=32, cap=8)
    d = Driver(sched, worker, 1)
    for i in range(3):
        sched.add(seq(i, range(100 * i + 1, 100 * i + 41), max_tokens=2))
    d.step()
    assert scheduled(d.plans[-1]) == {0: 16, 1: 8, 2: 8}
    # A prompt alone gets the whole budget.
    sched2, worker2 = make(budget=32, cap=8)
    sched2.add(seq(5, range(1, 100), max_tokens=2))
    assert scheduled(sched2.schedule()) == {5: 32}


def test_prefix_hit_on_admission_skips_cached_blocks():
    sched, worker = make(block_size=4)
    d = Driver(sched, worker)
    sched.add(seq(1, range(1, 19), max_tokens=2))  # 4 full blocks + 2 tokens
    d.run()
    sched.add(seq(2, list(range(1, 17)) + [77, 78, 79], max_tokens=2))
    d.step()
    ns = d.plans[-1].new_seqs[0]
    assert ns.num_computed_tokens == 16 and ns.num_scheduled_tokens == 3
    sched.add(seq(3, range(1, 17), max_tokens=2))  # exactly 4 blocks: the last token is computed
    d.step()
    ns = d.plans[-1].new_seqs[0]
    assert ns.num_computed_tokens == 12 and ns.num_scheduled_tokens == 4
    d.run()
    assert sched.num_prefix_hit_tokens == 28
    assert [s.num_cached_tokens for s in sorted(d.finished, key=lambda s: s.seq_id)] == [0, 16, 12]


def test_preemption_order_and_resume_with_rehit():
    # 3 prompts of 2 blocks that grow to 4 blocks each, in a pool of 9 blocks.
    sched, worker = make(num_blocks=9, block_size=4, budget=64)
    d = Driver(sched, worker, 2)
    seqs = [seq(i, range(20 * i + 1, 20 * i + 9), max_tokens=6) for i in range(3)]
    for s in seqs:
        sched.add(s)
    victim = None
    while victim is None:
        d.step()
        victim = next((p.preempted_ids[0] for p in d.plans if p.preempted_ids), None)
    assert victim == 2  # the newest
    preempting_plan = next(p for p in d.plans if p.preempted_ids)
    assert 2 not in scheduled(preempting_plan)
    assert seqs[2].status is SequenceStatus.PREEMPTED and sched.waiting[0] is seqs[2]
    d.run()
    resumed = [ns for p in d.plans for ns in p.new_seqs if ns.seq_id == 2][1]
    assert resumed.num_computed_tokens >= 4  # its own prompt block, hit again
    assert len(resumed.token_ids) > 8  # prompt plus what it had generated
    assert sched.num_preemptions >= 1
    for s in seqs:
        assert s.finish_reason == "length"
        assert s.output_token_ids == expected_output(worker, s)[0]
    assert sched.block_manager.num_free_blocks == 9


def test_incremental_allocation_of_a_prompt_larger_than_half_the_pool():
    sched, worker = make(num_blocks=10, block_size=4, budget=8, cap=4)
    d = Driver(sched, worker, 2)
    long = seq(1, range(1, 29), max_tokens=4)  # 7 blocks
    short = seq(2, range(50, 54), max_tokens=6)
    sched.add(long)
    sched.add(short)
    d.step()
    assert len(long.block_table) == 1 and scheduled(d.plans[-1]) == {1: 4, 2: 4}
    tables = []
    while long.num_computed_tokens < 28:
        d.step()
        tables.append(len(long.block_table))
    assert tables == sorted(tables) and tables[0] < 7
    d.run()
    assert long.output_token_ids == expected_output(worker, long)[0]
    assert short.output_token_ids == expected_output(worker, short)[0]


@pytest.mark.parametrize("caching", [True, False])
def test_a_sliding_window_gives_back_the_blocks_behind_it(caching):
    """Every layer with a window of 6 tokens: a sequence gives a block back once the window of its next position
    has passed it, so a pool of 10 blocks of 4 runs three sequences of 40 tokens side by side (30 blocks in all)
    without a preemption, each holding at most 4 blocks at once; the fake worker reads every key inside the windows and
    finds it intact, though released blocks were reused. Without the window the same run preempts."""
    for window in (6, 0):
        sched, worker = make(num_blocks=10, block_size=4, budget=12, cap=4, caching=caching, sliding_window=window)
        d = Driver(sched, worker, 3)
        seqs = [seq(i, range(10 * i, 10 * i + 14), max_tokens=26) for i in (1, 2, 3)]
        for s in seqs:
            sched.add(s)
        most = 0
        while sched.has_unfinished() or worker.num_in_flight:
            d.step()
            most = max([most, *(len(s.block_table) - s.num_released_blocks for s in sched.running)])
        assert [s.output_token_ids for s in seqs] == [expected_output(worker, s)[0] for s in seqs]
        assert sched.block_manager.num_free_blocks == 10
        released = sum(sum(p.num_released_blocks) for p in d.plans)
        if window:
            assert sched.num_preemptions == 0 and most <= 4 and released >= 3 * 7
        else:
            assert sched.num_preemptions > 0 and released == 0


def test_a_sliding_window_lets_a_sequence_outgrow_the_pool():
    """Behind a 6-token window a 60-position sequence holds at most (budget + window + 2 x block - 3) // block
    blocks, so a pool of 6 blocks of 4 (24 positions) admits it; a second one over the same prompt, whose cached
    prefix (on the host tier, where the first one's blocks went as the pool reused them) is longer than the pool,
    takes the part that fits beside its first chunk and computes the rest again. Without a window it is refused."""
    with pytest.raises(ValueError, match="needs 15 KV blocks, the worker has 6"):
        make(num_blocks=6, block_size=4, budget=8)[0].add(seq(1, range(1, 41), max_tokens=20))
    sched, worker = make(num_blocks=6, block_size=4, budget=8, max_model_len=128, sliding_window=6,
                         num_host_blocks=24)
    d = Driver(sched, worker, 2)
    first = seq(1, range(1, 41), max_tokens=20)
    sched.add(first)
    d.run()
    again = seq(2, range(1, 41), max_tokens=20)
    sched.add(again)
    d.run()
    assert [s.output_token_ids for s in (first, again)] == [expected_output(worker, s)[0] for s in (first, again)]
    assert again.num_cached_tokens == 20 and sched.num_host_hit_tokens > 0 and sched.num_preemptions == 0
    assert sched.block_manager.num_free_blocks == 6


def test_a_sequence_preempted_after_giving_back_shared_blocks_leaves_no_release_in_the_plan():
    """Its released blocks were prefix blocks another sequence holds too, so the pool stays full, its next block
    preempts it, and the plan must not ask the worker to release blocks of a sequence it drops."""
    sched, worker = make(num_blocks=13, block_size=1, budget=5, max_num_seqs=2, sliding_window=3)
    d = Driver(sched, worker, 1)
    for i, (prompt, max_tokens) in enumerate([(range(1, 9), 1), ([1, 1], 1), ([*range(1, 13), 1], 1),
                                              (range(1, 4), 2)], 1):
        sched.add(seq(i, prompt, max_tokens=max_tokens))
    d.run()
    assert any(set(p.preempted_ids) & {4} for p in d.plans)
    assert all(not set(p.preempted_ids) & set(p.released_ids) for p in d.plans)
    assert all(s.output_token_ids == expected_output(worker, s)[0] for s in d.finished) and len(d.finished) == 4


def test_a_release_inside_the_window_is_refused():
    """The worker's own check (PersistentBatch): a block given back while the window of the sequence's next
    position still covers it, or by a model with no window, is a protocol violation."""
    for window, blocks in ((6, 2), (0, 1)):
        sched, worker = make(block_size=4, sliding_window=6)
        worker.sliding_window = window
        worker.describe(worker_pb2.DescribeRequest(max_num_seqs=16, max_num_batched_tokens=64))
        s = seq(1, range(1, 13), max_tokens=4)
        sched.add(s)
        worker.execute(sched.schedule())  # positions 0..11 computed: the next one, 12, reads keys from 7
        plan = worker_pb2.StepPlan(step=2, epoch=worker.epoch, released_ids=[1], num_released_blocks=[blocks])
        with pytest.raises(ProtocolViolation, match="reads keys from 7|some layer reads the whole context"):
            worker.execute(plan)


def test_a_slot_change_under_a_held_sequence_is_refused():
    """The worker's own check (PersistentBatch): a LoRA adapter placed into the slot a held sequence runs under, an
    unload of that adapter, or a placement of an adapter into a second slot, is a protocol violation."""
    for bad in (dict(lora_slots=[worker_pb2.LoraSlot(slot=0, name="b")]), dict(unload_loras=["a"]),
                dict(lora_slots=[worker_pb2.LoraSlot(slot=1, name="a")])):
        sched, worker = make(lora_slots=2, lora_capacity=2)
        for name in "ab":
            sched.adapters.load(name, f"/{name}")
        Driver(sched, worker).run()
        sched.add(seq(1, range(1, 9), max_tokens=4, lora="a"))
        worker.execute(sched.schedule())
        assert sched.adapters.slots == ["a", ""]
        with pytest.raises(ProtocolViolation, match="runs under 'a'|placed into slot 1 of 2, or twice"):
            worker.execute(worker_pb2.StepPlan(step=worker.step + 1, epoch=worker.epoch, **bad))


def test_max_tokens_never_wastes_a_pipelined_step():
    sched, worker = make()
    d = Driver(sched, worker, 2)
    s = seq(1, range(1, 6), max_tokens=3)
    sched.add(s)
    d.run()
    assert sum(1 in scheduled(p) for p in d.plans) == 3
    assert s.finish_reason == "length" and len(s.output_token_ids) == 3


def test_stop_token_in_flight_discards_the_extra_token():
    def token_fn(seed, position):
        return EOS if position == 7 else 500 + position

    sched, worker = make(token_fn=token_fn)
    d = Driver(sched, worker, 2)
    s = seq(1, range(1, 6), max_tokens=10, ignore_eos=False)
    sched.add(s)
    d.run()
    assert s.output_token_ids == [505, 506, EOS]
    assert s.finish_reason == "stop"
    # The decode after EOS was in flight when EOS arrived; the worker sampled it anyway.
    assert sum(1 in scheduled(p) for p in d.plans) == 4
    assert sched.block_manager.num_free_blocks == 64
    # Idle, the worker still holds it; the next plan tells it to drop it.
    sched.add(seq(2, [1, 2], max_tokens=1))
    assert list(sched.schedule().finished_ids) == [1]


def test_min_tokens_ignores_early_stop_tokens():
    def token_fn(seed, position):
        return EOS if position in (5, 6) else 7

    sched, worker = make(token_fn=token_fn)
    d = Driver(sched, worker, 2)
    s = seq(1, range(1, 6), max_tokens=10, ignore_eos=False, min_tokens=2)
    sched.add(s)
    d.run()
    assert s.output_token_ids == [EOS, EOS] and s.finish_reason == "stop"


def test_stop_token_ids_and_ignore_eos():
    def token_fn(seed, position):
        return [EOS, 42, 9][position - 3]

    sched, worker = make(token_fn=token_fn)
    d = Driver(sched, worker, 1)
    a = seq(1, [1, 2, 3], max_tokens=5, ignore_eos=True, stop_token_ids=[42])
    sched.add(a)
    d.run()
    assert a.output_token_ids == [EOS, 42] and a.finish_reason == "stop"


@pytest.mark.parametrize("host", [0, 8])
def test_an_unloaded_adapter_leaves_no_kv_for_a_later_load_of_its_name(host):
    """A prompt cached under adapter "a" (in the GPU's free blocks, and on the host) is not hit by the same prompt
    under a later load of "a" from another folder: the fake worker's KV chains from the folder's weights, so such a
    hit would read wrong KV; the unload waits for the sequence under "a" that still runs."""
    sched, worker = make(num_blocks=16, block_size=4, num_host_blocks=host, lora_slots=1)
    driver = Driver(sched, worker)
    prompt = list(range(1, 13))
    sched.adapters.load("a", "/a")
    driver.run()
    first, running = seq(1, prompt, max_tokens=2, lora="a"), seq(2, [9, 9, 9, 9, 9], max_tokens=30, lora="a")
    sched.add(first)
    sched.add(running)
    while not first.finish_reason:
        driver.step()
    sched.adapters.unload("a")
    driver.step()
    assert not any(p.unload_loras for p in driver.plans)  # "running" still runs under it
    driver.run()
    assert [list(p.unload_loras) for p in driver.plans if p.unload_loras] == [["a"]]
    sched.adapters.load("a", "/a-v2")
    driver.run()
    again = seq(3, prompt, max_tokens=2, lora="a")
    sched.add(again)
    driver.run()
    assert again.num_cached_tokens == 0 and again.output_token_ids == expected_output(worker, again)[0]
    assert [(o.name, o.error) for o in sched.adapters.take_outcomes()] == [("a", "")] * 3
    sched.block_manager.check([])


def test_more_adapters_than_slots_take_turns_in_them():
    """Three adapters served in one slot: each sequence runs once its adapter is in the slot, the adapter moves out
    only when no running sequence needs it, its cached KV survives the move (the same load's KV, hit again), and
    a stream of requests under the placed adapter does not starve the others' (they wait behind the first sequence
    that found no slot, while a sequence without an adapter goes ahead)."""
    sched, worker = make(num_blocks=32, block_size=4, max_num_seqs=8, lora_slots=1, lora_capacity=3)
    driver = Driver(sched, worker)
    for name in "abc":
        sched.adapters.load(name, f"/{name}")
    driver.run()
    assert sorted(sched.adapters.served) == ["a", "b", "c"] and sched.adapters.slots == [""]
    prompt = list(range(1, 13))
    first = [seq(1, prompt, max_tokens=6, lora="a"), seq(2, prompt, max_tokens=3, lora="b"),
             seq(3, prompt, max_tokens=3, lora="a"), seq(4, [5] * 9, max_tokens=3),
             seq(5, prompt, max_tokens=3, lora="c")]
    for s in first:
        sched.add(s)
    driver.step()
    assert [s.seq_id for s in sched.running] == [1, 4]  # b waits for the slot, and so does a's later sequence
    driver.run()
    again = seq(6, prompt, max_tokens=2, lora="a")  # a's prompt is cached: a's KV, read under a's load
    sched.add(again)
    driver.run()
    for s in [*first, again]:
        assert s.output_token_ids == expected_output(worker, s)[0], s.seq_id
    assert again.num_cached_tokens == 8
    order = [p.name for plan in driver.plans for p in plan.lora_slots]
    assert order == ["a", "b", "a", "c", "a"] and worker.num_placements == 5
    assert sched.adapters.num_placements == 5
    sched.block_manager.check([])


def test_more_adapters_than_host_memory_holds_are_read_again_for_their_sequences():
    """Room for one adapter in the worker's host memory (vLLM's LRU cache of max_cpu_loras): loading "b" drops "a",
    still served; a sequence under "a" waits while "a" is read again from its folder in place of "b", and hits the
    prefix "a" cached before (the same weights); a load while a sequence runs under the one adapter held is refused
    (RESOURCE_EXHAUSTED); "b", its folder unreadable by the time a sequence needs it, is lost: that sequence ends
    (reason "abort", in Scheduler.lost with why) and "b" is no longer served."""
    sched, worker = make(num_blocks=32, block_size=4, lora_slots=1, lora_capacity=1)
    driver = Driver(sched, worker)
    prompt = list(range(1, 13))
    sched.adapters.load("a", "/a")
    driver.run()
    first = seq(1, prompt, max_tokens=2, lora="a")
    sched.add(first)
    driver.run()
    sched.adapters.load("b", "/b")
    driver.run()
    assert sched.adapters.served == ["a", "b"] and sched.adapters.held == {"b"} and sched.adapters.slots == [""]
    assert [(list(p.drop_loras), [a.name for a in p.load_loras]) for p in driver.plans[-1:]] == [(["a"], ["b"])]
    again = seq(2, prompt, max_tokens=30, lora="a")
    sched.add(again)
    driver.step()
    assert not sched.running and sched.adapters.pending  # "a" is being read again
    assert [(list(p.drop_loras), [(a.name, a.path) for a in p.load_loras]) for p in driver.plans[-1:]] == \
        [(["b"], [("a", "/a")])]
    while not sched.running:
        driver.step()
    sched.adapters.load("c", "/c")
    driver.step()
    outcomes = [(o.name, o.code) for o in sched.adapters.take_outcomes()]
    assert outcomes == [("a", ""), ("b", ""), ("c", "RESOURCE_EXHAUSTED")]
    driver.run()
    assert again.num_cached_tokens == 8 and again.output_token_ids == expected_output(worker, again)[0]
    worker.unreadable.add("/b")
    lost = seq(3, prompt, max_tokens=2, lora="b")
    sched.add(lost)
    driver.run()
    assert lost.finish_reason == "abort" and sched.take_lost() == [("b", "cannot load 'b' from '/b'", [lost])]
    assert sched.adapters.served == ["a"] and sched.adapters.num_reloads == 2 and not sched.take_lost()
    sched.block_manager.check([])


def test_adapters_dropped_for_room_are_still_served_after_a_new_handshake():
    """The worker keeps the folder of each adapter dropped for room (StepPlan.drop_loras) and names them at the
    handshake (DescribeResponse.dropped_loras): a scheduler that connects anew (restarted, or after the stream broke)
    serves them still and reads one again for its sequence; one unloaded meanwhile is forgotten on both sides."""
    from scheduler_svc.engine_core import EngineCore

    sched, worker = make(num_blocks=32, block_size=4, lora_slots=1, lora_capacity=1)
    driver = Driver(sched, worker)
    for name in "abc":
        sched.adapters.load(name, f"/{name}")
        driver.run()
    assert worker.dropped == {"a": "/a", "b": "/b"} and set(worker.loads) == {"c"}
    sched.adapters.unload("b")
    driver.run()
    assert [o.name for o in sched.adapters.take_outcomes()] == ["a", "b", "c", "b"]
    assert worker.dropped == {"a": "/a"} and sorted(sched.adapters.served) == ["a", "c"]
    core = EngineCore(worker, sched.config, [EOS])
    adapters = core.scheduler.adapters
    assert sorted(adapters.served) == ["a", "c"] and adapters.held == {"c"} and adapters.paths == {"a": "/a", "c": "/c"}
    s = core.add(list(range(1, 13)), SamplingParams(max_tokens=3, ignore_eos=True, seed=7, lora="a"))
    while core.has_unfinished():
        core.step()
    assert s.output_token_ids == expected_output(worker, s)[0] and adapters.num_reloads == 1
    assert worker.dropped == {"c": "/c"} and set(worker.loads) == {"a"}


@pytest.mark.parametrize("depth", [1, 3])
def test_a_weight_update_waits_for_the_sequences_held_and_holds_back_later_ones(depth):
    """Sequences held when a weight update is asked for (running, waiting, preempted) finish on the weights before;
    those added later are admitted only once the worker answered the plan that carries the folder, which runs nothing
    and comes after every cached block was forgotten, and run on the new weights: no sequence sees both."""
    sched, worker = make(num_blocks=10, block_size=4, budget=16, max_num_seqs=2)
    d = Driver(sched, worker, depth)
    prompt = list(range(1, 13))
    early = [seq(i, prompt, max_tokens=6) for i in range(3)]  # three for two rows: one waits
    for s in early:
        sched.add(s)
    d.step()
    d.step()
    sched.preempt(sched.running[-1].seq_id)
    sched.update_weights("/new", ticket="t")
    with pytest.raises(ValueError, match="in progress"):
        sched.update_weights("/other")
    late = [seq(i, prompt, max_tokens=4) for i in range(3, 5)]
    for s in late:
        sched.add(s)
    d.run()
    [load] = [i for i, p in enumerate(d.plans) if p.load_weights]
    plan = d.plans[load]
    assert plan.load_weights == "/new" and not plan.new_seqs and not plan.seq_ids
    started = {ns.seq_id: i for i, p in enumerate(d.plans) for ns in p.new_seqs}
    assert all(started[s.seq_id] < load for s in early) and all(started[s.seq_id] > load for s in late)
    assert [(o.path, o.ticket, o.error) for o in sched.take_weights_outcomes()] == [("/new", "t", "")]
    for s in early:
        assert s.output_token_ids == expected_output(worker, s)[0]
    for s in late:  # the same prompt, and no prefix hit on the blocks the old weights computed
        assert s.output_token_ids == expected_output(worker, s, weights_id("/new"))[0] and s.num_cached_tokens == 0
    assert worker.weights_path == "/new" and sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_weight_update_the_worker_refuses_leaves_the_weights_before():
    """A folder the worker cannot read: the outcome says why, and the sequences held back run on the weights
    before; an idle group is asked at once, in a plan of its own."""
    sched, worker = make()
    d = Driver(sched, worker, 2)
    sched.update_weights("bad")
    s = seq(1, range(1, 9), max_tokens=3)
    sched.add(s)
    d.run()
    assert d.plans[0].load_weights == "bad" and [ns.seq_id for ns in d.plans[1].new_seqs] == [1]
    [outcome] = sched.take_weights_outcomes()
    assert "cannot read" in outcome.error and sched.weights is None
    assert s.output_token_ids == expected_output(worker, s)[0] and worker.weights_path == "fake-model"


def test_whole_prompts_are_admitted_whole_into_one_step_each():
    """An encoder's scheduler (whole_prompts): every sequence starts with all of its prompt in one step, however the
    step's budget and the chunk cap would cut it; one that does not fit what is left waits for the next step, and
    none is ever a running column."""
    sched, worker = make(budget=32, cap=4, max_model_len=32, caching=False)
    sched = Scheduler(sched.config, 64, 4, eos_token_ids=[EOS], epoch=worker.epoch, whole_prompts=True)
    seqs = [seq(i, range(1, n + 1), max_tokens=0, pooling="last") for i, n in enumerate([5, 20, 31, 3, 12, 1], 1)]
    for s in seqs:
        sched.add(s)
    driver = Driver(sched, worker)
    driver.run()
    for plan in driver.plans:
        assert not plan.seq_ids
        assert all(ns.num_computed_tokens == 0 and ns.num_scheduled_tokens == len(ns.token_ids) for ns in plan.new_seqs)
        assert sum(ns.num_scheduled_tokens for ns in plan.new_seqs) <= 32
    assert [len(p.new_seqs) for p in driver.plans if p.new_seqs] == [2, 1, 3]  # 5 + 20; 31; 3 + 12 + 1
    assert all(s.is_finished for s in seqs)
    with pytest.raises(ValueError, match="within max_num_batched_tokens"):
        Scheduler(make(budget=16, max_model_len=32)[0].config, 64, 4, whole_prompts=True)


def test_abort_in_every_state_returns_every_block():
    sched, worker = make(num_blocks=12, block_size=2, budget=6, cap=2)
    d = Driver(sched, worker, 2)
    for i in range(5):
        sched.add(seq(i, range(10 * i + 1, 10 * i + 8), max_tokens=8))
    d.step()
    d.step()
    assert sched.abort(4) and sched.get(4) is None  # still waiting
    assert sched.preempt(1)
    assert sched.abort(1)  # preempted, its preemption not yet sent
    running = sched.running[0]
    assert sched.abort(running.seq_id)  # running, with a plan in flight
    assert not sched.abort(running.seq_id) and not sched.abort(12345)
    d.run()
    assert sched.block_manager.num_free_blocks == 12
    assert not sched._seqs
    sched.block_manager.check([])


def test_external_preemption_is_sent_before_the_sequence_is_resent():
    sched, worker = make()
    d = Driver(sched, worker, 2)
    a = seq(1, range(1, 9), max_tokens=6)
    sched.add(a)
    d.step()
    d.step()
    assert sched.preempt(1)
    plan = sched.schedule()  # nothing else to run: a plan that only drops it
    assert list(plan.preempted_ids) == [1] and not plan.new_seqs and not plan.seq_ids
    worker.submit(plan)
    d.plans.append(plan)
    d.run()
    assert a.output_token_ids == expected_output(worker, a)[0]


def test_results_of_a_preempted_sequence_in_flight_are_discarded():
    sched, worker = make()
    a = seq(1, range(1, 9), max_tokens=6)
    sched.add(a)
    worker.submit(sched.schedule())  # step 1: prefill, samples position 8
    assert sched.preempt(1)
    worker.submit(sched.schedule())  # step 2: drops it
    assert sched.update(worker.receive()) == []  # its token of step 1 is discarded
    assert a.token_ids == list(range(1, 9))
    d = Driver(sched, worker, 2)
    sched.update(worker.receive())
    d.run()
    assert a.output_token_ids == expected_output(worker, a)[0]


def test_a_result_that_does_not_answer_the_plan_is_rejected():
    sched, worker = make()
    sched.add(seq(1, range(1, 5), max_tokens=4))
    sched.add(seq(2, range(1, 5), max_tokens=4))
    plan = sched.schedule()
    wrong = worker.execute(plan)
    wrong.seq_ids[:] = list(reversed(wrong.seq_ids))
    with pytest.raises(RuntimeError, match="does not answer plan 1"):
        sched.update(wrong)
    with pytest.raises(RuntimeError, match="no plan in flight"):
        sched.update(worker_pb2.StepResult(step=2))


def test_logprobs_are_parsed_across_discarded_sequences():
    sched, worker = make()
    d = Driver(sched, worker, 2)
    a = seq(1, range(1, 5), max_tokens=4, logprobs=2)
    b = seq(2, range(1, 5), max_tokens=4, logprobs=1)
    c = seq(3, range(1, 5), max_tokens=4)
    for s in (a, b, c):
        sched.add(s)
    d.step()
    d.step()
    sched.abort(1)  # in flight with top-2 logprobs: its entries must still be skipped
    d.run()
    assert len(b.logprobs) == 4 and c.logprobs is None
    for tok, lp in zip(b.output_token_ids, b.logprobs):
        assert lp.token_id == tok and lp.logprob == fake_logprob(tok)
        assert lp.top == [(tok, fake_logprob(tok))]


def test_prompt_logprobs_are_appended_once_in_order_and_skip_the_prefix_cache():
    """Scores come per chunk; after a preemption the worker scores the prompt again: positions already held are
    skipped. A request asking for them is never served from the prefix cache (its cached part goes unscored)."""
    sched, worker = make()
    d = Driver(sched, worker, 2)
    warm = seq(1, range(1, 12), max_tokens=2)
    sched.add(warm)
    d.run()
    a = seq(2, range(1, 12), max_tokens=2, prompt_logprobs=1)
    sched.add(a)
    assert sched.block_manager.match_prefix(a) == [] and sched.block_manager.match_prefix(seq(3, range(1, 12)))

    def result(start: int, count: int, base: float) -> worker_pb2.StepResult:
        values = [base + k for k in range(count)]
        return worker_pb2.StepResult(prompt_seq_ids=[2], prompt_starts=[start], prompt_counts=[count],
                                     prompt_logprobs=values, prompt_top_token_ids=[7] * count,
                                     prompt_top_logprobs=values)

    sched._add_prompt_logprobs(result(0, 3, 0.0))
    sched._add_prompt_logprobs(result(3, 4, 3.0))
    sched._add_prompt_logprobs(result(0, 10, 100.0))  # recomputed from the start after a preemption
    assert [lp.token_id for lp in a.prompt_logprobs] == list(range(2, 12))
    assert [lp.logprob for lp in a.prompt_logprobs] == [0, 1, 2, 3, 4, 5, 6, 107, 108, 109]
    assert a.prompt_logprobs[0].top == [(7, 0.0)]


def test_admission_limits():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=32, max_waiting=2)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(seq(1, range(30), max_tokens=3))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(seq(2, range(1, 17), max_tokens=4))  # 19 positions > 16 slots
    with pytest.raises(ValueError, match="empty"):
        sched.add(seq(3, []))
    sched.add(seq(4, [1, 2], max_tokens=2))
    with pytest.raises(ValueError, match="in use"):
        sched.add(seq(4, [1, 2], max_tokens=2))
    sched.add(seq(5, [1, 2], max_tokens=2))
    with pytest.raises(QueueFullError):
        sched.add(seq(6, [1, 2], max_tokens=2))
    sched, _ = make(num_blocks=8, block_size=4, max_model_len=32)
    s = seq(7, [1, 2], max_tokens=None)
    sched.add(s)
    assert s.max_len == 32


def test_max_num_seqs_bounds_running():
    sched, worker = make(max_num_seqs=2)
    d = Driver(sched, worker, 2)
    for i in range(5):
        sched.add(seq(i, range(1, 4), max_tokens=3))
    while sched.has_unfinished() or worker.num_in_flight:
        d.step()
        assert sched.num_running <= 2
    assert len(d.finished) == 5


def test_the_routers_mirror_follows_both_tiers():
    """Cache events, applied as a front-end's router applies them (stored, then removed), keep its mirror equal
    to what the group holds in either tier while blocks move to a 2-block host tier and fall out of it."""
    sched, worker = make(num_blocks=7, block_size=1, budget=3, max_num_seqs=1, max_model_len=40, num_host_blocks=2)
    bm = sched.block_manager
    bm.record_events = True
    mirror: set[int] = set()
    for i, (prompt, n) in enumerate([(range(1, 7), 1), (range(1, 4), 3), ([*range(1, 7), 1], 1), (range(20, 25), 2)]):
        sched.add(seq(i + 1, prompt, max_tokens=n))
    host_hashes_seen: set[int] = set()
    while (plan := sched.schedule()) is not None:
        worker.submit(plan)
        sched.update(worker.receive())
        stored, removed = bm.take_events()
        mirror.update(stored)
        mirror.difference_update(removed)
        assert mirror == set(bm.cached_hashes())
        host_hashes_seen |= set(bm.host.index)
    assert bm.num_swapped_out > bm.host.num_blocks  # host blocks were reused: their old hashes left the group
    assert len(host_hashes_seen) > bm.host.num_blocks and mirror


# --- properties ----------------------------------------------------------------------------------

PREFIXES = [list(range(1, 13)), list(range(1, 7)) + [11] * 6, [3, 1, 4, 1, 5, 9, 2, 6]]


class SchedulerMachine(RuleBasedStateMachine):
    """Random interleavings of add (at four priorities) / schedule / result / abort / preempt / worker loss / LoRA
    adapter load and unload / weight update over tiny pools, with up to three plans in flight, a host tier behind the
    GPU's blocks or none, a sliding window or none, and LoRA slots or none. The fake worker checks every plan (block
    tables, KV content of prefix hits wherever they came from and under whichever load of an adapter or of the model's
    weights, no write or swap-in into a block another live sequence holds, no unload of an adapter a held sequence runs
    under, no weights read while a sequence is held); every sequence must produce exactly the tokens f(seed, position)
    of one model's weights (those served when it was added, or those an update asked for then was reading), and when
    everything ends every block of both tiers is free."""

    @initialize(
        num_blocks=st.integers(4, 20),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.integers(3, 24),
        cap=st.integers(0, 6),
        max_num_seqs=st.integers(1, 5),
        caching=st.sampled_from([True, True, True, False]),
        depth=st.sampled_from([1, 2, 3]),
        host=st.sampled_from([0, 2, 6, 24, 24]),
        window=st.sampled_from([0, 0, 3, 5]),
        lora_slots=st.sampled_from([0, 0, 1, 2]),
    )
    def setup(self, num_blocks, block_size, budget, cap, max_num_seqs, caching, depth, host, window, lora_slots):
        self.shape = dict(
            num_blocks=num_blocks,
            block_size=block_size,
            budget=budget,
            cap=cap,
            max_num_seqs=max_num_seqs,
            max_model_len=40,
            caching=caching,
            max_waiting=8,
            vocab_size=10,  # EOS (0) now and then
            num_host_blocks=host,
            sliding_window=window,
            lora_slots=lora_slots,
        )
        self.sched, self.worker = make(**self.shape)
        self.sched.block_manager.record_events = True
        self.mirror: set[int] = set()  # what a front-end's router knows of the group's cached blocks
        self.swapped = self.host_hits = self.lost = 0
        self.depth = depth
        self.next_id = 1
        self.seqs: dict[int, Sequence] = {}
        self.weights = "fake-model"  # the weights the group serves, as the update outcomes say
        self.allowed: dict[int, set[int]] = {}  # per sequence, the weights it may run under (weights_id)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        keep=st.sampled_from([0, 3, 6, 8, 12, 12]),
        tail=st.lists(st.integers(1, 9), max_size=3),
        max_tokens=st.integers(1, 10),
        ignore_eos=st.booleans(),
        min_tokens=st.integers(0, 2),
        logprobs=st.sampled_from([None, 0, 2]),
        lora=st.sampled_from(["", "", "a", "b"]),
        priority=st.sampled_from([0, 0, 0, 1, -1]),
    )
    def add(self, prefix, keep, tail, max_tokens, ignore_eos, min_tokens, logprobs, lora, priority):
        if lora not in ("", *self.sched.adapters.served):
            return  # EngineCore.add refuses it
        prompt = prefix[:keep] + tail
        s = seq(
            self.next_id,
            prompt,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            min_tokens=min(min_tokens, max_tokens),
            logprobs=logprobs,
            stop_token_ids=[7] if max_tokens % 3 == 0 else [],
            lora=lora,
        )
        s.priority = priority
        try:
            self.sched.add(s)
        except (ValueError, QueueFullError):
            return
        self.seqs[s.seq_id] = s
        asked = self.sched.weights
        self.allowed[s.seq_id] = {weights_id(self.weights)} | ({weights_id(asked.path)} if asked else set())
        self.next_id += 1

    def expected(self, s: Sequence) -> tuple[list[int], str]:
        """expected_output under the weights s may run under whose tokens it has so far."""
        wants = [expected_output(self.worker, s, w) for w in sorted(self.allowed[s.seq_id])]
        return next((w for w in wants if w[0][:s.num_output_tokens] == s.output_token_ids), wants[0])

    @rule(bad=st.sampled_from([False, False, True]), back=st.booleans())
    def update_weights(self, bad, back):
        """Weights from another folder (or, back, those the worker started with), or from one it cannot read."""
        self.versions = getattr(self, "versions", 0) + 1
        try:
            self.sched.update_weights("bad" if bad else "fake-model" if back else f"/weights/{self.versions}")
        except ValueError:
            pass

    @precondition(lambda self: self.sched.running)
    @rule(prefix=st.sampled_from(PREFIXES), max_tokens=st.integers(1, 6))
    def add_urgent(self, prefix, max_tokens):
        """A request more urgent than any other while sequences run: where it finds no room it takes theirs."""
        self.add(prefix, 12, [], max_tokens, True, 0, None, "", 2)

    @rule(name=st.sampled_from(["a", "b"]), bad=st.sampled_from([False, False, False, True]))
    def load_adapter(self, name, bad):
        """Each load under a name reads another folder (other weights), so that KV an earlier load computed must
        not be hit; one dropped for room is read again from its own folder, and its KV may be."""
        self.folders = getattr(self, "folders", 0) + 1
        try:
            self.sched.adapters.load(name, "bad" if bad else f"/adapters/{name}/{self.folders}", ticket=bad)
        except AdapterError:
            pass

    @rule(name=st.sampled_from(["a", "b"]))
    def unload_adapter(self, name):
        try:
            self.sched.adapters.unload(name, ticket=False)
        except AdapterError:
            pass

    @precondition(lambda self: self.worker.num_in_flight < self.depth)
    @rule()
    def schedule(self):
        plan = self.sched.schedule()
        if plan is not None:
            self.worker.submit(plan)

    @precondition(lambda self: self.worker.num_in_flight > 0)
    @rule()
    def result(self):
        done = self.sched.update(self.worker.receive())
        for name, why, seqs in self.sched.take_lost():  # its folder became unreadable while it was dropped for room
            assert name not in self.sched.adapters.served and why
            assert all(s.finish_reason == "abort" and s.params.lora == name for s in seqs)
            self.lost += len(seqs)
        for outcome in self.sched.adapters.take_outcomes():
            # only a bad path fails, or a load while each adapter the worker holds runs a sequence
            assert bool(outcome.error) == outcome.ticket or outcome.code == "RESOURCE_EXHAUSTED", outcome
        for outcome in self.sched.take_weights_outcomes():
            assert bool(outcome.error) == (outcome.path == "bad"), outcome
            if not outcome.error:
                self.weights = outcome.path
        for s in done:
            want, reason = self.expected(s)
            assert s.output_token_ids == want[: s.num_output_tokens]
            if s.finish_reason is not None:
                assert (s.finish_reason, s.num_output_tokens) == (reason, len(want))
            if s.logprobs is not None:
                lp = s.logprobs[-1]
                assert lp.token_id == s.token_ids[-1] and lp.logprob == fake_logprob(lp.token_id)
                assert len(lp.top or []) == s.params.logprobs

    @rule(data=st.data())
    def abort(self, data):
        if self.seqs:
            self.sched.abort(data.draw(st.sampled_from(sorted(self.seqs))))

    @rule(data=st.data())
    def preempt(self, data):
        if self.sched.running:
            self.sched.preempt(data.draw(st.sampled_from(self.sched.running)).seq_id)

    @rule()
    def lose_worker(self):
        """The worker group dies with both its tiers and its steps in flight: every live sequence moves to a
        fresh group with the tokens it has and recomputes there (once the new group loaded the adapters the old one
        served, as the supervisor has it), and the old group's blocks all come back."""
        old = self.sched
        self.swapped += old.block_manager.num_swapped_out + old.block_manager.num_swapped_in
        self.host_hits += old.num_host_hit_tokens
        live = sorted(old._seqs.values(), key=lambda s: s.arrival)
        for s in live:
            old.abort(s.seq_id)
        old.check()
        assert old.block_manager.num_free_blocks == old.block_manager.num_blocks
        self.sched, self.worker = make(**self.shape)
        self.sched.block_manager.record_events = True
        self.mirror = set()
        for name in old.adapters.served:
            self.sched.adapters.load(name, old.adapters.paths[name])
        if self.weights != self.worker.weights_path:  # an update asked of the old group died with it
            self.sched.update_weights(self.weights)
        while self.sched.adapters.pending or self.sched.weights:
            if (plan := self.sched.schedule()) is not None:
                self.worker.submit(plan)
            self.sched.update(self.worker.receive())
        assert not any(o.error for o in self.sched.adapters.take_outcomes())
        assert not any(o.error for o in self.sched.take_weights_outcomes())
        for s in live:
            if s.params.lora not in ("", *self.sched.adapters.served):  # being unloaded there: refused here
                del self.seqs[s.seq_id]
                continue
            moved = Sequence(s.seq_id, list(s.token_ids), s.params, prompt_len=s.prompt_len)
            self.sched.add(moved, force=True)
            self.seqs[s.seq_id] = moved

    @invariant()
    def consistent(self):
        if hasattr(self, "sched"):
            self.sched.check()
            bm = self.sched.block_manager
            stored, removed = bm.take_events()
            self.mirror.update(stored)
            self.mirror.difference_update(removed)
            assert self.mirror == set(bm.cached_hashes()), "the routers' mirror of the cache drifted"

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        sched, worker = self.sched, self.worker
        for _ in range(2000):
            if worker.num_in_flight < self.depth and (plan := sched.schedule()) is not None:
                worker.submit(plan)
            elif worker.num_in_flight:
                self.result()
            else:
                break
            sched.check()
        assert not sched.has_unfinished(), "no progress"
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
        sched.block_manager.check([])
        assert not sched._seqs
        bm = sched.block_manager
        event(f"swapped: {self.swapped + bm.num_swapped_out + bm.num_swapped_in > 0}")
        event(f"host hits: {self.host_hits + sched.num_host_hit_tokens > 0}")
        event(f"offloaded ahead: {any(len(p.offload_blocks) for p in worker.plans)}")
        event(f"swapped out at reuse: {any(len(p.swap_out_blocks) for p in worker.plans)}")
        event(f"preempted: {sched.num_preemptions > 0}")
        event(f"released behind a window: {any(len(p.released_ids) for p in worker.plans)}")
        event(f"prefix hits: {sched.num_prefix_hit_tokens > 0}")
        event(f"adapter loads: {min(worker.num_loads, 2)}")
        event(f"adapter unloads: {any(len(p.unload_loras) for p in worker.plans)}")
        event(f"weights read again: {any(p.load_weights for p in worker.plans)}")
        event(f"discarded results: {sum(len(r.seq_ids) for r in worker.results) > sum(s.num_output_tokens for s in self.seqs.values())}")
        for s in self.seqs.values():
            event(f"finish: {s.finish_reason}")
            assert s.is_finished and not s.block_table
            if s.finish_reason != "abort":
                want, reason = self.expected(s)
                assert (s.output_token_ids, s.finish_reason) == (want, reason)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=250, stateful_step_count=80, deadline=None)


class AdapterMachine(SchedulerMachine):
    """The same with LoRA slots and the prefix cache always on, and prompts under adapters most of the time: loads
    and unloads among running, waiting, preempted and cached sequences of the adapters, loads again under a name
    whose cached KV an earlier load computed, and more adapters served than slots (the worker checks that no slot
    changes under a held sequence and that each sequence's KV comes from its adapter's load, whatever slots it
    went through)."""

    @initialize(num_blocks=st.integers(8, 20), block_size=st.sampled_from([1, 2, 4]), budget=st.integers(3, 24),
                max_num_seqs=st.integers(1, 5), depth=st.sampled_from([1, 2, 3]), host=st.sampled_from([0, 6, 24]),
                lora_slots=st.sampled_from([1, 2]), lora_capacity=st.sampled_from([0, 3]))
    def setup(self, num_blocks, block_size, budget, max_num_seqs, depth, host, lora_slots, lora_capacity):
        SchedulerMachine.setup(self, num_blocks, block_size, budget, 0, max_num_seqs, True, depth, host, 0,
                               lora_slots)
        self.shape["lora_capacity"] = lora_capacity
        self.sched, self.worker = make(**self.shape)
        self.sched.block_manager.record_events = True
        for name in "abc":
            self.load_adapter(name, False)
        while self.sched.adapters.pending:  # served from the start
            self.schedule()
            self.result()

    @rule(name=st.sampled_from(["a", "b", "c"]), bad=st.sampled_from([False, False, False, True]))
    def load_more(self, name, bad):
        self.load_adapter(name, bad)

    @rule(name=st.sampled_from(["a", "b", "c"]), prefix=st.sampled_from(PREFIXES), max_tokens=st.integers(1, 6))
    def add_under(self, name, prefix, max_tokens):
        self.add(prefix, 12, [], max_tokens, True, 0, None, name, 0)

    @rule(name=st.sampled_from(["a", "b", "c"]))
    def break_folder(self, name):
        """The adapter's folder can no longer be read: a sequence that waits for it to be read again is lost."""
        if path := self.sched.adapters.paths.get(name):
            self.worker.unreadable.add(path)

    @invariant()
    def a_new_stream_would_serve_the_same_adapters(self):
        """What the worker's Describe would tell a new stream's scheduler (the adapters it holds and those dropped for
        room, with their folders) is what this scheduler serves, whenever no adapter's load or unload is in flight."""
        if not hasattr(self, "sched") or self.sched.adapters.pending:
            return
        adapters, worker = self.sched.adapters, self.worker
        assert {**worker.folders, **worker.dropped} == {name: adapters.paths[name] for name in adapters.served}
        if worker.dropped:
            event("adapters dropped for room, still served")

    def teardown(self):
        super().teardown()
        if hasattr(self, "sched"):
            event(f"adapters placed into slots: {min(self.worker.num_placements, 3)}")
            event(f"adapters read again: {min(self.sched.adapters.num_reloads, 2)}")
            event(f"sequences lost with their adapter: {self.lost > 0}")


TestAdapterMachine = AdapterMachine.TestCase
TestAdapterMachine.settings = settings(max_examples=200, stateful_step_count=100, deadline=None)


def test_block_count_bound_matches_the_worst_case():
    # prompt + max_tokens - 1 positions of KV are ever written: the admission bound is exact.
    sched, worker = make(num_blocks=4, block_size=4, budget=64)
    s = seq(1, range(1, 9), max_tokens=9)
    sched.add(s)
    assert math.ceil((8 + 9 - 1) / 4) == 4
    Driver(sched, worker, 2).run()
    assert s.finish_reason == "length" and len(s.output_token_ids) == 9


def test_sampling_params_resolve_for_the_worker():
    p = SamplingParams(temperature=0.0, top_k=-1, seed=7).to_proto()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.logprobs) == (0.0, 1.0, 0, 0.0, 7, -1)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert SamplingParams(logprobs=0, seed=1).to_proto().logprobs == 0
    assert SamplingParams(seed=5).resolved_seed() == 5
    assert SamplingParams().resolved_seed() != SamplingParams().resolved_seed()
    for bad in (
        dict(max_tokens=0),
        dict(top_k=-2),
        dict(min_p=2.0),
        dict(repetition_penalty=0.0),
        dict(seed=-1),
        dict(stop=[""]),
        dict(logprobs=-1),
        dict(min_tokens=5, max_tokens=4),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad).validate()


def test_priority_admits_first_preempts_last_and_ages():
    """A larger priority is admitted ahead of queued lower ones; equal priorities stay FCFS; a request
    is overtaken by at most priority_aging x (difference in priority) later arrivals."""
    cfg = SchedulerConfig(limits=Limits(max_model_len=64, max_num_seqs=1, max_num_batched_tokens=64),
                          priority_aging=2)
    sched = Scheduler(cfg, 64, 4)
    params = SamplingParams(max_tokens=4, ignore_eos=True, seed=0)
    low = [Sequence(i, [1, 2, 3], params) for i in range(4)]
    for seq in low:
        sched.add(seq)
    urgent = Sequence(10, [4, 5, 6], params, priority=1)
    sched.add(urgent)
    order = [s.seq_id for s in sched.waiting]
    # arrival 4 with priority 1 and aging 2 counts as arrival 2: it overtakes arrival 3 only, ties go
    # to the earlier arrival, so fewer than priority_aging earlier requests are overtaken
    assert order == [0, 1, 2, 10, 3]
    very_urgent = Sequence(11, [7, 8, 9], params, priority=10)
    sched.add(very_urgent)
    plan = sched.schedule()
    assert [n.seq_id for n in plan.new_seqs] == [11]  # admitted first (max_num_seqs=1)


def test_urgent_request_preempts_less_urgent_running_ones():
    """A waiting request that finds no room preempts the last running sequences while they are less urgent than
    it, and is admitted in the same plan; an equally urgent one only waits. Each sequence still ends with its own
    tokens, the preempted one through the prefix cache, and every block is free afterwards."""
    sched, worker = make(num_blocks=8, block_size=4, budget=32, max_num_seqs=4)
    d = Driver(sched, worker, depth=2)
    low = [seq(i, range(10 * i + 1, 10 * i + 11), max_tokens=6) for i in range(2)]  # 10 + 6 tokens: 4 blocks
    for s in low:
        sched.add(s)
    for _ in range(3):
        d.step()
    assert [s.seq_id for s in sched.running] == [0, 1] and sched.block_manager.num_free_blocks == 2
    same = seq(2, range(31, 41), max_tokens=2)
    sched.add(same)
    d.step()
    assert sched.num_preemptions == 0 and same in sched.waiting
    urgent = Sequence(3, list(range(41, 51)), SamplingParams(max_tokens=2, ignore_eos=True, seed=1003), priority=1)
    sched.add(urgent)
    plan = sched.schedule()
    assert list(plan.preempted_ids) == [1] and [n.seq_id for n in plan.new_seqs] == [3]
    worker.submit(plan)
    d.run()
    assert sorted(s.seq_id for s in d.finished) == [0, 1, 2, 3]
    for s in d.finished:
        assert (s.output_token_ids, s.finish_reason) == expected_output(worker, s)
    sched.check()
    assert sched.block_manager.num_free_blocks == 8


def test_an_urgent_prompt_prefills_chunk_after_chunk_past_less_urgent_decodes():
    """An urgent prompt longer than a chunk gets its next chunk's blocks in every plan until its prefill ends, from
    the less urgent sequences decoding beside it (which need no new block meanwhile), rather than waiting for them
    to grow or end."""
    sched, worker = make(num_blocks=8, block_size=8, budget=16, cap=8, max_num_seqs=4)
    d = Driver(sched, worker, depth=1)
    low = [seq(i, range(10 * i + 1, 10 * i + 10), max_tokens=20) for i in range(2)]  # 9 + 20 tokens
    for s in low:
        sched.add(s)
    while any(s.num_computed_tokens < 10 for s in low):  # both decoding, 2 blocks each: 4 free
        d.step()
    urgent = Sequence(2, list(range(41, 81)), SamplingParams(max_tokens=2, ignore_eos=True, seed=1002), priority=1)
    sched.add(urgent)  # 40 tokens: 5 blocks
    chunks = []
    while urgent.num_computed_tokens < 40:
        plan = sched.schedule()
        chunks.append(scheduled(plan).get(2, 0))
        worker.submit(plan)
        sched.update(worker.receive())
        sched.check()
    assert all(chunks) and sched.num_preemptions > 0
    d.run()
    for s in (*low, urgent):
        assert (s.output_token_ids, s.finish_reason) == expected_output(worker, s)
    assert sched.block_manager.num_free_blocks == 8


def test_an_urgent_request_gets_its_first_chunk_of_the_budget_from_less_urgent_prefills():
    """A less urgent prompt still prefilling leaves the waiting head's first chunk of the step's budget to it, where
    it would have taken the whole budget; equally urgent ones keep first come first served."""
    sched, worker = make(num_blocks=64, block_size=4, budget=16, cap=16, max_num_seqs=4)
    d = Driver(sched, worker, depth=1)
    sched.add(seq(0, range(1, 65), max_tokens=2))  # 64 prompt tokens: four steps of the whole budget
    d.step()
    sched.add(seq(1, range(101, 109), max_tokens=2))  # as urgent: waits for the prefill's budget
    plan = sched.schedule()
    assert scheduled(plan) == {0: 16}
    worker.submit(plan)
    sched.update(worker.receive())
    urgent = Sequence(2, list(range(201, 209)), SamplingParams(max_tokens=2, ignore_eos=True, seed=1002), priority=1)
    sched.add(urgent)
    plan = sched.schedule()
    assert scheduled(plan) == {0: 8, 2: 8}
    worker.submit(plan)
    sched.update(worker.receive())
    d.run()
    assert sorted(s.seq_id for s in d.finished) == [0, 1, 2]
    for s in d.finished:
        assert (s.output_token_ids, s.finish_reason) == expected_output(worker, s)
    assert sched.block_manager.num_free_blocks == 64
