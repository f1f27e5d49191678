"""OpenAI's Responses API (POST /v1/responses) over the chat path: a request becomes a chat request (its input the
messages, `instructions` a system message before them, its function tools, text.format and reasoning.effort under
their chat names), runs as one, and its answer is a response: output items (the reasoning, the message, each function
call), whole or streamed as the Responses API's typed events. Nothing is stored: each request carries the
conversation, its earlier calls and their outputs as input items."""
from __future__ import annotations

import itertools
import json
import re
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from gateway.errors import APIError, invalid
from gateway.protocol import (ChatCompletionRequest, FunctionCallItem, FunctionCallOutputItem, InputMessage,
                              ResponsesRequest)

# chat fields -> the Responses fields they come from, for errors raised on the chat request
RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def renamed(param: str | None) -> str | None:
    """The Responses field of a chat request's field (a message's index dropped: instructions shift them)."""
    head = re.match(r"[a-z_]+", param or "")
    return RENAMED.get(head.group(0), param) if head else param


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    for name in body.unsupported_fields():
        raise invalid(name, f"{name} is not supported by this server", "unsupported_parameter")
    if body.store:
        raise invalid("store", "responses are not stored by this server: send store false and the whole "
                               "conversation as input", "unsupported_value")
    if body.previous_response_id is not None:
        raise invalid("previous_response_id", "responses are not stored by this server: send the whole "
                                              "conversation as input", "unsupported_parameter")
    messages: list[dict[str, Any]] = [] if body.instructions is None else [
        {"role": "system", "content": body.instructions}]
    for item in [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input:
        if isinstance(item, InputMessage):
            content = item.content if isinstance(item.content, str) else [
                {"type": "text", "text": part.text} for part in item.content]
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallItem):  # calls made together join one assistant message
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not messages:
        raise invalid("input", "input holds no message (reasoning items alone)")
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
        raise invalid("text.format.schema", "a json_schema format needs its schema")
    response_format = None
    if fmt is not None and fmt.type == "json_object":
        response_format = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {k: v for k, v in {
            "name": fmt.name or "response", "description": fmt.description, "schema": fmt.schema_,
            "strict": fmt.strict}.items() if v is not None}}
    tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
             for t in body.tools] if body.tools else None
    choice = body.tool_choice
    tool_choice = {"type": "function", "function": {"name": choice.name}} if choice is not None and not isinstance(
        choice, str) else choice
    return ChatCompletionRequest(
        messages=messages, max_completion_tokens=body.max_output_tokens, temperature=body.temperature,
        top_p=body.top_p, tools=tools, tool_choice=tool_choice, parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format, reasoning_effort=body.reasoning.effort if body.reasoning else None,
        stream=body.stream, stream_options={"include_usage": True} if body.stream else None, user=body.user,
        seed=body.seed, top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
        priority=body.priority)


def renamed_error(e: APIError) -> APIError:
    e.param = renamed(e.param)
    return e


# ---- the answer -------------------------------------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else [], "status": status}


def _message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id or _item_id("msg"), "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: dict[str, Any], item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _item_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"] if status == "completed"
            else "", "status": status}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _response(body: ResponsesRequest, rid: str, model: str, created: int, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, finish: str | None = None,
              error: dict[str, Any] | None = None) -> dict[str, Any]:
    if status == "completed" and finish == "length":
        status = "incomplete"
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {
        "type": "text"}
    choice = body.tool_choice
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": model, "output": output,
        "usage": _usage(usage), "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str) else choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False, "text": {"format": fmt},
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "store": False, "previous_response_id": None, "truncation": "disabled", "metadata": body.metadata or {},
        "user": body.user}


def response_object(chat: dict[str, Any], body: ResponsesRequest, rid: str, model: str,
                    created: int) -> dict[str, Any]:
    """A whole chat answer (render.chat_completion's, one choice) as a response."""
    choice = chat["choices"][0]
    message, output = choice["message"], []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        output.append(_message_item(message["content"]))
    output += [_call_item(call) for call in message.get("tool_calls") or []]
    return _response(body, rid, model, created, "completed", output, chat["usage"], choice["finish_reason"])


async def response_events(chunks: AsyncGenerator[str, None], body: ResponsesRequest, rid: str, model: str,
                          created: int) -> AsyncGenerator[str, None]:
    """A streamed chat answer's events (events.chat_events', one choice, with usage) as the Responses API's: the
    response created and in progress, each output item added, its text or arguments in deltas, done, and the response
    completed (incomplete at max_output_tokens; failed after an error event)."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, "sequence_number": next(numbers), **fields}, ensure_ascii=False,
                          separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"

    output: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None  # the item being streamed: {"kind", "id", "text"}
    current_call: dict[str, Any] = {}  # where it is a function call, the chat tool call that opened it
    finish, usage, error = None, None, None

    def close() -> list[str]:
        nonlocal current
        if current is None:
            return []
        kind, item_id, text, index = current["kind"], current["id"], current["text"], len(output)
        current = None
        if kind == "function_call":
            call = {**current_call, "function": {**current_call["function"], "arguments": text}}
            item = _call_item(call, item_id)
            output.append(item)
            return [event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                          arguments=text), event("response.output_item.done", output_index=index, item=item)]
        item = (_reasoning_item if kind == "reasoning" else _message_item)(text, item_id)
        output.append(item)
        part = item["content"][0]
        done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [event(done, item_id=item_id, output_index=index, content_index=0, text=text, **extra),
                event("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part),
                event("response.output_item.done", output_index=index, item=item)]

    def text(kind: str, piece: str) -> list[str]:
        nonlocal current
        out = []
        if current is None or current["kind"] != kind:
            out += close()
            current = {"kind": kind, "id": _item_id("rs" if kind == "reasoning" else "msg"), "text": ""}
            item = (_reasoning_item if kind == "reasoning" else _message_item)("", current["id"], "in_progress")
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _text_part("")
            out += [event("response.output_item.added", output_index=len(output), item=item),
                    event("response.content_part.added", item_id=current["id"], output_index=len(output),
                          content_index=0, part=part)]
        current["text"] += piece
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [*out, event(delta, item_id=current["id"], output_index=len(output), content_index=0, delta=piece,
                            **extra)]

    def call(tool_call: dict[str, Any]) -> list[str]:
        nonlocal current, current_call
        out = []
        if tool_call.get("id") or current is None or current["kind"] != "function_call":  # a new call
            out += close()
            current_call = tool_call
            current = {"kind": "function_call", "id": _item_id("fc"), "text": ""}
            out.append(event("response.output_item.added", output_index=len(output),
                             item=_call_item(tool_call, current["id"], "in_progress")))
        piece = tool_call.get("function", {}).get("arguments") or ""
        current["text"] += piece
        if piece:
            out.append(event("response.function_call_arguments.delta", item_id=current["id"],
                             output_index=len(output), delta=piece))
        return out

    yield event("response.created", response=_response(body, rid, model, created, "in_progress", [], None))
    yield event("response.in_progress", response=_response(body, rid, model, created, "in_progress", [], None))
    try:
        async for raw in chunks:
            data = raw.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:  # the stream failed after its start
                error = obj["error"]
                yield event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
                continue
            usage = obj.get("usage") or usage
            for choice in obj.get("choices", ()):
                delta = choice["delta"]
                for e in (text("reasoning", delta["reasoning_content"]) if delta.get("reasoning_content") else []):
                    yield e
                for e in (text("message", delta["content"]) if delta.get("content") else []):
                    yield e
                for tool_call in delta.get("tool_calls") or ():
                    for e in call(tool_call):
                        yield e
                finish = choice.get("finish_reason") or finish
    finally:  # the chat events too, when the client goes away before their end
        await chunks.aclose()
    for e in close():
        yield e
    if error is not None:
        failed = _response(body, rid, model, created, "failed", output, usage,
                           error={"code": error.get("code") or "server_error", "message": error.get("message")})
        yield event("response.failed", response=failed)
        return
    final = _response(body, rid, model, created, "completed", output, usage, finish)
    yield event(f"response.{final['status']}", response=final)
