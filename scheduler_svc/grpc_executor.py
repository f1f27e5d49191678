"""The Executor seam over gRPC: one long-lived Execute stream to a worker group's leader.

Failure detection (the scheduler side of the failure model in docs/architecture.md), three signals:
- the stream: it ends or errors when the worker exits, restarts or refuses a plan;
- a heartbeat: gRPC keepalive pings on the channel, also while no step runs; a worker that does not
  acknowledge one within `keepalive_timeout` (a SIGSTOPped process, a dead host behind an open socket)
  breaks the channel, and with it the stream;
- step progress: `check_progress()` (called periodically by a watchdog) cancels the stream when the
  oldest step in flight has not come back within max(step_timeout, step_timeout_factor x the recent
  step time). Generous by default (30 s floor), so that a loaded machine never trips it.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.util import RECONNECT_OPTIONS
from protos import worker_pb2, worker_pb2_grpc

_MESSAGE_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                    *RECONNECT_OPTIONS]


@dataclass(slots=True)
class WatchConfig:
    """When the scheduler declares a worker dead (seconds); scheduler flags --worker-keepalive-time,
    --worker-keepalive-timeout, --step-timeout, --step-timeout-factor."""
    keepalive_time: float = 10.0  # between heartbeat pings on the worker channel
    keepalive_timeout: float = 10.0  # a ping not acknowledged within this: the worker is dead
    step_timeout: float = 30.0  # floor of the step-progress timeout
    step_timeout_factor: float = 50.0  # the step-progress timeout in multiples of the recent step time

    def channel_options(self) -> list[tuple[str, int]]:
        keepalive_ms = max(1, int(self.keepalive_time * 1000))
        timeout_ms = max(1, int(self.keepalive_timeout * 1000))
        return [*_MESSAGE_OPTIONS, ("grpc.keepalive_time_ms", keepalive_ms), ("grpc.keepalive_timeout_ms", timeout_ms),
                # Without these, pings stop after 2 without data (an idle worker), and a ping waits a
                # minute for its ack rather than keepalive_timeout.
                ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
                ("grpc.http2.ping_timeout_ms", timeout_ms)]

    def step_deadline(self, recent_step_s: float) -> float:
        return max(self.step_timeout, self.step_timeout_factor * recent_step_s)


CHANNEL_OPTIONS = WatchConfig().channel_options()


class WorkerUnavailable(RuntimeError):
    """The worker's stream broke: it died, restarted, stopped answering, or refused a plan."""


class GrpcExecutor:
    def __init__(self, address: str, connect_timeout: float = 600.0, watch: WatchConfig | None = None,
                 wait_for_ready: bool = True, credentials: grpc.ChannelCredentials | None = None):
        """wait_for_ready: Describe waits up to connect_timeout for the worker to come up; False fails at
        once when nothing listens (the scheduler's reconnection attempts). credentials: TLS (the worker's
        certificate is verified, the scheduler's presented); None: plaintext."""
        self.address = address
        self.connect_timeout = connect_timeout
        self.wait_for_ready = wait_for_ready
        self.watch = watch or WatchConfig()
        options = self.watch.channel_options()
        self.channel = (grpc.insecure_channel(address, options=options) if credentials is None
                        else grpc.secure_channel(address, credentials, options=options))
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._plans: queue.SimpleQueue = queue.SimpleQueue()
        self._results = None
        self._lock = threading.Lock()
        # submit time of each plan whose result is due, and whether it reads weights (StepPlan.load_weights): such a
        # plan may take as long as the worker's start-up did (connect_timeout), and its time is no step's
        self._submitted: deque[tuple[float, bool]] = deque()
        self._last_result = 0.0
        self.step_time = 0.0  # recent worker time per step (moving average), for the progress timeout
        self._failure: str | None = None  # why the scheduler gave up on the worker

    def describe(self, request: worker_pb2.DescribeRequest) -> worker_pb2.DescribeResponse:
        try:
            return self.stub.Describe(request, timeout=self.connect_timeout, wait_for_ready=self.wait_for_ready)
        except grpc.RpcError as e:
            raise WorkerUnavailable(f"worker {self.address}: {e.code().name}: {e.details()}") from None

    def open(self, on_end: Callable[[], None] | None = None) -> None:
        """Opens the Execute stream now (not at the first plan), so that a worker knows it is driven and
        its death is seen while idle: on_end is called (on a gRPC thread) when the stream ends."""
        if self._results is None:
            self._results = self.stub.Execute(iter(self._plans.get, None))
            if on_end is not None:
                self._results.add_done_callback(lambda _call: on_end())

    def submit(self, plan: worker_pb2.StepPlan) -> None:
        if self._results is None:
            self.open()
        with self._lock:
            self._submitted.append((time.monotonic(), bool(plan.load_weights)))
        self._plans.put(plan)

    def receive(self) -> worker_pb2.StepResult:
        try:
            result = next(self._results)
        except grpc.RpcError as e:
            raise WorkerUnavailable(self._failure or f"worker {self.address}: {e.code().name}: {e.details()}") \
                from None
        except StopIteration:
            raise WorkerUnavailable(self._failure or f"worker {self.address} ended its stream") from None
        now = time.monotonic()
        with self._lock:
            sent, weights = self._submitted.popleft() if self._submitted else (now, False)
            took = now - max(sent, self._last_result)
            self._last_result = now
        if not weights:
            self.step_time = took if self.step_time == 0.0 else 0.8 * self.step_time + 0.2 * took
        return result

    def broken(self) -> bool:
        """The stream has ended (the worker is gone), or the scheduler gave up on it."""
        return self._failure is not None or (self._results is not None and self._results.done())

    def check(self) -> None:
        """Raises WorkerUnavailable when the stream is broken (an idle engine thread asks)."""
        if self.broken():
            code = self._results.code() if self._results is not None and self._results.done() else None
            raise WorkerUnavailable(self._failure or f"worker {self.address}: stream ended"
                                    + (f" ({code.name}: {self._results.details()})" if code is not None else ""))

    def check_progress(self, now: float | None = None) -> str | None:
        """The step-progress watchdog: fails the stream when the oldest step in flight is overdue. Returns
        the reason when it did. Safe from any thread."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._submitted or self._failure is not None:
                return None
            sent, weights = self._submitted[0]
            waited = now - max(sent, self._last_result)
        limit = self.watch.step_deadline(self.step_time)
        if weights:
            limit = max(limit, self.connect_timeout)
        if waited <= limit:
            return None
        reason = (f"worker {self.address}: no step result for {waited:.1f} s (limit {limit:.1f} s: the worker "
                  f"is stuck or stopped)")
        self.fail(reason)
        return reason

    def fail(self, reason: str) -> None:
        """Gives up on the worker: the stream is cancelled, and receive() raises WorkerUnavailable(reason)."""
        if self._failure is None:
            self._failure = reason
        if self._results is not None:
            self._results.cancel()
        else:
            self._plans.put(None)

    def close(self) -> None:
        self._plans.put(None)
        if self._results is not None:
            self._results.cancel()
        self.channel.close()
