"""The seam between the scheduler and a worker group: a gRPC stream in the services (grpc_executor.py), a
ModelRunner in the same process offline (offline/executor.py), a fake in tests."""

from __future__ import annotations

from typing import Protocol

from protos import worker_pb2


class Executor(Protocol):
    def describe(self, request: worker_pb2.DescribeRequest) -> worker_pb2.DescribeResponse:
        """Handshake: the scheduler's limits in, the worker's blocks, lengths and epoch out."""
        ...

    def submit(self, plan: worker_pb2.StepPlan) -> None:
        """Hand over the next plan; returns quickly, the step may run asynchronously."""
        ...

    def receive(self) -> worker_pb2.StepResult:
        """Block until the result of the oldest submitted plan."""
        ...

    def close(self) -> None: ...
