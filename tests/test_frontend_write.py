"""A write that fails because the call ended under it (scheduler_svc/responses.py's write): the handler waits for
gRPC's cancellation instead of raising, so the race between a client's deadline and a write logs no servicer error."""
from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from protos import splitserve_pb2 as api
from scheduler_svc import frontend, responses


class ClosedContext:
    """A call that the client has just closed: the write's batch fails (gRPC raises its ExecuteBatchError)."""

    def __init__(self) -> None:
        self.writes = 0

    async def write(self, response) -> None:
        self.writes += 1
        raise RuntimeError('Failed "execute_batch"')

    async def abort(self, code, message) -> None:
        raise RuntimeError('Failed "execute_batch"')


class OpenContext:
    async def abort(self, code, message) -> None:
        raise grpc.aio.AbortError(message)


def test_a_failed_write_ends_as_the_cancellation_that_follows(monkeypatch):
    monkeypatch.setattr(responses, "CLOSE_NOTICE_S", 30.0)

    async def run():
        task = asyncio.create_task(responses.write(ClosedContext(), api.GenerateResponse()))
        await asyncio.sleep(0.05)
        assert not task.done()  # waiting for gRPC's notice, not raising
        task.cancel()  # the notice
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def test_a_failed_write_without_a_notice_ends_the_stream(monkeypatch):
    monkeypatch.setattr(responses, "CLOSE_NOTICE_S", 0.01)
    context = ClosedContext()
    assert asyncio.run(responses.write(context, api.GenerateResponse())) is False
    assert context.writes == 1


def test_a_status_that_fails_to_go_out_is_raised_once_grpc_has_seen_the_call_close(monkeypatch):
    """A call past its deadline has ended in gRPC's core, and a status sent then fails; gRPC logs that failure as the
    servicer's error unless it has seen the call close by then, so abort raises it only after CLOSE_NOTICE_S."""
    monkeypatch.setattr(responses, "CLOSE_NOTICE_S", 0.2)

    async def run():
        started = asyncio.get_running_loop().time()
        with pytest.raises(RuntimeError, match="execute_batch"):
            await responses.abort(ClosedContext(), grpc.StatusCode.INVALID_ARGUMENT, "bad")
        assert asyncio.get_running_loop().time() - started >= 0.19  # the loop may wake a hair early
        with pytest.raises(grpc.aio.AbortError):  # a status that went out ends the handler at once
            await asyncio.wait_for(responses.abort(OpenContext(), grpc.StatusCode.INVALID_ARGUMENT, "bad"), 0.1)

    asyncio.run(run())


def _group(group_id: int) -> dict:
    return dict(group_id=group_id, engine=group_id, address=f"127.0.0.1:{group_id}", model="m", dtype="float32",
                device="cpu", num_blocks=64, block_size=16, max_model_len=512, vocab_size=1000, epoch=1,
                kv_cache_dtype="float32")


def test_a_groups_loss_reported_twice_moves_each_request_once(tmp_path):
    """A worker's loss reaches a front-end twice: the supervisor's table drops its group, and its engine names the
    requests it held ("down"). Whichever comes first moves a request on; the second must leave it alone, also while
    its add to the survivor awaits the engine's answer (answering that add "gone" ended streams with UNAVAILABLE
    although a worker was serving)."""
    from scheduler_svc.ipc import ints
    from scheduler_svc.sampling import SamplingParams

    async def run():
        fe = frontend.Frontend(0, 1, str(tmp_path), tokenizer=None, model_dir=str(tmp_path))
        sent = []
        fe._to_engine = lambda engine, message: sent.append((engine, message[0]))
        fe._handle(["groups", [_group(1), _group(2)]])
        c = frontend.Completion(7, "req-7", 0, frontend._Stream(interval=1), [1, 2, 3], SamplingParams(max_tokens=4),
                                0, None)
        fe.completions[c.key] = c
        c.move_to(fe.groups[1])
        fe._handle(["groups", [_group(2)]])  # the table first: the request moves to group 2
        await asyncio.sleep(0)
        assert c.group is fe.groups[2] and c.ack is not None and not c.ack.done()
        fe._handle(["down", 1, ints([c.key])])  # then the dead engine's notice, while the add awaits
        assert not c.ack.done()
        fe._handle(["ack", 2, c.key, "", ""])
        await asyncio.sleep(0)
        assert c.group is fe.groups[2] and not c.stream.failed
        assert [m for _, m in sent].count("add") == 1
        fe.out.close()

    asyncio.run(run())

