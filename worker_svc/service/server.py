"""The worker's gRPC service: a Describe handshake and one long-lived Execute stream of step plans.

Three threads per stream keep gRPC I/O off the thread that launches kernels: a reader queues plans
as they arrive, the launcher applies each plan and launches its step (on a GPU it does not wait for
the step to finish, so step N+1 is launched while N still runs), and the handler thread waits for
each step's sampled ids and sends its StepResult.
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.security import TLSConfig, add_port
from protos import WORKER_PROTOCOL_VERSION
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from worker_svc.runtime.batch import PersistentBatch, PlanError

log = logging.getLogger("splitserve.worker")
SERVICE = pb.DESCRIPTOR.services_by_name["Worker"].full_name
# How long a new Execute stream waits for the previous one to close: a scheduler that gave up on its
# stream may reconnect while the worker is still tearing the old one down.
STREAM_HANDOVER_S = 5.0
_END = object()


class Runner(Protocol):
    """What the service serves: the ModelRunner, the TensorParallelRunner (its leader), or the SimulatedRunner
    (same protocol, no model)."""
    batch: PersistentBatch
    worker_id: str

    @property
    def epoch(self) -> int: ...
    def describe(self, request: pb.DescribeRequest | None = None) -> pb.DescribeResponse: ...
    def execute(self, plan: pb.StepPlan) -> PendingResult: ...
    def reset(self) -> None: ...
    def close(self) -> None: ...


class PendingResult(Protocol):
    def result(self) -> pb.StepResult:
        """Waits for the step's sampled ids."""
        ...


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """Serves a Runner."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self._stream_lock = threading.Lock()
        self._driven = threading.Condition()
        self.driven = False  # an Execute stream is open: a scheduler drives this worker
        self.draining = False  # shutting down: no new scheduler is taken (Describe and Execute refused)
        self.health: health.HealthServicer | None = None

    def drain(self) -> None:
        self.draining = True
        if self.health is not None:
            self.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)

    def wait_driven(self, driven: bool, timeout: float) -> bool:
        """Waits until an Execute stream is open (driven=True) or none is; returns whether it is so."""
        with self._driven:
            return self._driven.wait_for(lambda: self.driven == driven, timeout)

    def _set_driven(self, driven: bool) -> None:
        with self._driven:
            self.driven = driven
            self._driven.notify_all()

    def Describe(self, request: pb.DescribeRequest, context) -> pb.DescribeResponse:
        if request.protocol_version != WORKER_PROTOCOL_VERSION:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"worker speaks protocol {WORKER_PROTOCOL_VERSION}, scheduler {request.protocol_version}")
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        return self.runner.describe(request)

    def Execute(self, request_iterator, context):
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        if not self._stream_lock.acquire(timeout=STREAM_HANDOVER_S):
            context.abort(grpc.StatusCode.ABORTED, "another scheduler is driving this worker")
        self._set_driven(True)
        plans: queue.Queue = queue.Queue()
        pending: queue.Queue = queue.Queue()
        log.info("execute stream opened by %s (epoch %d)", context.peer(), self.runner.epoch)

        def read() -> None:
            try:
                for plan in request_iterator:
                    plans.put(plan)
            except grpc.RpcError:
                pass
            plans.put(_END)

        def launch() -> None:
            while (plan := plans.get()) is not _END:
                if not context.is_active():
                    break
                try:
                    pending.put(self.runner.execute(plan))
                except PlanError as e:
                    pending.put(e)
                    return
                except Exception as e:  # a failed step must end the stream, never hang it
                    log.exception("step %d failed", plan.step)
                    pending.put(e)
                    return
            pending.put(_END)

        threading.Thread(target=read, daemon=True, name="plan-reader").start()
        launcher = threading.Thread(target=launch, daemon=True, name="step-launcher")
        launcher.start()
        try:
            while (item := pending.get()) is not _END:
                if isinstance(item, PlanError):
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(item))
                if isinstance(item, Exception):
                    context.abort(grpc.StatusCode.INTERNAL, f"step failed: {item}")
                yield item.result()
        finally:
            # The scheduler that drove this stream is gone or broke the protocol: its sequences die
            # with it, and a new epoch tells the next scheduler to start from a fresh block pool.
            plans.put(_END)
            launcher.join()
            self.runner.reset()
            self._stream_lock.release()
            self._set_driven(False)
            log.info("execute stream closed; new epoch %d", self.runner.epoch)


# The scheduler pings each worker (gRPC keepalive) as its heartbeat, also while no step runs: accept
# pings as often as every second without data, never answer them with GOAWAY "too_many_pings".
SERVER_KEEPALIVE_OPTIONS = [("grpc.http2.min_ping_interval_without_data_ms", 500),
                            ("grpc.http2.max_ping_strikes", 0), ("grpc.keepalive_permit_without_calls", 1)]

# The launcher thread must get the GIL as soon as a plan arrives, not after the default 5 ms switch
# interval of the thread that is building the previous result.
SWITCH_INTERVAL_S = 0.0005


@dataclass(slots=True)
class WorkerServer:
    server: grpc.Server
    service: WorkerService
    port: int


def serve(runner: Runner, host: str, port: int, *, tls: TLSConfig | None) -> WorkerServer:
    """Starts the worker's gRPC server. tls: the worker's certificate and key, and with a CA only schedulers
    holding a certificate signed by it can drive the worker (mutual TLS); None (--plaintext): anybody who
    reaches the port."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20), *SERVER_KEEPALIVE_OPTIONS])
    service = WorkerService(runner)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    health_servicer = service.health = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = add_port(server, f"{host}:{port}", tls)
    if tls is None:
        log.warning("PLAINTEXT gRPC on %s:%d (--plaintext): whoever reaches the port can drive this worker; "
                    "a local demo only", host, bound)
    elif not tls.mutual:
        log.warning("TLS on %s:%d without --tls-ca: any TLS client can drive this worker; give --tls-ca to "
                    "accept only schedulers with a certificate signed by it", host, bound)
    else:
        log.info("mutual TLS on %s:%d: only callers with a certificate signed by the CA", host, bound)
    server.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return WorkerServer(server, service, bound)
