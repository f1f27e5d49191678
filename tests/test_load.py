"""Backpressure, deadlines, cancellation, priority, metrics and a soak run, through real processes on
loopback (scheduler + simulated workers: the real protocol and tokenizer, no model).

- `slow`: one simulated worker whose every step takes 100 ms, with a pool of 4 KV blocks of 32 tokens:
  a request R (40-token prompt, 88 new tokens) runs for about 9 s holding 2 to 4 blocks, and a request W
  of a 96-token prompt (3 blocks at admission) cannot be admitted while R runs: it waits. So queueing,
  deadlines in the queue and while running, cancellation and priority are tested without racing.
  The scheduler allows 4 waiting requests (`--max-waiting 4`); both services serve metrics.
- `soak`: a scheduler over two simulated workers with GPU-like step times; 500 requests with random
  parameters and random cancellations over about a minute.
Assertions are on states, counters and orders, never on speed; every wait is bounded.
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from client import AsyncClient, Client
from client.launcher import LocalCluster
from tests.sim_cluster import (WAIT_S, all_idle, config_only_model, free_port, sample, scrape, start_simulated,
                               wait_for, workers)

pytestmark = pytest.mark.timeout(400)

BLOCK = 32
R_PROMPT, R_TOKENS = 40, 88  # 2 blocks at admission, 4 at the end
W_PROMPT, W_TOKENS = 96, 16  # 3 blocks at admission: waits while R runs
STEP_S = 0.1
FREED_S = 5.0  # bound on freeing a cancelled request's blocks (a step is 0.1 s; R has ~9 s to go)
_rng = random.Random(1234)


def _ids(n: int) -> list[int]:
    """Unique random prompts: no prefix-cache hits between requests."""
    return [_rng.randrange(1, 150_000) for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return config_only_model(tmp_path_factory.mktemp("sim-model") / "qwen3-tiny")


@pytest.fixture(scope="module")
def slow(model_dir, tmp_path_factory):
    metrics_port, worker_metrics_port = free_port(), free_port()
    c = start_simulated(model_dir, tmp_path_factory.mktemp("slow-logs"),
                        worker_args=["--num-blocks", "4", "--block-size", str(BLOCK), "--base-ms", str(STEP_S * 1e3),
                                     "--per-token-us", "0", "--per-context-token-ns", "0",
                                     "--metrics-port", str(worker_metrics_port)],
                        scheduler_args=["--max-waiting", "4", "--metrics-port", str(metrics_port)])
    c.metrics_port, c.worker_metrics_port = metrics_port, worker_metrics_port
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(slow):
    with Client(slow.address, timeout=WAIT_S) as c:
        yield c


def _log_entries(cluster: LocalCluster) -> list[dict]:
    """The scheduler's JSON log lines of ended requests so far."""
    entries = []
    for line in (cluster.log_dir / "scheduler.log").read_text(errors="replace").splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:  # text from a library, or the line being written
            continue
    return [e for e in entries if isinstance(e, dict) and "request_id" in e and "status" in e]


def _log_entry(cluster: LocalCluster, request_id: str) -> dict:
    """The scheduler's JSON log line of the request, once written."""
    return wait_for(f"log line of {request_id}", lambda: next(
        (e for e in _log_entries(cluster) if e["request_id"] == request_id), None))


class Stream:
    """One generate() call consumed on its own asyncio task, recording when its first delta came."""

    def __init__(self, ac: AsyncClient, **params):
        self.deltas: list = []
        self.first_at: float | None = None
        self.error: grpc.RpcError | None = None
        self.started = asyncio.Event()
        self.task = asyncio.create_task(self._run(ac, params))

    async def _run(self, ac: AsyncClient, params: dict) -> None:
        try:
            async for d in ac.generate(**params):
                if self.first_at is None:
                    self.first_at = time.monotonic()
                    self.started.set()
                self.deltas.append(d)
        except grpc.RpcError as e:
            self.error = e

    @property
    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    @property
    def finish_reason(self) -> str | None:
        return self.deltas[-1].finish_reason if self.deltas else None

    async def cancel(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass


async def _start_r(ac: AsyncClient, **kw) -> Stream:
    """R runs (its first token arrived) and holds the pool."""
    r = Stream(ac, token_ids=_ids(R_PROMPT), max_tokens=R_TOKENS, ignore_eos=True, **kw)
    await asyncio.wait_for(r.started.wait(), WAIT_S)
    return r


async def _num_waiting(ac: AsyncClient) -> int:
    (w,) = (await ac.model_info())["workers"]
    return w["num_waiting"]


async def _until(what: str, condition, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached after {timeout} s")
        await asyncio.sleep(0.02)


async def _queue(ac: AsyncClient, n: int, **kw) -> list[Stream]:
    """n W requests queued one after the other (each seen waiting before the next is sent: a fixed order)."""
    queued = []
    for _ in range(n):
        before = await _num_waiting(ac)
        queued.append(Stream(ac, token_ids=_ids(W_PROMPT), max_tokens=W_TOKENS, ignore_eos=True, **kw))
        await _until("request queued", lambda: _queue_grew(ac, before))
    return queued


async def _queue_grew(ac: AsyncClient, before: int) -> bool:
    return await _num_waiting(ac) > before


def run(coro, timeout: float = 4 * WAIT_S):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# --- backpressure -------------------------------------------------------------------------------------------


def test_queue_full_is_resource_exhausted_at_once(slow, client):
    before = scrape(slow.metrics_port)

    async def main():
        async with AsyncClient(slow.address, timeout=4 * WAIT_S) as ac:
            r = await _start_r(ac)
            queued = await _queue(ac, 4)
            assert await _num_waiting(ac) == 4
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                await ac.complete(token_ids=_ids(W_PROMPT), max_tokens=W_TOKENS)
            refused_in = time.monotonic() - started
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert "waiting queue is full" in e.value.details()
            assert await _num_waiting(ac) == 4  # the refused one left nothing behind
            for s in [r, *queued]:
                await s.cancel()
            return refused_in

    refused_in = run(main())
    assert refused_in < WAIT_S  # at once: bounded by a step or two, never by the queue draining
    wait_for("every block free", lambda: all_idle(client), FREED_S)
    after = scrape(slow.metrics_port)
    rejected = "splitserve:request_rejected_total"
    assert sample(after, rejected, status="RESOURCE_EXHAUSTED") - sample(before, rejected,
                                                                          status="RESOURCE_EXHAUSTED") == 1


# --- deadlines and cancellation -----------------------------------------------------------------------------


def test_deadline_in_the_queue_is_deadline_exceeded_and_leaves_the_queue(slow, client):
    async def main():
        async with AsyncClient(slow.address, timeout=4 * WAIT_S) as ac:
            r = await _start_r(ac)
            with pytest.raises(grpc.RpcError) as e:
                await ac.complete(token_ids=_ids(W_PROMPT), max_tokens=W_TOKENS, timeout=1.0,
                                  request_id="queued-deadline")
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # It leaves the queue while R still runs: it never got a block.
            await _until("expired request out of the queue", lambda: _queue_empty(ac))
            (w,) = (await ac.model_info())["workers"]
            assert w["num_running"] == 1 and r.finish_reason is None and not r.task.done()
            await r.cancel()

    run(main())
    wait_for("every block free", lambda: all_idle(client), FREED_S)
    entry = _log_entry(slow, "queued-deadline")
    assert entry["status"] == "cancelled (deadline passed)" and entry["completion_tokens"] == 0


async def _queue_empty(ac: AsyncClient) -> bool:
    return await _num_waiting(ac) == 0


def test_deadline_while_running_is_deadline_exceeded_and_frees_blocks(slow, client):
    seen = []
    with pytest.raises(grpc.RpcError) as e:
        for delta in client.generate(token_ids=_ids(R_PROMPT), max_tokens=R_TOKENS, ignore_eos=True, timeout=2.0,
                                     request_id="running-deadline"):
            seen.append(delta)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert seen and seen[-1].finish_reason is None  # it was streaming when the deadline passed
    wait_for("blocks of the expired request free", lambda: all_idle(client), FREED_S)
    entry = _log_entry(slow, "running-deadline")
    assert entry["status"] == "cancelled (deadline passed)" and 0 < entry["completion_tokens"] < R_TOKENS


def test_cancel_mid_stream_frees_blocks_within_a_step(slow, client):
    stream = client.generate(token_ids=_ids(R_PROMPT), max_tokens=R_TOKENS, ignore_eos=True,
                             request_id="cancel-mid")
    next(stream)
    next(stream)
    (w,) = workers(client)
    assert w["num_running"] == 1 and w["free_blocks"] < w["num_blocks"]
    worker_side = scrape(slow.worker_metrics_port)
    assert sample(worker_side, "splitserve:worker_num_requests_running") == 1
    assert sample(worker_side, "splitserve:worker_kv_blocks_used") >= 2
    stream.close()  # cancels the call
    wait_for("blocks of the cancelled request free", lambda: all_idle(client), FREED_S)
    entry = _log_entry(slow, "cancel-mid")
    assert entry["status"] == "cancelled" and entry["completion_tokens"] < R_TOKENS


def test_calls_ended_around_their_admission_are_logged_where_they_were_counted(slow, client):
    """Deadlines of 20-70 ms while a 100 ms step runs (an engine answers adds between steps) end calls before,
    during and after their admission: a call's log line names a group exactly when its completion was counted
    (an abort), also for one that ended while its add was on its way to the engine."""
    aborts = "splitserve:request_success_total"
    before = sample(scrape(slow.metrics_port), aborts, finished_reason="abort")
    running = client.generate(token_ids=_ids(R_PROMPT), max_tokens=R_TOKENS, ignore_eos=True)
    next(running)
    ids = [f"admission-{i}" for i in range(12)]
    for i, rid in enumerate(ids):
        with pytest.raises(grpc.RpcError) as e:
            client.complete(token_ids=_ids(8), max_tokens=4, timeout=0.02 + 0.01 * (i % 6), request_id=rid)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    running.close()
    wait_for("every block free", lambda: all_idle(client), FREED_S)

    def matched() -> bool:  # a handler counts, then logs: polled until every ended call did both
        logged = [e for e in _log_entries(slow) if e["request_id"] in ids]
        counted = sample(scrape(slow.metrics_port), aborts, finished_reason="abort") - before - 1  # less `running`
        return counted == sum(e["worker"] != "-" for e in logged)

    wait_for("log lines naming a group for every counted call", matched)


# --- priority -----------------------------------------------------------------------------------------------


def test_high_priority_is_admitted_ahead_of_queued_low_priority(slow, client):
    """Pool full (R runs); L1, L2, L3 (priority 0) queue in that order, then H (priority 5). When R goes,
    H is admitted first and its stream starts first; the low ones follow in arrival order and finish."""
    async def main():
        async with AsyncClient(slow.address, timeout=4 * WAIT_S) as ac:
            r = await _start_r(ac)
            low = await _queue(ac, 3)
            (high,) = await _queue(ac, 1, priority=5)
            assert all(s.first_at is None for s in [*low, high])
            await r.cancel()  # frees the pool: one W fits at a time
            await asyncio.wait_for(asyncio.gather(*(s.task for s in [high, *low])), 4 * WAIT_S)
            return low, high

    low, high = run(main())
    for s in [high, *low]:
        assert s.error is None, s.error
        assert s.finish_reason == "length" and len(s.tokens) == W_TOKENS
    firsts = [s.first_at for s in [high, *low]]
    assert firsts == sorted(firsts), "high priority first, then the low ones first come first served"
    # One W fits at a time, so each started after the previous one finished.
    assert high.first_at < low[0].first_at
    wait_for("every block free", lambda: all_idle(client), FREED_S)


# --- metrics and structured logs ----------------------------------------------------------------------------


def test_metrics_agree_with_what_the_client_saw(slow, client):
    before = scrape(slow.metrics_port)
    worker_before = scrape(slow.worker_metrics_port)
    finished = []  # (completion, number of messages)

    def complete(**kw):
        deltas = list(client.generate(**kw))
        tokens = [t for d in deltas for t in d.token_ids]
        last = deltas[-1]
        assert last.usage.completion_tokens == len(tokens)
        finished.append((last, tokens, sum(1 for d in deltas if d.token_ids)))
        return last, tokens

    for i in range(3):
        complete(token_ids=_ids(8), max_tokens=3, ignore_eos=True, request_id=f"metrics-len-{i}")
    _, probe = complete(token_ids=_ids(8), max_tokens=4, ignore_eos=True, seed=7, temperature=1.0)
    assert probe[1] not in probe[:1]
    last, _ = complete(token_ids=_ids(8), max_tokens=4, ignore_eos=True, seed=7, temperature=1.0,
                       stop_token_ids=[probe[1]])
    assert last.finish_reason == "stop"
    for bad in ({"top_p": 0.0}, {"n": 99}):
        with pytest.raises(grpc.RpcError):
            client.complete(token_ids=[1, 2], **bad)
    cancelled = client.generate(token_ids=_ids(R_PROMPT), max_tokens=R_TOKENS, ignore_eos=True)
    cancelled_seen = len(next(cancelled).token_ids)
    # n = 2 behind it (the pool fits one of them): its deadline passes while its first completion waits and before its
    # second is submitted. Both count as aborts, as do the two inputs of an embedding call queued beside it.
    with ThreadPoolExecutor(1) as pool:
        embedding = pool.submit(client.embed, [_ids(W_PROMPT), _ids(W_PROMPT)], timeout=1.0)
        with pytest.raises(grpc.RpcError) as late:
            client.complete(token_ids=_ids(W_PROMPT), max_tokens=W_TOKENS, n=2, timeout=1.0)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.RpcError) as late:
            embedding.result()
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    cancelled.close()
    wait_for("every block free", lambda: all_idle(client), FREED_S)
    _log_entry(slow, "metrics-len-2")

    after = scrape(slow.metrics_port)

    def delta(name: str, **labels) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    by_reason = {r: delta("splitserve:request_success_total", finished_reason=r) for r in ("stop", "length", "abort")}
    assert by_reason == {"stop": 1, "length": 4, "abort": 5}
    assert delta("splitserve:request_rejected_total", status="INVALID_ARGUMENT") == 2
    seen_tokens = sum(len(tokens) for _, tokens, _ in finished)
    generated = delta("splitserve:generation_tokens_total")
    # The cancelled stream: what the client read, plus at most the few tokens written before the cancel landed.
    assert seen_tokens + cancelled_seen <= generated <= seen_tokens + cancelled_seen + 10
    assert delta("splitserve:prompt_tokens_total") == sum(c.usage.prompt_tokens for c, _, _ in finished)
    assert delta("splitserve:prefix_cache_hits_total") == sum(c.usage.cached_prompt_tokens for c, _, _ in finished)
    assert delta("splitserve:time_to_first_token_seconds_count") == len(finished) + 1
    assert delta("splitserve:e2e_request_latency_seconds_count") == len(finished) + 2
    assert delta("splitserve:inter_token_latency_seconds_count") >= sum(m - 1 for _, _, m in finished)
    (w,) = workers(client)
    address = w["address"]
    assert delta("splitserve:step_duration_seconds_count", worker=address) >= seen_tokens
    assert sample(after, "splitserve:plan_size_bytes_count", worker=address) >= 1
    assert sample(after, "splitserve:kv_blocks_free", worker=address) == 4
    assert sample(after, "splitserve:num_requests_running", worker=address) == 0
    assert sample(after, "splitserve:worker_alive", worker=address) == 1
    # vLLM's families and label: model_name on every series, per-completion token histograms, queries and hits
    assert all(dict(labels).get("model_name") for (_, labels) in after), "a series without model_name"
    assert delta("splitserve:prefix_cache_queries_total") == delta("splitserve:prompt_tokens_total")
    assert delta("splitserve:request_prompt_tokens_count") == len(finished)
    assert delta("splitserve:request_generation_tokens_sum") == seen_tokens
    assert delta("splitserve:request_decode_time_seconds_count") == len(finished)
    for phase in ("queue", "prefill", "inference"):  # every completion that ran was admitted once
        assert delta(f"splitserve:request_{phase}_time_seconds_count") == len(finished), phase
    # the slow worker's steps: a completion's run takes at least its tokens' steps
    assert delta("splitserve:request_inference_time_seconds_sum") >= delta("splitserve:request_decode_time_seconds_sum")
    assert delta("splitserve:iteration_tokens_total_count", worker=address) >= seen_tokens
    assert delta("splitserve:num_preemptions_total", worker=address) == 0

    worker_after = scrape(slow.worker_metrics_port)
    assert all(dict(labels).get("model_name") for (_, labels) in worker_after)
    assert sample(worker_after, "splitserve:worker_kv_blocks_total") == 4
    # The worker drops finished sequences when the next plan tells it (none is sent while idle).
    assert sample(worker_after, "splitserve:worker_num_requests_running") <= 1
    assert (sample(worker_after, "splitserve:worker_step_duration_seconds_count")
            - sample(worker_before, "splitserve:worker_step_duration_seconds_count")) >= seen_tokens
    assert any(name == "splitserve:worker_epoch_info" for name, _ in worker_after)
    # a simulated worker builds no GPU kernel: both phases exported, both 0
    builds = {dict(labels)["phase"]: v for (name, labels), v in worker_after.items()
              if name == "splitserve:worker_kernel_builds_total"}
    assert builds == {"warm_up": 0, "serving": 0}

    # The per-request log line: one JSON object with the request's fields.
    entry = _log_entry(slow, "metrics-len-2")
    assert entry["level"] == "INFO" and entry["logger"] == "splitserve.scheduler" and "time" in entry
    assert (entry["completion_tokens"], entry["prompt_tokens"], entry["finish_reason"], entry["status"]) == (
        3, 8, "length", "done")
    assert entry["latency_s"] > 0 and entry["worker"] == address


# --- soak ---------------------------------------------------------------------------------------------------

SOAK_REQUESTS = 500
SOAK_ARRIVAL_S = 30.0  # arrivals spread over this long (Poisson)
WORDS = ["red", "fox", "jumps", "über", "水", "the", "a", "lazy", "dog", "🙂", "\n"]


@pytest.fixture(scope="module")
def soak(model_dir, tmp_path_factory):
    metrics_port = free_port()
    c = start_simulated(model_dir, tmp_path_factory.mktemp("soak-logs"), num_workers=2,
                        worker_args=["--num-blocks", "96", "--block-size", "16", "--max-num-seqs", "32"],
                        scheduler_args=["--metrics-port", str(metrics_port)])
    c.metrics_port = metrics_port
    yield c
    c.stop()


def _soak_request(i: int, rng: random.Random) -> dict:
    p: dict = {"request_id": f"soak-{i}", "priority": rng.randint(-2, 2)}
    kind = rng.random()
    if kind < 0.5:
        p["token_ids"] = [rng.randrange(1, 150_000) for _ in range(rng.randint(1, 150))]
    elif kind < 0.8:
        p["prompt"] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    else:
        p["messages"] = [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20)))}]
    p["temperature"] = rng.choice([0.0, 0.7, 1.0])
    if rng.random() < 0.3:
        p["top_p"] = rng.choice([0.5, 0.9])
    if rng.random() < 0.3:
        p["top_k"] = rng.choice([1, 20])
    if rng.random() < 0.5:
        p["seed"] = rng.randrange(2**32)
    if rng.random() < 0.2:
        p["n"] = 2
    # What happens to it: finishes (70%), cancelled by the client after a few deltas (20%), or a short
    # deadline (10%). Cancelled ones are long, so that they are cut mid-stream.
    fate = rng.random()
    if fate < 0.7:
        p["max_tokens"] = rng.randint(1, 48)
        p["ignore_eos"] = rng.random() < 0.5
        if rng.random() < 0.2:
            p["stop"] = [rng.choice(["a", "e", "the", "水"])]
        if rng.random() < 0.1:
            p["stop_token_ids"] = [rng.randrange(0, 75_000) for _ in range(5)]
        fate = ("finish", None)
    elif fate < 0.9:
        p["max_tokens"] = 300
        p["ignore_eos"] = True
        fate = ("cancel", rng.randint(1, 3))
    else:
        p["max_tokens"] = 300
        p["ignore_eos"] = True
        fate = ("deadline", rng.uniform(0.05, 0.3))
    return {"params": p, "fate": fate, "at": 0.0}


def test_soak_500_random_requests_with_cancellations(soak):
    rng = random.Random(6)
    requests = [_soak_request(i, rng) for i in range(SOAK_REQUESTS)]
    at = 0.0
    for r in requests:
        at += rng.expovariate(SOAK_REQUESTS / SOAK_ARRIVAL_S)
        r["at"] = at
    with Client(soak.address, timeout=WAIT_S) as c:
        wait_for("idle before", lambda: all_idle(c))
        requests_before = sum(w["num_requests"] for w in workers(c))
    before = scrape(soak.metrics_port)

    # Scrape the metrics endpoint all along, as Prometheus would.
    stop_scraping = threading.Event()
    scrapes = []

    def scraper():
        while not stop_scraping.wait(1.0):
            scrapes.append(scrape(soak.metrics_port))

    scraper_thread = threading.Thread(target=scraper, daemon=True)
    scraper_thread.start()

    async def one(ac: AsyncClient, r: dict, t0: float) -> dict:
        await asyncio.sleep(max(0.0, t0 + r["at"] - time.monotonic()))
        p, (fate, arg) = r["params"], r["fate"]
        n = p.get("n", 1)
        out = {"deltas": {i: [] for i in range(n)}, "error": None, "cut": False}
        timeout = arg if fate == "deadline" else 4 * WAIT_S
        stream = ac.generate(timeout=timeout, **p)
        seen = 0
        try:
            async for d in stream:
                out["deltas"][d.index].append(d)
                seen += 1
                if fate == "cancel" and seen >= arg:
                    out["cut"] = True
                    break
        except grpc.RpcError as e:
            out["error"] = e.code()
        finally:
            await stream.aclose()  # cancels the call at once when left early
        return out

    async def main():
        async with AsyncClient(soak.address) as ac:
            t0 = time.monotonic()
            return await asyncio.gather(*[one(ac, r, t0) for r in requests])

    started = time.monotonic()
    try:
        results = run(main(), timeout=SOAK_ARRIVAL_S + 4 * WAIT_S)
    finally:
        stop_scraping.set()
        scraper_thread.join()
    soak_s = time.monotonic() - started

    finished = {"stop": 0, "length": 0}  # completions whose final delta the client saw
    cut = 0  # completions the client cut (cancel, deadline) before their end
    seen_tokens = 0
    for r, out in zip(requests, results):
        p, (fate, _) = r["params"], r["fate"]
        if fate == "finish":
            assert out["error"] is None and not out["cut"], (p, out["error"])
        elif fate == "deadline":
            assert out["error"] in (None, grpc.StatusCode.DEADLINE_EXCEEDED), (p, out["error"])
        else:
            assert out["error"] is None, (p, out["error"])
        for deltas in out["deltas"].values():
            tokens = [t for d in deltas for t in d.token_ids]
            seen_tokens += len(tokens)
            if not deltas or deltas[-1].finish_reason is None:
                assert fate != "finish", p
                cut += 1
                continue
            last = deltas[-1]
            assert last.finish_reason in ("stop", "length"), (p, last)
            finished[last.finish_reason] += 1
            assert last.usage.completion_tokens == len(tokens)
            if "token_ids" in p:
                assert last.usage.prompt_tokens == len(p["token_ids"])
            if last.finish_reason == "length":
                assert len(tokens) == p["max_tokens"], p
            else:
                assert last.stop_reason in p.get("stop", []) or int(last.stop_reason) in p.get("stop_token_ids", []), \
                    (p, last)
    completions = sum(r["params"].get("n", 1) for r in requests)
    assert sum(finished.values()) + cut == completions
    assert cut >= 50, "the random cancellations happened"

    with Client(soak.address, timeout=WAIT_S) as c:
        wait_for("zero leaked blocks", lambda: all_idle(c))
        assert sum(w["num_requests"] for w in workers(c)) - requests_before <= completions
        assert all(w["alive"] for w in workers(c))
    assert soak.exited() is None

    n_of = {r["params"]["request_id"]: r["params"].get("n", 1) for r in requests}
    fates = {r["params"]["request_id"]: (r["fate"][0], out) for r, out in zip(requests, results)}

    def counted() -> tuple[dict, int, int] | None:
        """(metrics, completions that reached an engine, completions of calls that never reached the front-end's
        handler) once every request that reached an engine is counted. A call whose deadline passed before the
        front-end took it (a loaded machine) is neither logged nor counted, as no engine saw it."""
        logged = {e["request_id"]: e for e in _log_entries(soak) if e["request_id"] in n_of}  # the log first
        samples = scrape(soak.metrics_port)
        total = sum(sample(samples, "splitserve:request_success_total", finished_reason=r)
                    - sample(before, "splitserve:request_success_total", finished_reason=r)
                    for r in ("stop", "length", "abort"))
        reached = sum(n_of[rid] for rid, e in logged.items() if e["worker"] != "-")
        unseen = [rid for rid in n_of if rid not in logged]
        pending = [(rid, fates[rid][0], fates[rid][1]["error"]) for rid in unseen if fates[rid][0] != "deadline"]
        waiting.update(counted=total, reached=reached, unlogged_without_deadline=pending[:5])
        if pending:
            return None  # their handlers have not ended yet
        for rid in unseen:
            out = fates[rid][1]
            assert out["error"] == grpc.StatusCode.DEADLINE_EXCEEDED and not any(out["deltas"].values()), (rid, out)
        return (samples, reached, sum(n_of[rid] for rid in unseen)) if total == reached else None

    # A cut stream counts its abort when its handler sees the cancellation, which may come after the engine has
    # freed its blocks (its sequence ended there first): wait for every count before comparing them.
    waiting: dict = {}  # what counted() last saw, for the message if it never holds
    try:
        after, reached, unseen = wait_for("every completion counted", counted)
    except AssertionError as e:
        raise AssertionError(f"{e}: {waiting}") from None
    assert unseen <= completions // 10, unseen

    def delta(name: str, **labels) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    server = {r: delta("splitserve:request_success_total", finished_reason=r) for r in ("stop", "length", "abort")}
    # Every completion that reached an engine counted once. A completion the client cut may still have finished at
    # the server first (its end was already on the wire): counted by its reason there, so aborts <= cuts.
    assert sum(server.values()) == reached >= completions - unseen - cut, (server, reached, completions)
    late = cut - server["abort"] - (completions - reached)
    assert late >= 0, (server, cut)
    assert server["stop"] >= finished["stop"] and server["length"] >= finished["length"], (server, finished)
    assert server["stop"] + server["length"] == finished["stop"] + finished["length"] + late
    assert delta("splitserve:generation_tokens_total") >= seen_tokens
    assert sum(v for (name, _), v in after.items() if name == "splitserve:request_rejected_total") == sum(
        v for (name, _), v in before.items() if name == "splitserve:request_rejected_total")
    assert len(scrapes) >= 10
    print(f"soak: {SOAK_REQUESTS} requests, {completions} completions in {soak_s:.1f} s; finished {finished}, "
          f"cut {cut} (of which finished at the server first: {late}; never reached an engine: "
          f"{completions - reached}); "
          f"server {server}; scrapes {len(scrapes)}")


# ---- many concurrent streams ---------------------------------------------------------------------------
WIDE_MAIN, WIDE_SIDES, WIDE_SIDE = 2048, 4, 512  # 4,096 streams: 2,048 on one connection, 4 x 512 on others
WIDE_TOKENS = 16


def _wide_prompt(i: int) -> list[int]:
    return [1 + (i * 7 + j) % 1000 for j in range(40)]


async def _wide_streams(address: str, first: int, count: int) -> list[tuple[int, str]]:
    """(tokens received, error) of each of `count` streams opened at once on one connection."""
    async with AsyncClient(address) as c:
        async def one(i: int) -> tuple[int, str]:
            tokens = 0
            try:
                async for delta in c.generate(token_ids=_wide_prompt(i), max_tokens=WIDE_TOKENS, ignore_eos=True,
                                              timeout=WAIT_S * 3):
                    tokens += len(delta.token_ids)
            except grpc.RpcError as e:
                return tokens, f"{e.code().name}: {e.details()}"
            return tokens, ""

        return await asyncio.gather(*(one(first + i) for i in range(count)))


def _wide_side(address: str, first: int, count: int, results) -> None:
    results.put(asyncio.run(_wide_streams(address, first, count)))


@pytest.fixture(scope="module")
def wide(model_dir, tmp_path_factory):
    c = start_simulated(model_dir, tmp_path_factory.mktemp("wide-logs"),
                        worker_args=["--num-blocks", "8192", "--block-size", "16", "--max-num-seqs", "512"])
    yield c
    c.stop()


def test_a_client_that_stops_reading_stalls_only_its_own_streams(wide):
    """A client that stops reading 24 long streams (no BDP probing, large messages: 20 top logprobs a token),
    so that their output backs up into the front-end (checked once: 85 tokens went out in one message when such
    a stream was read again): streams of other clients still complete meanwhile, and cancelling the stalled
    calls frees their blocks."""
    from client.client import build_request
    from protos import splitserve_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(wide.address, options=[("grpc.http2.bdp_probe", 0),
                                                           ("grpc.use_local_subchannel_pool", 1)])
    stub = pb_grpc.GenerationStub(channel)
    stalled = [stub.Generate(build_request(token_ids=_wide_prompt(10_000 + k), max_tokens=470, ignore_eos=True,
                                           logprobs=20), timeout=WAIT_S * 3) for k in range(24)]
    try:
        for call in stalled:
            next(call)  # then no more reads
        time.sleep(2.0)  # ~64 KB of ~250-byte messages fill a stream's window well before this
        outcomes = asyncio.run(_wide_streams(wide.address, 20_000, 64))
        assert outcomes == [(WIDE_TOKENS, "")] * 64
    finally:
        for call in stalled:
            call.cancel()
        channel.close()
    with Client(wide.address) as c:
        wait_for("every block free", lambda: all_idle(c))


def _untaken_calls(options: list[tuple[str, int]], block_s: float, calls: int = 4) -> list[str]:
    """How streaming calls end that reach a grpc.aio server (with these options) at once while its event loop is
    blocked for block_s, as a busy front-end's is: "OK", or the code and details."""
    def handler(request: bytes, context):
        yield b"x"

    async def serve() -> list[str]:
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "t.T", {"S": grpc.unary_stream_rpc_method_handler(handler)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        sent = threading.Barrier(calls + 1)

        def call(channel) -> str:
            stream = channel.unary_stream("/t.T/S")(b"", timeout=WAIT_S)
            sent.wait(WAIT_S)
            try:
                list(stream)
                return "OK"
            except grpc.RpcError as e:
                return f"{e.code().name}: {e.details()}"

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, ThreadPoolExecutor(calls) as pool:
            grpc.channel_ready_future(channel).result(timeout=WAIT_S)
            loop = asyncio.get_running_loop()
            outcomes = [loop.run_in_executor(pool, call, channel) for _ in range(calls)]
            sent.wait(WAIT_S)
            time.sleep(block_s)  # the loop takes no call meanwhile
            try:
                return list(await asyncio.gather(*outcomes))
            finally:
                await server.stop(None)

    return asyncio.run(serve())


def test_calls_a_busy_front_end_takes_late_are_not_cancelled():
    """gRPC core cancels calls the server has not taken within server_max_unrequested_time_in_server (30 s by
    default) with a bare CANCELLED: with the public server's options lowered to 1 s this shows it; the public
    server's own bound is a week, so a call waits for a busy front-end (or for its client's deadline)."""
    from scheduler_svc.frontend import MAX_UNTAKEN_S, PUBLIC_SERVER_OPTIONS

    name = "grpc.server_max_unrequested_time_in_server"
    assert dict(PUBLIC_SERVER_OPTIONS)[name] == MAX_UNTAKEN_S >= 24 * 3600
    lowered = [(k, 1 if k == name else v) for k, v in PUBLIC_SERVER_OPTIONS]
    assert [o.split(":")[0] for o in _untaken_calls(lowered, block_s=2.5)].count("CANCELLED") >= 2
    assert _untaken_calls(PUBLIC_SERVER_OPTIONS, block_s=2.5) == ["OK"] * 4


def test_4096_concurrent_streams_all_complete_with_all_their_tokens(wide):
    """A burst larger than gRPC core's default bound on calls the server has not taken yet (1,000), which
    cancelled the excess without a message: every stream completes."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    sides = [ctx.Process(target=_wide_side, args=(wide.address, WIDE_MAIN + k * WIDE_SIDE, WIDE_SIDE, results))
             for k in range(WIDE_SIDES)]
    for p in sides:
        p.start()
    outcomes = asyncio.run(_wide_streams(wide.address, 0, WIDE_MAIN))
    for _ in sides:
        outcomes += results.get(timeout=WAIT_S * 4)
    for p in sides:
        p.join(timeout=WAIT_S)
    assert len(outcomes) == WIDE_MAIN + WIDE_SIDES * WIDE_SIDE
    failed = [o for o in outcomes if o != (WIDE_TOKENS, "")]
    assert not failed, f"{len(failed)} streams: {failed[:5]}"
    with Client(wide.address) as c:
        wait_for("every block free", lambda: all_idle(c))
