"""The OpenAI JSON of an answer: its parts (logprobs, legacy and chat; usage; the assistant message; a streamed
chunk) and, for a request without `stream`, the whole answer from the choices collected from its deltas."""
from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from client.client import Delta
from gateway.backend import Backend
from gateway.harmony import split_answer
from gateway.jobs import Job
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.reasoning import split_reasoning
from gateway.tokens import TokenRenderer
from gateway.tools import with_calls, with_tool_calls

LOGPROB_FLOOR = -9999.0  # -inf (a masked token) as a JSON number, like vLLM


def chunker(rid: str, object_type: str, created: int, model: str, include_usage: bool):
    """One SSE chunk of a streamed answer: its choices (and `more` fields), and usage (null until the last chunk)
    when the client asked for stream_options.include_usage."""
    def chunk(choices: list[dict[str, Any]], usage_body: dict[str, Any] | None = None, **more: Any) -> str:
        obj: dict[str, Any] = {"id": rid, "object": object_type, "created": created, "model": model,
                               "choices": choices, **more}
        if include_usage:
            obj["usage"] = usage_body
        return sse_event(obj)
    return chunk


def sse_event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


@dataclass
class Usage:
    """Usage of a whole request: each prompt counted once, its cached tokens from its first completion."""
    prompt: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)
    completion: int = 0

    def add(self, prompt_index: int, delta: Delta) -> None:
        if delta.usage is None:
            return
        self.prompt[prompt_index] = delta.usage.prompt_tokens
        if delta.index == 0:
            self.cached[prompt_index] = delta.usage.cached_prompt_tokens
        self.completion += delta.usage.completion_tokens

    def body(self) -> dict[str, Any]:
        prompt = sum(self.prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion,
                "total_tokens": prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}


def _lp(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def completion_logprobs(tokens: TokenRenderer, token_ids: list[int], logprobs, offset: int
                         ) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy logprobs object for some tokens, and the text offset after them."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, (logprob, top) in zip(token_ids, logprobs):
        text, _ = tokens.render(token_id)
        alternatives = {tokens.render(t)[0]: _lp(p) for t, p in top}
        alternatives.setdefault(text, _lp(logprob))
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(logprob))
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def echo_logprobs(tokens: TokenRenderer, prompt_ids: list[int], prompt_logprobs) -> tuple[dict[str, Any], int]:
    """The prompt's part of an echoed completion's logprobs, and the text offset after it: the first token has
    no context, so its logprob and its alternatives are null."""
    if len(prompt_logprobs or ()) != len(prompt_ids) - 1:
        raise RuntimeError(f"{len(prompt_logprobs or ())} prompt logprobs for a prompt of {len(prompt_ids)} tokens")
    first, _ = tokens.render(prompt_ids[0])
    rest, offset = completion_logprobs(tokens, prompt_ids[1:], prompt_logprobs or (), len(first))
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}, offset


def prompt_logprobs(tokens: TokenRenderer, prompt_ids: list[int], logprobs) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: null for the first token (no context), then each token's logprob and its top
    alternatives by token id, each with its rank among them (the prompt token's where it is one of them, else
    null) and its text."""
    out: list[dict[str, Any] | None] = [None]
    for token_id, (logprob, top) in zip(prompt_ids[1:], logprobs or ()):
        entry = {str(t): {"logprob": _lp(p), "rank": rank, "decoded_token": tokens.render(t)[0]}
                 for rank, (t, p) in enumerate(top or (), 1)}
        entry.setdefault(str(token_id), {"logprob": _lp(logprob), "rank": None,
                                         "decoded_token": tokens.render(token_id)[0]})
        out.append(entry)
    return out


def renderer(job: Job, backend: Backend) -> TokenRenderer:
    """How the job's logprobs name tokens."""
    return job.tokens or backend.tokens


def joined_logprobs(first: dict[str, list], then: dict[str, list]) -> dict[str, list]:
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(tokens: TokenRenderer, token_ids: list[int], logprobs) -> list[dict[str, Any]]:
    content = []
    for token_id, (logprob, top) in zip(token_ids, logprobs):
        text, raw = tokens.render(token_id)
        alternatives = []
        for t, p in top:
            t_text, t_raw = tokens.render(t)
            alternatives.append({"token": t_text, "logprob": _lp(p), "bytes": t_raw})
        content.append({"token": text, "logprob": _lp(logprob), "bytes": raw, "top_logprobs": alternatives})
    return content


def chat_message(text: str, reasoning_parser: str | None, include_reasoning: bool) -> dict[str, Any]:
    """The assistant message of a whole answer; with a reasoning parser, its thinking apart."""
    if reasoning_parser is None:
        return {"role": "assistant", "content": text}
    thought, content = split_reasoning(text, reasoning_parser)
    return {"role": "assistant", "content": content, "reasoning_content": thought if include_reasoning else None}


def harmony_message(text: str, finish: str | None, calls: bool, include_reasoning: bool
                    ) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a whole harmony answer (gateway/harmony.py; `calls`: messages to functions are
    calls), and its finish reason (tool_calls when a call ended it)."""
    split = split_answer(text, calls=calls)
    message = {"role": "assistant", "content": split.content,
               "reasoning_content": split.reasoning or None if include_reasoning else None}
    return with_calls(message, split.content, split.calls, finish)


@dataclass
class Choice:
    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    prompt_token_ids: list[int] | None = None  # with prompt logprobs (an echoed completion's)
    prompt_logprobs: list | None = None
    weight_version: str | None = None  # of the weights that computed it


async def collect(it: AsyncIterator[tuple[int, Delta]], first: tuple[int, Delta] | None, job: Job
                   ) -> tuple[list[Choice], Usage]:
    choices = [Choice(i) for i in range(job.num_choices)]
    usage = Usage()

    def add(prompt_index: int, delta: Delta) -> None:
        c = choices[prompt_index * job.n + delta.index]
        c.text.append(delta.text)
        c.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            c.logprobs.extend(delta.logprobs)
        if delta.prompt_token_ids is not None:
            c.prompt_token_ids, c.prompt_logprobs = delta.prompt_token_ids, delta.prompt_logprobs
        if delta.finish_reason is not None:
            c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
            c.weight_version = delta.weight_version
        usage.add(prompt_index, delta)

    if first is not None:
        add(*first)
    async for prompt_index, delta in it:
        add(prompt_index, delta)
    return choices, usage


# ---- the application -------------------------------------------------------------------------------


def chat_completion(choices: list[Choice], usage: Usage, job: Job, backend: Backend, rid: str, model: str,
                    created: int, body: ChatCompletionRequest) -> dict[str, Any]:
    """A whole chat answer: each choice's message (its thinking and tool calls apart) and logprobs."""
    out = []
    include_reasoning = body.include_reasoning is not False
    tokens = renderer(job, backend)
    for c in choices:
        finish = c.finish_reason
        if job.harmony:
            message, finish = harmony_message("".join(c.text), finish, job.reads_calls, include_reasoning)
        else:
            message = chat_message("".join(c.text), backend.config.text_reasoning_parser, include_reasoning)
        if job.tools is not None and not (job.harmony and job.reads_calls):  # harmony's own calls: above
            message, finish = with_tool_calls(message, finish, job.tools, backend.config.tool_call_parser)
        logprobs = {"content": chat_logprobs(tokens, c.token_ids, c.logprobs)} if c.logprobs else None
        out.append({"index": c.index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish, "stop_reason": c.stop_reason})
        if job.return_token_ids:
            out[-1]["token_ids"] = c.token_ids
    answer = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
              "usage": usage.body(), "system_fingerprint": None, "metadata": metadata(choices)}
    if choices and job.return_token_ids:
        answer["prompt_token_ids"] = choices[0].prompt_token_ids
    if choices and job.prompt_logprobs:
        answer["prompt_logprobs"] = prompt_logprobs(tokens, choices[0].prompt_token_ids or [],
                                                    choices[0].prompt_logprobs)
    return answer


def text_completion(choices: list[Choice], usage: Usage, job: Job, backend: Backend, rid: str, model: str,
                    created: int, body: CompletionRequest) -> dict[str, Any]:
    """A whole completions answer: each choice's text (after its echoed prompt) and legacy logprobs."""
    tokens, out = renderer(job, backend), []
    for c in choices:
        prefix = job.prompts[c.index // job.n].get("echo", "")
        if body.echo and body.logprobs is not None and c.prompt_token_ids:
            logprobs, offset = echo_logprobs(tokens, c.prompt_token_ids, c.prompt_logprobs)
            logprobs = joined_logprobs(logprobs, completion_logprobs(tokens, c.token_ids, c.logprobs, offset)[0])
        else:
            logprobs = completion_logprobs(tokens, c.token_ids, c.logprobs, 0)[0] if c.logprobs else None
        out.append({"index": c.index, "text": prefix + "".join(c.text), "logprobs": logprobs,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        if job.return_token_ids:
            out[-1].update(token_ids=c.token_ids, prompt_token_ids=c.prompt_token_ids)
        if job.prompt_logprobs:
            out[-1]["prompt_logprobs"] = prompt_logprobs(tokens, c.prompt_token_ids or [], c.prompt_logprobs)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
            "usage": usage.body(), "system_fingerprint": None, "metadata": metadata(choices)}


def metadata(choices: list[Choice]) -> dict[str, Any]:
    """SGLang's metadata of a whole answer: the version of the weights that computed its (first) choice, which an RL
    loop that updates them while sampling reads (/update_weights_from_disk's weight_version)."""
    return {"weight_version": choices[0].weight_version if choices else None}
