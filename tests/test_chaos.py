"""Chaos: a seeded series of faults, one after another, while clients keep streams in flight on three simulated
workers behind the scheduler tree: workers killed (-9) and started again, stopped (SIGSTOP) past the step watchdog
and resumed, drained (SIGTERM) and started again; engine and front-end processes killed (-9, the supervisor
replaces them). The scenarios of test_faults.py, one at a time there, here in a row and over whatever state the last
one left.

What every client sees: a stream completes with exactly the tokens of a run without faults (a simulated worker's token
depends only on seed and position), or, where a front-end was killed while it ran (or its channel was still
reconnecting), ends with UNAVAILABLE after a prefix of them. Nothing else: two workers always serve while the third is
faulted. Afterwards every worker is back, no block is held, and no process logged a traceback.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import grpc
import pytest

from client import Client
from tests.test_faults import (Stream, all_idle, kill, live_workers, run_streams, sim_cluster, sim_requests,
                               tree_pids, wait_for, workers_of)

pytestmark = pytest.mark.timeout(600)

FAULTS = 8
IN_FLIGHT = 12  # streams the clients keep running (a 2-core CI box runs another test module beside it)
STEP_TIMEOUT_S = 2.0
RECONNECT_S = 2.5  # client/channel.py: a channel whose connection failed is back within 2 s of backoff


class Load:
    """Clients that keep IN_FLIGHT streams running (each a request of its own seed) until stopped."""

    def __init__(self, address: str, seed: int):
        self.clients = [Client(address, timeout=120) for _ in range(8)]  # connections over both front-ends
        self.rng = random.Random(seed)
        self.streams: list[tuple[Stream, float, float]] = []  # stream, started, ended (monotonic)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.failures: list[BaseException] = []  # anything but a gRPC status a client thread met
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(IN_FLIGHT)]

    def _run(self, i: int) -> None:
        try:
            self._stream_until_stopped(self.clients[i % len(self.clients)])
        except BaseException as e:
            self.failures.append(e)

    def _stream_until_stopped(self, client: Client) -> None:
        while not self._stop.is_set():
            with self._lock:
                n = len(self.streams)
                request = sim_requests(1, seed=1000 + n, max_tokens=self.rng.randint(10, 60))[0]
                request["seed"] = 7919 * n
            s, started = Stream(request), time.monotonic()
            s.run(client)
            if s.error is not None:  # a front-end just killed: its channel fails fast until it reconnects
                time.sleep(0.2)
            with self._lock:
                self.streams.append((s, started, time.monotonic()))

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)
            assert not t.is_alive(), "a stream did not end"
        assert not self.failures, self.failures
        for c in self.clients:
            c.close()


def _worker(c, port: int):
    return next(p for p in workers_of(c) if p.name == f"worker-{port}")


def _fault(c, rng: random.Random) -> str:
    """One fault, chosen by rng, on a worker or a scheduler process; returns what it was."""
    fault = rng.choice(["kill worker", "stop worker", "drain worker", "kill engine", "kill frontend"])
    if fault.endswith("worker"):
        port = rng.choice(c.worker_ports)
        victim = _worker(c, port)
        if fault == "kill worker":
            kill(victim)
        elif fault == "stop worker":  # past the step watchdog, or not: the stream moves, or waits for it
            kill(victim, signal.SIGSTOP)
            time.sleep(rng.uniform(0.5 * STEP_TIMEOUT_S, 2 * STEP_TIMEOUT_S))
            kill(victim, signal.SIGCONT)
        else:
            kill(victim, signal.SIGTERM)
            victim.popen.wait(60)
        if victim.popen.poll() is not None:
            c.processes.remove(victim)
            c.start_worker(port)
        return f"{fault} {port}"
    role = fault.split()[1]
    pids = tree_pids(c, role)
    pid = pids[rng.choice(sorted(pids))]
    os.kill(pid, signal.SIGKILL)
    wait_for(f"the {role} replaced", lambda: pid not in tree_pids(c, role).values() and len(tree_pids(c, role)))
    return f"{fault} pid {pid}"


def test_a_series_of_faults_under_load_loses_and_changes_no_stream(tiny_model_dir, tmp_path):
    rng = random.Random(47)
    c = sim_cluster(tiny_model_dir, tmp_path / "logs", 3, ["--step-timeout", str(STEP_TIMEOUT_S),
                                                           "--worker-keepalive-time", "1",
                                                           "--worker-keepalive-timeout", "2"])
    frontend_kills: list[tuple[float, float]] = []  # from the kill until its replacement and a reconnection
    try:
        with Client(c.address, timeout=60) as client:
            wait_for("3 workers connected", lambda: len(live_workers(client)) == 3)
            with Load(c.address, seed=1) as load:
                for _ in range(FAULTS):
                    time.sleep(rng.uniform(0.5, 2.0))
                    at = time.monotonic()
                    fault = _fault(c, rng)
                    print(f"{at:.1f}: {fault}")
                    if fault.startswith("kill frontend"):  # its streams end; a channel may retry within its backoff
                        frontend_kills.append((at, time.monotonic() + RECONNECT_S))
                    wait_for("3 workers serving", lambda: len(live_workers(client)) == 3)
            wait_for("every block free", lambda: all_idle(client))
            reference: list[Stream] = []
            for i in range(0, len(load.streams), 4 * IN_FLIGHT):
                reference += run_streams(client, [s.params for s, _, _ in load.streams[i:i + 4 * IN_FLIGHT]])
            assert all(r.error is None for r in reference), [r.error for r in reference if r.error]
        lost = 0
        for (s, started, ended), ref in zip(load.streams, reference, strict=True):
            if s.error is None:
                assert (s.token_ids, s.finish_reason) == (ref.token_ids, ref.finish_reason), s.params
                continue
            lost += 1
            assert s.error.code() == grpc.StatusCode.UNAVAILABLE, (s.error.code(), s.error.details())
            assert any(started <= b and a <= ended for a, b in frontend_kills), f"lost, no front-end killed: {s.error}"
            assert s.token_ids == ref.token_ids[:len(s.token_ids)]
        print(f"{len(load.streams)} streams, {lost} ended with their front-end")
        assert len(load.streams) > lost + 100
        for proc in c.processes:  # the scheduler's among them
            assert "Traceback" not in proc.log_path.read_text(errors="replace"), proc.name
    finally:
        c.stop()
