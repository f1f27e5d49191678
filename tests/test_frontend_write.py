"""A write that fails because the call ended under it (scheduler_svc/frontend.py's _write): the handler waits for
gRPC's cancellation instead of raising, so the race between a client's deadline and a write logs no servicer error."""
from __future__ import annotations

import asyncio

import pytest

from protos import splitserve_pb2 as api
from scheduler_svc import frontend


class ClosedContext:
    """A call that the client has just closed: the write's batch fails (gRPC raises its ExecuteBatchError)."""

    def __init__(self) -> None:
        self.writes = 0

    async def write(self, response) -> None:
        self.writes += 1
        raise RuntimeError('Failed "execute_batch"')


def test_a_failed_write_ends_as_the_cancellation_that_follows(monkeypatch):
    monkeypatch.setattr(frontend, "CLOSE_NOTICE_S", 30.0)

    async def run():
        task = asyncio.create_task(frontend._write(ClosedContext(), api.GenerateResponse()))
        await asyncio.sleep(0.05)
        assert not task.done()  # waiting for gRPC's notice, not raising
        task.cancel()  # the notice
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def test_a_failed_write_without_a_notice_ends_the_stream(monkeypatch):
    monkeypatch.setattr(frontend, "CLOSE_NOTICE_S", 0.01)
    context = ClosedContext()
    assert asyncio.run(frontend._write(context, api.GenerateResponse())) is False
    assert context.writes == 1
