"""A runner in this process behind the scheduler's Executor seam: the same plan/result contract as the gRPC
worker, no network (tests, benchmarks, offline use). The runner is the ModelRunner, or the SimulatedRunner
(bench --simulate: no torch)."""
from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

from protos import worker_pb2 as pb


class InProcessExecutor:
    def __init__(self, runner: Any):
        self.runner = runner
        self._pending: deque = deque()

    @classmethod
    def for_model(cls, model_dir: str | Path, config: Any = None) -> InProcessExecutor:
        """Over a ModelRunner (imports torch) of model_dir with a RunnerConfig."""
        from worker_svc.runtime.model_runner import ModelRunner

        return cls(ModelRunner(model_dir, config))

    def describe(self, request: pb.DescribeRequest | None = None) -> pb.DescribeResponse:
        return self.runner.describe(request)

    def submit(self, plan: pb.StepPlan) -> None:
        self._pending.append(self.runner.execute(plan))

    def receive(self) -> pb.StepResult:
        return self._pending.popleft().result()

    def close(self) -> None:
        """Releases the runner (on a GPU its model and KV cache, so that another worker can take them)."""
        self._pending.clear()
        self.runner.close()
