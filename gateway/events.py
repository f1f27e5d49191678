"""The server-sent events of a streamed answer, completions' and chat's: each delta rendered as a chunk (chat's
with its reasoning and tool calls apart), usage at the end when asked, an error event if the stream fails after
its start, then `data: [DONE]`."""
from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from client.client import Delta
from gateway.backend import Backend
from gateway.errors import from_grpc
from gateway.harmony import HarmonyStream, Split
from gateway.jobs import Job
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.reasoning import ReasoningStream
from gateway.render import (DONE, Usage, chat_logprobs, chunker, completion_logprobs, echo_logprobs, joined_logprobs,
                            prompt_logprobs, renderer, sse_event)
from gateway.tools import ToolStream, call_bodies

log = logging.getLogger("splitserve.gateway")


class ChoiceUsage:
    """stream_options.continuous_usage_stats: each choice's usage so far, for every chunk of it."""

    def __init__(self, num_choices: int):
        self.prompt = [0] * num_choices
        self.completion = [0] * num_choices

    def add(self, index: int, delta: Delta) -> dict[str, Any]:
        if delta.prompt_token_ids is not None:
            self.prompt[index] = len(delta.prompt_token_ids)
        self.completion[index] += len(delta.token_ids)
        return self.body(index)

    def body(self, index: int) -> dict[str, Any]:
        prompt, completion = self.prompt[index], self.completion[index]
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def completion_events(it, first, job: Job, backend: Backend, rid: str, model: str, created: int,
                             body: CompletionRequest, include_usage: bool) -> AsyncGenerator[str, None]:
    usage = Usage()
    so_far = ChoiceUsage(job.num_choices) if job.continuous_usage else None
    offsets = [0] * job.num_choices
    started = [False] * job.num_choices

    chunk = chunker(rid, "text_completion", created, model, include_usage)
    tokens = renderer(job, backend)

    def render(prompt_index: int, delta: Delta) -> str | None:
        usage.add(prompt_index, delta)
        index = prompt_index * job.n + delta.index
        choice_usage = so_far.add(index, delta) if so_far is not None else None
        text = delta.text
        logprobs = None
        opening = not started[index]
        if body.echo and opening:  # the first chunk of a choice: the prompt, and its logprobs
            text = job.prompts[prompt_index].get("echo", "") + text
            if body.logprobs is not None and delta.prompt_token_ids:
                logprobs, offsets[index] = echo_logprobs(tokens, delta.prompt_token_ids, delta.prompt_logprobs)
        started[index] = True
        if delta.logprobs:
            generated, offsets[index] = completion_logprobs(tokens, delta.token_ids, delta.logprobs, offsets[index])
            logprobs = generated if logprobs is None else joined_logprobs(logprobs, generated)
        # what the client asked for beside the text: a choice's first chunk (the prompt's), and a chunk's tokens
        asked = (opening and (job.return_token_ids or job.prompt_logprobs)) or (
            job.return_token_ids and delta.token_ids)
        if not text and logprobs is None and delta.finish_reason is None and not asked:
            return None
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason,
                  "stop_reason": delta.stop_reason}
        if job.return_token_ids:
            choice["token_ids"] = delta.token_ids
            if opening:
                choice["prompt_token_ids"] = delta.prompt_token_ids
        if job.prompt_logprobs and opening:
            choice["prompt_logprobs"] = prompt_logprobs(tokens, delta.prompt_token_ids or [], delta.prompt_logprobs)
        return chunk([choice], choice_usage)

    async for event in _stream_events(it, first, render, job):
        yield event
    if include_usage and not job.failed:
        yield chunk([], usage.body())
    yield DONE


async def chat_events(it, first, job: Job, backend: Backend, rid: str, model: str, created: int,
                       body: ChatCompletionRequest, include_usage: bool) -> AsyncGenerator[str, None]:
    usage = Usage()
    parser = backend.config.text_reasoning_parser
    parsers = [ReasoningStream(parser) for _ in range(job.num_choices)] if parser else None
    include_reasoning = body.include_reasoning is not False
    tools = [ToolStream(job.tools, backend.config.tool_call_parser) for _ in range(job.num_choices)] \
        if job.tools is not None else None
    harmonies = [HarmonyStream(calls=job.reads_calls) for _ in range(job.num_choices)] if job.harmony else None
    called = [0] * job.num_choices  # harmony's calls sent so far, by choice
    so_far = ChoiceUsage(job.num_choices) if job.continuous_usage else None

    chunk = chunker(rid, "chat.completion.chunk", created, model, include_usage)
    tokens = renderer(job, backend)

    def render(prompt_index: int, delta: Delta) -> str | None:
        usage.add(prompt_index, delta)
        index = prompt_index * job.n + delta.index
        choice_usage = so_far.add(index, delta) if so_far is not None else None
        message: dict[str, Any] = {}
        finish = delta.finish_reason
        if harmonies is not None:
            split = harmonies[index].feed(delta.text) + (harmonies[index].finish() if finish is not None else Split())
            if split.reasoning and include_reasoning:
                message["reasoning_content"] = split.reasoning
            if split.content:
                message["content"] = split.content
            if split.calls:
                message["tool_calls"] = call_bodies(split.calls, streamed=True, first=called[index])
                called[index] += len(split.calls)
            if finish == "stop" and called[index]:
                finish = "tool_calls"
        elif parsers is None:
            if delta.text:
                message["content"] = delta.text
        else:
            thought, content = parsers[index].feed(delta.text)
            if delta.finish_reason is not None:
                more_thought, more_content = parsers[index].finish()
                thought, content = thought + more_thought, content + more_content
            if thought and include_reasoning:
                message["reasoning_content"] = thought
            if content:
                message["content"] = content
        if tools is not None and not (harmonies is not None and job.reads_calls):  # harmony's own calls: above
            content, calls = tools[index].feed(message.pop("content", ""), finish is not None)
            if content:
                message["content"] = content
            if calls:
                message["tool_calls"] = calls
            if finish == "stop" and tools[index].called:
                finish = "tool_calls"
        logprobs = {"content": chat_logprobs(tokens, delta.token_ids, delta.logprobs)} if delta.logprobs else None
        ids = job.return_token_ids and bool(delta.token_ids)
        if not message and logprobs is None and finish is None and not ids:
            return None
        choice = {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": delta.stop_reason}
        if job.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return chunk([choice], choice_usage)

    # The prompt's ids and logprobs, where asked, in the first chunk (the first delta has them).
    more: dict[str, Any] = {}
    if first is not None and job.return_token_ids:
        more["prompt_token_ids"] = first[1].prompt_token_ids
    if first is not None and job.prompt_logprobs:
        more["prompt_logprobs"] = prompt_logprobs(tokens, first[1].prompt_token_ids or [], first[1].prompt_logprobs)
    prompt = len(first[1].prompt_token_ids or ()) if first is not None else 0  # one prompt: every choice's
    for index in range(job.num_choices):
        role_usage = None
        if so_far is not None:
            so_far.prompt[index] = prompt
            role_usage = so_far.body(index)
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}], role_usage, **(more if index == 0 else {}))
    async for event in _stream_events(it, first, render, job):
        yield event
    if include_usage and not job.failed:
        yield chunk([], usage.body())
    yield DONE


async def _stream_events(it, first, render, job: Job) -> AsyncGenerator[str, None]:
    """The rendered events of the deltas; a gRPC failure mid-stream becomes an error event."""
    try:
        if first is not None:
            event = render(*first)
            if event:
                yield event
        async for prompt_index, delta in it:
            event = render(prompt_index, delta)
            if event:
                yield event
    except grpc.RpcError as e:
        job.failed = True
        error = from_grpc(e, **job.param_names)
        log.warning("stream failed after its start: %s %s", error.status, error.message)
        yield sse_event(error.body())
    finally:
        await it.aclose()
