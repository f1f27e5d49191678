"""The in-process executor: the worker's ModelRunner behind the scheduler's Executor seam, with the
same plan/result contract as the gRPC worker and no network (tests, benchmarks, offline use)."""
from __future__ import annotations

import gc
from collections import deque
from pathlib import Path

import torch

from protos import worker_pb2 as pb
from worker_svc.model_runner import ModelRunner, PendingStep, RunnerConfig


class InProcessExecutor:
    def __init__(self, model_dir: str | Path, config: RunnerConfig | None = None, **options):
        self.runner = ModelRunner(model_dir, config or RunnerConfig(**options))
        self._pending: deque[PendingStep] = deque()

    def describe(self, request: pb.DescribeRequest | None = None) -> pb.DescribeResponse:
        return self.runner.describe(request)

    def submit(self, plan: pb.StepPlan) -> None:
        self._pending.append(self.runner.execute(plan))

    def receive(self) -> pb.StepResult:
        return self._pending.popleft().result()

    def close(self) -> None:
        """Releases the model and the KV cache (on a GPU, so that another worker can take them)."""
        self._pending.clear()
        device = self.runner.device
        self.runner = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
