"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a fitting HTTP status,
and the mapping from the scheduler's gRPC status codes (and its field names) to them."""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import grpc

# gRPC status -> (HTTP status, OpenAI error type, code)
_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error", "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", "not_implemented"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
# Errors a client may retry after a moment (sent with a Retry-After header).
RETRYABLE = frozenset({429, 503})


class APIError(Exception):
    """An error answered in OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"} if self.status in RETRYABLE else {}


def invalid(param: str | None, message: str, code: str | None = "invalid_value") -> APIError:
    """400 for a bad field; the message starts with the field's name, as the scheduler's do."""
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return APIError(400, message, "invalid_request_error", param, code)


# The first word of a scheduler message names a field of the public proto (e.g. "stopping.max_tokens:",
# "prompt.chat.messages[0].role", "temperature must be ..."); these are their OpenAI names.
_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "stop", "stop_token_ids", "allowed_token_ids", "bad_words",
                    "min_tokens", "n", "priority", "ignore_eos", "skip_special_tokens", "logit_bias", "dimensions",
                    "truncate_prompt_tokens", "length_penalty", "include_stop_str_in_output"}
_HEAD = re.compile(r"[A-Za-z_][\w.\[\]]*")


def openai_param(message: str, *, prompt_param: str = "prompt", max_tokens_param: str = "max_tokens",
                 logprobs_param: str = "logprobs", structured_param: str = "response_format") -> str | None:
    """The OpenAI request field a scheduler INVALID_ARGUMENT message is about, or None."""
    if re.search(r"\bmax_tokens\b", message):  # "stopping.max_tokens: ...", "prompt (9 tokens) + max_tokens (..."
        return max_tokens_param
    m = _HEAD.match(message)
    if m is None:
        return None
    head = m.group(0).rstrip(".")
    if head == "prompt.chat.chat_template":
        return "chat_template"
    if head.startswith("prompt.chat.template_kwargs"):
        return head.removeprefix("prompt.chat.template_").replace("kwargs", "chat_template_kwargs", 1)
    if head.startswith(("prompt", "inputs")):  # a generation's prompt, an embedding's inputs
        return prompt_param
    if head.startswith("structured"):
        return structured_param
    name = head.split(".")[-1] if head.startswith(("sampling.", "stopping.")) else head
    if name == "logprobs":
        return logprobs_param
    return name if name in _SAMPLING_FIELDS else None


def from_grpc(error: grpc.RpcError, **param_names: str) -> APIError:
    """The HTTP error for a failed scheduler call (`param_names` as for `openai_param`)."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (error.details() if callable(getattr(error, "details", None)) else None) or str(code)
    status, type_, err_code = _GRPC_TO_HTTP.get(code, (500, "server_error", "internal_error"))
    if code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("lora ") and "is not an adapter" in details:
        # the model named an adapter no worker serves (nor could the scheduler's resolver load it), as vLLM answers
        return APIError(404, details, "invalid_request_error", "model", "model_not_found")
    param = openai_param(details, **param_names) if status == 400 else None
    if status == 400 and err_code is None:
        err_code = "invalid_value"
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"the scheduler is unavailable: {details}"
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        details = f"the server is overloaded, retry later: {details}"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        details = f"the request timed out: {details}"
    return APIError(status, details, type_, param, err_code)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "json", "literal"}


def validation_param(loc: Sequence[str | int]) -> str | None:
    """A pydantic error location as an OpenAI `param`: ("body", "messages", 0, "content", "str") ->
    "messages[0].content" (union member tags such as "str" or "list[int]" are dropped)."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and p.isidentifier() and p not in _TYPE_TAGS and not p[:1].isupper():
            out += f".{p}" if out else p
    return out or None
