"""Faults and membership through real processes on loopback (CPU): workers killed, stopped, restarted,
joining and draining; the scheduler drained and killed.

Most clusters run the simulated worker (`worker_svc.cli simulate`): the real protocol and handshake, no
model, and a token that depends only on (seed, position), so a seeded stream has one right answer
whatever worker computes it; `--base-ms` keeps streams in flight for a few seconds. The kill -9 test
runs the real qwen3-tiny model with greedy sampling. Every wait is bounded; there is no assertion on
speed (the detection bounds below are the configured timeouts plus a wide margin).
"""
from __future__ import annotations


from dataclasses import dataclass, field
import functools
import os
from pathlib import Path
import random
import re
import signal
import threading
import time

import grpc
import pytest

from client import Client
from client.launcher import PUBLIC_SERVICE, LocalCluster, Process, free_port, health_status
from tests import sim_cluster
from tests.sim_cluster import sample, scrape

pytestmark = pytest.mark.timeout(300)

WAIT_S = 60.0
SIM_ARGS = ["--base-ms", "30", "--num-blocks", "512", "--block-size", "16", "--log-format", "text"]
# Short reconnection backoff so that a worker that comes back is taken in quickly.
SCHED_ARGS = [*sim_cluster.TREE_ARGS, "--log-format", "text", "--reconnect-backoff-max", "1"]
SIM_TOKENS = 80  # at 30 ms a step, a few seconds per stream


# the bound of this module's functional waits
wait_for = functools.partial(sim_cluster.wait_for, timeout=WAIT_S)


@dataclass
class Stream:
    """One Generate call on a thread of its own, recorded as the client sees it."""
    params: dict
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: object = None
    error: grpc.RpcError | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, client: Client) -> None:
        try:
            for delta in client.generate(**self.params):
                self.token_ids += delta.token_ids
                self.text += delta.text
                if delta.finish_reason:
                    self.finish_reason, self.usage = delta.finish_reason, delta.usage
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.done.set()


def start_streams(client: Client, requests: list[dict]) -> list[Stream]:
    streams = [Stream(r) for r in requests]
    for s in streams:
        threading.Thread(target=s.run, args=(client,), daemon=True).start()
    return streams


def join(streams: list[Stream], timeout: float = WAIT_S * 2) -> list[Stream]:
    deadline = time.monotonic() + timeout
    for s in streams:
        assert s.done.wait(max(0.0, deadline - time.monotonic())), "a stream did not end"
    return streams


def run_streams(client: Client, requests: list[dict]) -> list[Stream]:
    return join(start_streams(client, requests))


def sim_requests(n: int, seed: int, max_tokens: int = SIM_TOKENS) -> list[dict]:
    rng = random.Random(seed)
    return [dict(token_ids=[rng.randrange(1, 50000) for _ in range(rng.randint(3, 40))], max_tokens=max_tokens,
                 seed=seed * 1000 + i, ignore_eos=True) for i in range(n)]


def assert_same(streams: list[Stream], reference: list[Stream]) -> None:
    """Every stream completed, and the client saw exactly the tokens and text of the run without a fault."""
    for i, (s, ref) in enumerate(zip(streams, reference, strict=True)):
        assert s.error is None, f"stream {i}: {s.error.code()}: {s.error.details()}"
        assert s.finish_reason == ref.finish_reason == "length", i
        assert s.token_ids == ref.token_ids, f"stream {i}: tokens differ from the run without the fault"
        assert s.text == ref.text, i
        assert s.usage.prompt_tokens == len(s.params["token_ids"]), i
        assert s.usage.completion_tokens == len(s.token_ids) == s.params["max_tokens"], i


def live_workers(client: Client) -> dict[str, dict]:
    return {w["address"]: w for w in client.model_info(timeout=10)["workers"] if w["alive"]}


def all_idle(client: Client) -> bool:
    workers = live_workers(client).values()
    return all(w["free_blocks"] == w["num_blocks"] and w["num_running"] == 0 and w["num_waiting"] == 0
               for w in workers)


def workers_of(cluster: LocalCluster) -> list[Process]:
    return [p for p in cluster.processes if p.name.startswith("worker")]


def scheduler_of(cluster: LocalCluster) -> Process:
    return [p for p in cluster.processes if p.name == "scheduler"][-1]


def kill(proc: Process, sig: int = signal.SIGKILL) -> None:
    os.kill(proc.popen.pid, sig)
    if sig == signal.SIGKILL:
        proc.popen.wait(30)


def sim_cluster(model_dir: Path, log_dir: Path, n: int, scheduler_args: list[str] = (), register: bool = False,
                worker_args: list[str] = ()) -> LocalCluster:
    return LocalCluster(model_dir, num_workers=n, worker_command="simulate",
                        worker_args=[*SIM_ARGS, *worker_args], scheduler_args=[*SCHED_ARGS, *scheduler_args],
                        log_dir=log_dir, register=register).start(timeout=120)


@pytest.fixture
def cluster_factory(tiny_model_dir, tmp_path):
    clusters: list[LocalCluster] = []

    def make(n: int, *scheduler_args: str, register: bool = False, worker_args: list[str] = ()) -> LocalCluster:
        c = sim_cluster(tiny_model_dir, tmp_path / f"logs-{len(clusters)}", n, list(scheduler_args), register,
                        list(worker_args))
        clusters.append(c)
        with Client(c.address, timeout=10) as client:
            wait_for(f"{n} workers connected", lambda: len(live_workers(client)) == n)
        return c

    yield make
    for c in clusters:
        for p in c.processes:
            if p.popen.poll() is None:
                os.kill(p.popen.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
        c.stop()


# --- in process: a request moved between engines continues exactly -------------------------------------------


@pytest.fixture(scope="module")
def fake_model_dir(tmp_path_factory):
    from tests.fake_worker import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("fake-model"), tmp_path_factory.getbasetemp() / "qwen3-tokenizer")


def test_requests_detached_from_one_engine_continue_exactly_in_another(fake_model_dir):
    """What the scheduler does when a worker dies or drains (engine.move_out, then move_in elsewhere): the
    outputs, text (stop strings across the move included), logprobs and usage are those of a run without
    the move, whatever step it happens at."""
    import xxhash

    from common.limits import Limits
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.engine import LLMEngine
    from scheduler_svc.sampling import SamplingParams
    from scheduler_svc.tokenizer import load_tokenizer
    from tests.fake_worker import FakeWorker

    tok = load_tokenizer(fake_model_dir)
    words = tok.encode(" the quick brown fox jumps over a lazy dog 日本 😀 END OF")

    def token(seed: int, position: int) -> int:
        return words[xxhash.xxh64_intdigest(position.to_bytes(8, "little"), seed) % len(words)]

    def engine(num_blocks: int = 64) -> LLMEngine:
        return LLMEngine(fake_model_dir, FakeWorker(num_blocks, 4, max_model_len=512, vocab_size=151936,
                                                    token_fn=token),
                         SchedulerConfig(limits=Limits(max_num_batched_tokens=16)), tok)

    requests = [("Hello there", SamplingParams(max_tokens=20, seed=1, ignore_eos=True)),
                ("Tell me a story about a fox", SamplingParams(max_tokens=30, seed=18, stop=["lazy dog"])),
                ([1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=25, seed=3, logprobs=2, ignore_eos=True)),
                ("日本語の文章", SamplingParams(max_tokens=17, seed=4, ignore_eos=True, min_tokens=5))]

    def collect(got: dict, outputs) -> None:
        for out in outputs:
            c = got.setdefault(out.request_id, {"tokens": [], "text": "", "logprobs": []})
            assert "finish" not in c, "output after the final one"
            c["tokens"] += out.token_ids
            c["text"] += out.text
            c["logprobs"] += [lp.logprob for lp in out.logprobs or []]
            if out.finished:
                c["finish"], c["usage"] = out.finish_reason, out.usage

    def run(e: LLMEngine, got: dict, steps: int = 10_000) -> None:
        for _ in range(steps):
            if not e.has_unfinished():
                return
            collect(got, e.step())

    reference: dict = {}
    first = engine()
    for i, (prompt, params) in enumerate(requests):
        first.add_request(prompt, params, f"r{i}")
    run(first, reference)
    assert len(reference) == len(requests)
    assert reference["r1"]["finish"] == "stop" and len(reference["r1"]["tokens"]) == 23  # at "lazy dog"
    for cut in (0, 1, 2, 5, 9, 14, 20, 23):
        got: dict = {}
        a, b = engine(), engine(num_blocks=40)
        for i, (prompt, params) in enumerate(requests):
            a.add_request(prompt, params, f"r{i}")
        run(a, got, cut)
        for moving in a.move_out():
            b.move_in(moving)
        assert a.num_unfinished == 0 and a.scheduler.block_manager.num_free_blocks == 64
        run(b, got)
        assert got == reference, f"moved after {cut} steps"
        assert b.scheduler.block_manager.num_free_blocks == 40 and not b.scheduler.has_unfinished()
    for i, (prompt, params) in enumerate(requests):
        usage = reference[f"r{i}"]["usage"]
        assert usage.prompt_tokens == len(prompt if isinstance(prompt, list) else tok.encode(prompt))
        assert usage.completion_tokens == len(reference[f"r{i}"]["tokens"])


# --- worker killed: real model, greedy, token-exact ----------------------------------------------------------


@pytest.fixture(scope="module")
def real2(tiny_model_dir, tmp_path_factory):
    c = LocalCluster(tiny_model_dir, num_workers=2,
                     worker_args=["--num-blocks", "256", "--block-size", "16", "--max-num-seqs", "32",
                                  "--debug-step-delay", "0.05", "--log-format", "text"],
                     scheduler_args=SCHED_ARGS, log_dir=tmp_path_factory.mktemp("real2-logs")).start(timeout=240)
    yield c
    c.stop()


def test_kill9_one_of_two_workers_every_stream_equals_a_run_without_the_fault(real2):
    rng = random.Random(7)
    requests = [dict(token_ids=[rng.randrange(1, 150000) for _ in range(rng.randint(4, 40))], max_tokens=40,
                     temperature=0.0, ignore_eos=True) for _ in range(32)]
    with Client(real2.address, timeout=WAIT_S * 3) as client:
        wait_for("both workers connected", lambda: len(live_workers(client)) == 2)
        reference = run_streams(client, requests)
        assert all(s.error is None and len(s.token_ids) == 40 for s in reference)
        assert len(live_workers(client)) == 2
        streams = start_streams(client, requests)
        wait_for("every stream streaming", lambda: all(len(s.token_ids) >= 8 for s in streams))
        assert not any(s.done.is_set() for s in streams), "streams ended before the fault: slow the workers"
        victim = workers_of(real2)[0]
        kill(victim)
        join(streams)
        assert_same(streams, reference)
        # The survivor serves on; the dead worker is out, its requests were moved by recompute.
        assert health_status(real2.address, PUBLIC_SERVICE) == "SERVING"
        assert list(live_workers(client)) == [f"127.0.0.1:{real2.worker_ports[1]}"]
        wait_for("every block free", lambda: all_idle(client))
    log = scheduler_of(real2).log_path.read_text()
    assert "moved to worker" in log


def test_kill9_a_worker_under_an_embed_call_its_inputs_move_and_the_call_equals_a_run_without_the_fault(real2):
    """After the test above (its dead worker restarted on its port): an Embed call's inputs spread over both
    workers; one is killed while it still holds some; they are recomputed on the other and the call answers as
    it did without the fault."""
    rng = random.Random(11)
    inputs = [[rng.randrange(1, 150000) for _ in range(rng.randint(20, 60))] for _ in range(384)]  # 6+ steps a worker
    with Client(real2.address, timeout=WAIT_S * 3) as client:
        dead = [p for p in workers_of(real2) if p.popen.poll() is not None]
        for proc in dead:
            real2.start_worker(int(proc.name.removeprefix("worker-")))
        wait_for("both workers connected", lambda: len(live_workers(client)) == 2)
        reference = client.embed(inputs).vectors
        result: list = []
        call = threading.Thread(target=lambda: result.append(client.embed(inputs).vectors))
        call.start()
        busy: list[str] = []

        def one_is_busy() -> bool:
            busy[:] = [a for a, w in live_workers(client).items() if w["num_running"] or w["num_waiting"]]
            return bool(busy)

        wait_for("inputs running", one_is_busy)
        moved = scheduler_of(real2).log_path.read_text().count("moved to worker")
        victim = next(p for p in workers_of(real2)
                      if p.popen.poll() is None and p.name == f"worker-{busy[0].rpartition(':')[2]}")
        kill(victim)
        call.join(WAIT_S * 3)
        assert result and len(result[0]) == len(inputs), "the Embed call did not answer"
        for got, want in zip(result[0], reference):
            assert got == pytest.approx(want, abs=1e-5)
        assert len(live_workers(client)) == 1
        wait_for("every block free", lambda: all_idle(client))
    assert scheduler_of(real2).log_path.read_text().count("moved to worker") > moved  # the victim's inputs


# --- worker stopped (SIGSTOP): the step-progress watchdog and the heartbeat ------------------------------------


def test_sigstopped_worker_is_declared_dead_by_the_step_watchdog(cluster_factory):
    # Heartbeat far off, so that the step watchdog is what notices.
    c = cluster_factory(2, "--step-timeout", "3", "--worker-keepalive-time", "120", "--worker-keepalive-timeout", "120")
    requests = sim_requests(32, seed=1)
    with Client(c.address, timeout=WAIT_S * 3) as client:
        reference = run_streams(client, requests)
        streams = start_streams(client, requests)
        wait_for("every stream streaming", lambda: all(len(s.token_ids) >= 3 for s in streams))
        victim = workers_of(c)[0]
        stopped_at = time.monotonic()
        kill(victim, signal.SIGSTOP)
        try:
            wait_for("the stopped worker declared dead", lambda: len(live_workers(client)) == 1, timeout=3 + 30)
            detected_after = time.monotonic() - stopped_at
            join(streams)
            assert_same(streams, reference)
        finally:
            kill(victim, signal.SIGCONT)
        # Resumed, it is taken back in: a new epoch, a fresh block pool.
        wait_for("the worker back", lambda: len(live_workers(client)) == 2)
        wait_for("every block free", lambda: all_idle(client))
        assert run_streams(client, requests[:4])[0].token_ids == reference[0].token_ids
    log = scheduler_of(c).log_path.read_text()
    assert "no step result for" in log, log[-3000:]
    assert f"worker 127.0.0.1:{c.worker_ports[0]} is back" in log
    print(f"declared dead {detected_after:.1f} s after SIGSTOP (step timeout 3 s)")


def test_sigstopped_idle_worker_is_declared_dead_by_the_heartbeat(cluster_factory):
    c = cluster_factory(2, "--worker-keepalive-time", "1", "--worker-keepalive-timeout", "2", "--step-timeout", "600")
    with Client(c.address, timeout=WAIT_S) as client:
        assert len(live_workers(client)) == 2
        victim = workers_of(c)[0]
        kill(victim, signal.SIGSTOP)
        try:
            wait_for("the stopped idle worker declared dead", lambda: len(live_workers(client)) == 1, timeout=3 + 30)
            assert health_status(c.address, PUBLIC_SERVICE) == "SERVING"
            [s] = run_streams(client, sim_requests(1, seed=2, max_tokens=8))
            assert s.error is None and len(s.token_ids) == 8
        finally:
            kill(victim, signal.SIGCONT)
        wait_for("the worker back", lambda: len(live_workers(client)) == 2)


# --- no worker left ------------------------------------------------------------------------------------------


def test_only_worker_killed_unavailable_and_not_serving_until_a_worker_is_back(cluster_factory, tiny_model_dir):
    c = cluster_factory(1)
    with Client(c.address, timeout=WAIT_S) as client:
        streams = start_streams(client, sim_requests(8, seed=3))
        wait_for("every stream streaming", lambda: all(s.token_ids for s in streams))
        kill(workers_of(c)[0])
        join(streams)
        for s in streams:
            assert s.error is not None and s.error.code() == grpc.StatusCode.UNAVAILABLE, s.error
        wait_for("readiness NOT_SERVING", lambda: health_status(c.address, PUBLIC_SERVICE) == "NOT_SERVING")
        assert health_status(c.address, "") == "SERVING"  # liveness: do not restart the scheduler
        with pytest.raises(grpc.RpcError) as err:
            client.complete(token_ids=[1, 2, 3], max_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        # A worker started again at the same address is taken back in (the scheduler retries it).
        c.start_worker(c.worker_ports[0])
        wait_for("serving again", lambda: health_status(c.address, PUBLIC_SERVICE) == "SERVING")
        [s] = run_streams(client, sim_requests(1, seed=4, max_tokens=8))
        assert s.error is None and len(s.token_ids) == 8

        # Killed again, and a worker elsewhere registers itself: serving again through registration.
        kill(workers_of(c)[-1])
        wait_for("readiness NOT_SERVING", lambda: health_status(c.address, PUBLIC_SERVICE) == "NOT_SERVING")
        port = free_port()
        c.start_worker(port, ["--scheduler", c.address])
        wait_for("serving again", lambda: health_status(c.address, PUBLIC_SERVICE) == "SERVING")
        assert f"127.0.0.1:{port}" in live_workers(client)
        [s] = run_streams(client, sim_requests(1, seed=4, max_tokens=8))
        assert s.error is None and len(s.token_ids) == 8


def test_every_frontend_serves_once_the_port_reports_serving(tiny_model_dir, tmp_path):
    """Readiness holds for the whole port: the second front-end reads each table of worker groups 1.5 s late (a test
    knob standing in for a busy process), and calls on fresh connections (a channel each: the kernel spreads them
    over both front-ends) made as soon as the port reports SERVING all complete, the late front-end's once it has
    asked the supervisor for the table."""
    c = sim_cluster(tiny_model_dir, tmp_path / "logs", 1, ["--debug-table-delay", "1.5"])
    try:
        clients = [Client(c.address, timeout=WAIT_S) for _ in range(16)]
        streams = [start_streams(client, [r])[0]
                   for client, r in zip(clients, sim_requests(len(clients), seed=9, max_tokens=2))]
        for s in join(streams):
            assert s.error is None, f"{s.error.code()}: {s.error.details()}"
            assert len(s.token_ids) == 2
        for client in clients:
            client.close()
    finally:
        c.stop()


# --- the scheduler drains on SIGTERM -----------------------------------------------------------------------


def test_sigterm_to_the_scheduler_finishes_running_streams_and_refuses_new_ones(cluster_factory):
    c = cluster_factory(2, "--drain-timeout", "60")
    requests = sim_requests(16, seed=5, max_tokens=150)
    with Client(c.address, timeout=WAIT_S * 2) as client:
        reference = run_streams(client, requests)
        streams = start_streams(client, requests)
        wait_for("every stream streaming", lambda: all(len(s.token_ids) >= 3 for s in streams))
        scheduler = scheduler_of(c)
        signalled = time.monotonic()
        kill(scheduler, signal.SIGTERM)
        wait_for("readiness NOT_SERVING", lambda: health_status(c.address, PUBLIC_SERVICE) != "SERVING")
        assert not all(s.done.is_set() for s in streams), "streams ended before the drain: make them longer"
        with pytest.raises(grpc.RpcError) as err:
            client.complete(token_ids=[1, 2, 3], max_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        join(streams)
        assert_same(streams, reference)
        assert scheduler.popen.wait(60 + 15) == 0
        assert time.monotonic() - signalled < 60 + 15  # within the drain timeout, with margin


# --- membership: registration, joining, draining, scheduler restart --------------------------------------------


def test_workers_register_join_drain_and_come_back_after_the_scheduler_dies(cluster_factory):
    # Slower steps and longer streams: they must still run when the third worker joins and the first drains.
    c = cluster_factory(2, register=True, worker_args=["--base-ms", "60", "--register-backoff-max", "1",
                                                       "--shutdown-grace", "1"])
    first, second = (f"127.0.0.1:{p}" for p in c.worker_ports)
    requests = sim_requests(24, seed=6, max_tokens=120)
    with Client(c.address, timeout=WAIT_S * 2) as client:
        wait_for("both workers registered", lambda: set(live_workers(client)) == {first, second})
        reference = run_streams(client, requests)

        # A third worker joins while requests run, and gets new requests.
        streams = start_streams(client, requests[:16])
        wait_for("streams running", lambda: all(s.token_ids for s in streams))
        third_port = free_port()
        c.start_worker(third_port)
        third = f"127.0.0.1:{third_port}"
        wait_for("the third worker registered", lambda: third in live_workers(client))
        streams += start_streams(client, requests[16:])
        wait_for("the newcomer gets requests", lambda: live_workers(client)[third]["num_requests"] > 0)

        # The first worker drains (SIGTERM) while streams run: it deregisters, what it cannot finish within
        # its grace moves to the others, and no stream is lost.
        drained = workers_of(c)[0]
        kill(drained, signal.SIGTERM)
        assert drained.popen.wait(WAIT_S) == 0
        assert first not in live_workers(client)
        join(streams)
        assert_same(streams, reference)
        assert "deregistered from the scheduler" in drained.log_path.read_text()
        wait_for("every block free", lambda: all_idle(client))

        # The scheduler dies: its streams end with UNAVAILABLE (clients retry).
        streams = start_streams(client, requests[:8])
        wait_for("streams running", lambda: all(s.token_ids for s in streams))
        kill(scheduler_of(c))
        join(streams)
        for s in streams:
            assert s.error is not None and s.error.code() == grpc.StatusCode.UNAVAILABLE, s.error

    # Its successor on the same address: the workers register again, and requests work.
    c.start_scheduler()
    wait_for("the new scheduler serving", lambda: health_status(c.address, PUBLIC_SERVICE) == "SERVING")
    with Client(c.address, timeout=WAIT_S * 2) as client:
        wait_for("workers registered again", lambda: set(live_workers(client)) == {second, third})
        assert_same(run_streams(client, requests[:8]), reference[:8])


# --- the scheduler's own processes -----------------------------------------------------------------------------


def tree_pids(cluster: LocalCluster, role: str) -> dict[int, int]:
    """index -> pid of the scheduler's `role` processes ("engine" or "frontend"), the latest of each, from the
    supervisor's log."""
    found = {}
    for line in scheduler_of(cluster).log_path.read_text().splitlines():
        if m := re.search(rf"{role} (\d+) started, pid (\d+)", line):
            found[int(m[1])] = int(m[2])
    return found


def test_kill9_an_engine_process_every_stream_equals_a_run_without_the_fault(cluster_factory):
    c = cluster_factory(2)  # two groups, each on an engine process of its own
    requests = sim_requests(32, seed=11)
    with Client(c.address, timeout=WAIT_S * 3) as client:
        reference = run_streams(client, requests)
        engines = tree_pids(c, "engine")
        assert len(engines) == 2, engines
        streams = start_streams(client, requests)
        wait_for("every stream streaming", lambda: all(len(s.token_ids) >= 3 for s in streams))
        assert not any(s.done.is_set() for s in streams), "streams ended before the fault: slow the workers"
        os.kill(engines[0], signal.SIGKILL)
        join(streams)
        assert_same(streams, reference)
        wait_for("the engine replaced", lambda: tree_pids(c, "engine").get(0) not in (None, engines[0]))
        wait_for("its worker back", lambda: len(live_workers(client)) == 2)
        wait_for("every block free", lambda: all_idle(client))
        assert run_streams(client, requests[:2])[1].token_ids == reference[1].token_ids
    assert re.search(r"engine 0 \(pid \d+\) exited", scheduler_of(c).log_path.read_text())


def test_kill9_a_frontend_its_streams_end_unavailable_the_rest_go_on_and_it_is_replaced(cluster_factory):
    c = cluster_factory(1)
    frontends = tree_pids(c, "frontend")
    assert len(frontends) == 2, frontends
    clients = [Client(c.address, timeout=WAIT_S * 3) for _ in range(16)]  # connections spread over both
    try:
        streams = [start_streams(client, sim_requests(1, seed=20 + k, max_tokens=200))[0]
                   for k, client in enumerate(clients)]
        wait_for("every stream streaming", lambda: all(len(s.token_ids) >= 3 for s in streams))
        os.kill(frontends[0], signal.SIGKILL)
        join(streams)
        lost = [s for s in streams if s.error is not None]
        assert lost and len(lost) < len(streams), "the 16 connections did not reach both front-ends"
        assert all(s.error.code() == grpc.StatusCode.UNAVAILABLE for s in lost), [s.error for s in lost]
        assert all(len(s.token_ids) == 200 for s in streams if s.error is None)
        wait_for("the front-end replaced", lambda: tree_pids(c, "frontend").get(0) not in (None, frontends[0]))
    finally:
        for client in clients:
            client.close()
    with Client(c.address, timeout=WAIT_S) as client:
        wait_for("its requests aborted at the engine: every block free", lambda: all_idle(client))
        [s] = run_streams(client, sim_requests(1, seed=40, max_tokens=8))
        assert s.error is None and len(s.token_ids) == 8


def test_metrics_of_every_process_add_up_to_what_the_clients_saw(cluster_factory):
    metrics_port = free_port()
    c = cluster_factory(2, "--metrics-port", str(metrics_port))
    clients = [Client(c.address, timeout=WAIT_S) for _ in range(16)]
    try:
        streams = []
        for k, client in enumerate(clients):
            streams += start_streams(client, sim_requests(2, seed=60 + k, max_tokens=8))
        join(streams)
    finally:
        for client in clients:
            client.close()
    assert all(s.error is None and len(s.token_ids) == 8 for s in streams)
    served_by = set(re.findall(r"request req-(\d+)-", scheduler_of(c).log_path.read_text()))
    assert served_by == {"0", "1"}, f"front-ends that served: {served_by}"
    samples = scrape(metrics_port)
    assert sample(samples, "splitserve:request_success_total", finished_reason="length") == 32
    assert sample(samples, "splitserve:generation_tokens_total") == 32 * 8
    assert sample(samples, "splitserve:prompt_tokens_total") == sum(len(s.params["token_ids"]) for s in streams)
    assert sample(samples, "splitserve:time_to_first_token_seconds_count") == 32
    steps = {labels: v for (name, labels), v in samples.items() if name == "splitserve:step_duration_seconds_count"}
    assert len(steps) == 2 and all(v > 0 for v in steps.values()), steps  # one engine per worker
    alive = {labels: v for (name, labels), v in samples.items() if name == "splitserve:worker_alive"}
    assert sorted(alive.values()) == [1.0, 1.0], alive

    # A worker that dies is reported down (alive 0, gauges 0), not dropped from the series.
    kill(workers_of(c)[0])

    def reported_down() -> bool:
        now = scrape(metrics_port)
        alive = sorted(v for (name, _), v in now.items() if name == "splitserve:worker_alive")
        running = [v for (name, _), v in now.items() if name == "splitserve:num_requests_running"]
        return alive == [0.0, 1.0] and len(running) == 2
    wait_for("the dead worker reported down, its series kept", reported_down)


def test_the_tree_sizes_itself_to_its_cpus_and_names_its_processes(tiny_model_dir, tmp_path, monkeypatch):
    """No --frontends / --engines: $SPLITSERVE_CPUS (a pod's CPU request) decides, half of it front-ends; one
    engine per worker group. Each process says what it is in its title (ps, top)."""
    monkeypatch.setenv("SPLITSERVE_CPUS", "4")
    c = LocalCluster(tiny_model_dir, num_workers=2, worker_command="simulate", log_dir=tmp_path).start(timeout=120)
    try:
        with Client(c.address, timeout=10) as client:
            wait_for("2 workers connected", lambda: len(live_workers(client)) == 2)
            [s] = run_streams(client, sim_requests(1, seed=3, max_tokens=4))
            assert s.error is None and len(s.token_ids) == 4
        frontends, engines = tree_pids(c, "frontend"), tree_pids(c, "engine")
        assert sorted(frontends) == [0, 1] and sorted(engines) == [0, 1], (frontends, engines)
        for role, pids in (("frontend", frontends), ("engine", engines)):
            for index, pid in pids.items():
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                assert title == f"splitserve-scheduler {role} {index}", title
    finally:
        c.stop()
