"""Offline batch generation: the scheduler's engine over the worker's ModelRunner in one process, with no
gRPC between them. The one place where scheduler_svc and worker_svc meet."""

from offline.llm import LLM

__all__ = ["LLM"]
