"""The Executor seam over gRPC: one long-lived Execute stream to a worker group's leader."""
from __future__ import annotations

import queue

import grpc

from protos import worker_pb2, worker_pb2_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                   ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 10_000),
                   ("grpc.keepalive_permit_without_calls", 1)]


class WorkerUnavailable(RuntimeError):
    """The worker's stream broke: it died, restarted, or refused a plan."""


class GrpcExecutor:
    def __init__(self, address: str, connect_timeout: float = 600.0):
        self.address = address
        self.connect_timeout = connect_timeout
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._plans: queue.SimpleQueue = queue.SimpleQueue()
        self._results = None

    def describe(self, request: worker_pb2.DescribeRequest) -> worker_pb2.DescribeResponse:
        try:
            return self.stub.Describe(request, timeout=self.connect_timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            raise WorkerUnavailable(f"worker {self.address}: {e.code().name}: {e.details()}") from None

    def submit(self, plan: worker_pb2.StepPlan) -> None:
        if self._results is None:
            self._results = self.stub.Execute(iter(self._plans.get, None))
        self._plans.put(plan)

    def receive(self) -> worker_pb2.StepResult:
        try:
            return next(self._results)
        except grpc.RpcError as e:
            raise WorkerUnavailable(f"worker {self.address}: {e.code().name}: {e.details()}") from None
        except StopIteration:
            raise WorkerUnavailable(f"worker {self.address} ended its stream") from None

    def close(self) -> None:
        self._plans.put(None)
        if self._results is not None:
            self._results.cancel()
        self.channel.close()
