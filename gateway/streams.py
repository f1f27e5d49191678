"""Running a Job's gRPC streams for an HTTP request: one Generate call per prompt, merged; the wait for the first
delta (which decides the HTTP status) given up when the client goes; the server-sent events response that closes
the calls however it ends."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

import anyio
import grpc
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Send

from client.client import Delta
from gateway.backend import Backend
from gateway.errors import from_grpc, invalid
from gateway.jobs import Job

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before the answer started."""


def open_streams(backend: Backend, job: Job, request_id: str, stream: bool) -> list[AsyncGenerator[Delta, None]]:
    """One Generate call per prompt; without `stream`, each completion comes back in one message."""
    streams = []
    for i, prompt in enumerate(job.prompts):
        rid = request_id if len(job.prompts) == 1 else f"{request_id}-{i}"
        try:
            streams.append(backend.client.generate(
                prompt.get("prompt"), token_ids=prompt.get("token_ids"), messages=prompt.get("messages"),
                enable_thinking=prompt.get("enable_thinking"), tools=prompt.get("tools"),
                chat_template_kwargs=prompt.get("chat_template_kwargs"),
                continue_final_message=prompt.get("continue_final_message", False),
                chat_template=prompt.get("chat_template"), request_id=rid,
                timeout=backend.config.request_timeout, stream_interval=None if stream else 0, **job.params))
        except (ValueError, TypeError) as e:  # a value the proto cannot hold
            raise invalid(None, str(e)) from None
    return streams


async def merge(streams: list[AsyncGenerator[Delta, None]]) -> AsyncGenerator[tuple[int, Delta], None]:
    """(prompt index, delta) of every stream as they come; leaving early cancels every call."""
    if len(streams) == 1:
        (stream,) = streams
        try:
            async for delta in stream:
                yield 0, delta
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[Delta, None]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, None, e))
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                remaining -= 1
                continue
            yield i, delta
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`, cancelled (raising ClientGone) if the HTTP client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def first_delta(request: Request, it: AsyncGenerator[T, None], names: dict[str, str]) -> T | None:
    """The first item of `it` (None if empty), or the HTTP error the stream failed with."""
    async def first() -> T | None:
        async for item in it:
            return item
        return None

    try:
        return await unless_disconnected(request, first())
    except grpc.RpcError as e:
        await it.aclose()
        raise from_grpc(e, **names) from None
    except BaseException:
        await it.aclose()
        raise


class EventStream(StreamingResponse):
    """Server-sent events. However the response ends (done, failed, or the client gone: Starlette cancels
    the sending), the events and their source are closed at once, which cancels the gRPC calls."""

    def __init__(self, events: AsyncGenerator[str, None], source: AsyncGenerator, headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self.events, self.source = events, source

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.events.aclose()
                await self.source.aclose()

