"""What goes out on a call: a completion's output as one GenerateResponse, held back to the request's
stream_interval and written to the call, and the status that ends a call early."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, NoReturn

import grpc
import grpc.aio

from protos import splitserve_pb2 as api

if TYPE_CHECKING:
    from scheduler_svc.frontend import Completion
    from scheduler_svc.sequence import TokenLogprob

log = logging.getLogger("splitserve.scheduler")
FINISH = {"stop": api.FINISH_REASON_STOP, "length": api.FINISH_REASON_LENGTH, "abort": api.FINISH_REASON_ABORT,
          "grammar": api.FINISH_REASON_GRAMMAR}
REASON = {v: k for k, v in FINISH.items()}
CLOSE_NOTICE_S = 1.0  # how long a handler whose write failed waits for gRPC to cancel it


def response_of(rid: str, c: Completion) -> api.GenerateResponse:
    """The message of the output that `c` holds (then sent: it holds none)."""
    text = c.out_text
    r = api.GenerateResponse(request_id=rid, index=c.index, text=text[0] if len(text) == 1 else "".join(text),
                             token_ids=c.out_tokens)
    c.out_tokens.clear()
    text.clear()
    if c.out_logprobs is not None:
        _add_logprobs(r.logprobs, c.out_logprobs)
        c.out_logprobs = None
    if c.prompt_logprobs is not None:
        _add_logprobs(r.prompt_logprobs, c.prompt_logprobs)
        c.prompt_logprobs = None
        c.prompt_ids_due = True
    if c.prompt_ids_due:
        r.prompt_token_ids.extend(c.prompt_ids)
        c.prompt_ids_due = False
    if c.finish_reason is not None:
        r.finish_reason = FINISH.get(c.finish_reason, api.FINISH_REASON_STOP)
        r.stop_reason = c.stop_reason or ""
        usage = c.text.usage()
        r.usage.prompt_tokens = usage.prompt_tokens
        r.usage.completion_tokens = usage.completion_tokens
        r.usage.cached_prompt_tokens = usage.cached_prompt_tokens
        r.weight_version = c.weight_version
    return r


def _add_logprobs(field, logprobs: list[TokenLogprob]) -> None:
    for lp in logprobs:
        field.add(logprob=lp.logprob, top=[api.TopLogprob(token_id=t, logprob=p) for t, p in (lp.top or [])])


def hold(held_back: dict[int, api.GenerateResponse], response: api.GenerateResponse,
         interval: int) -> api.GenerateResponse | None:
    """Joins `response` to what its completion holds back; returns the message to send once it holds
    `interval` tokens (0: never) or the completion ended, else None."""
    joined = held_back.pop(response.index, None)
    if joined is not None:
        joined.token_ids.extend(response.token_ids)
        joined.text += response.text
        joined.logprobs.extend(response.logprobs)
        joined.finish_reason, joined.stop_reason = response.finish_reason, response.stop_reason
        joined.weight_version = response.weight_version
        if response.HasField("usage"):
            joined.usage.CopyFrom(response.usage)
        response = joined
    if response.finish_reason or (interval and len(response.token_ids) >= interval):
        return response
    held_back[response.index] = response
    return None


async def write(context, response: api.GenerateResponse) -> bool:
    """Sends one message; False if the call ended under the write. A client's deadline or cancel that races a
    write fails the write's batch, and gRPC only then cancels the handler: waiting for that lets the call end as
    the cancellation it is, instead of as an error raised by the servicer."""
    try:
        await context.write(response)
        return True
    except Exception as e:
        log.debug("a write failed as the call ended: %r", e)
        await asyncio.sleep(CLOSE_NOTICE_S)
        return False


async def abort(context, code: grpc.StatusCode, message: str) -> NoReturn:
    """Ends the call with `code` and `message`. A call past its deadline has ended in gRPC's core already (the client
    holds DEADLINE_EXCEEDED) and a status sent after it fails. gRPC ignores that failure once it has seen the call
    close and logs it as the servicer's error before, which a busy front-end can reach first: the failure is raised
    only after the wait a failed write takes."""
    try:
        await context.abort(code, message)
    except grpc.aio.AbortError:
        raise
    except Exception as e:
        log.debug("a status could not go out as the call ended: %r", e)
        await asyncio.sleep(CLOSE_NOTICE_S)
        raise
