"""Request bodies of the OpenAI API as pydantic models: the fields OpenAI and vLLM clients send.

Types and simple ranges are checked here (a failure is a 400 naming the field); what needs the model
(token ids in the vocabulary, lengths against max_model_len, the KV capacity) is checked by the
scheduler, whose INVALID_ARGUMENT comes back as a 400 naming the field too. A field the gateway does not
implement is a 400 naming it (`unsupported_fields`), not silently ignored: a client asking for behaviour it would
not get is told so; only ACCEPTED_EXTRAS, which concern OpenAI's platform and not the answer, pass unread.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# Fields OpenAI clients send that change nothing in an answer (storage, billing tier, tags).
ACCEPTED_EXTRAS = frozenset({"metadata", "store", "service_tier"})
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI allows 20 in chat, 5 in completions; vLLM 20)
SEED_LIMIT = 1 << 64


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")

    def unsupported_fields(self) -> list[str]:
        """The request's fields this gateway neither implements nor may ignore."""
        return sorted(set(self.model_extra or ()) - ACCEPTED_EXTRAS)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (vLLM's names).
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = None
    priority: int | None = 0
    # The output's constraint (gateway/structured.py): OpenAI's response_format, or vLLM's fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_GenerationRequest):
    # A string, a list of strings, a list of token ids, or a list of lists of token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: the prompt alone (scored with logprobs)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls: {"id", "type", "function": {...}}
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool | None = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    parallel_tool_calls: bool | None = True


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text prompt or chat messages (rendered by the model's template)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


# ---- response bodies, for the OpenAPI document (answers are built as dicts; these describe them) --------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error body, for every 4xx and 5xx."""
    error: ErrorDetail


class UsageBody(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None  # stop, length, abort, grammar
    stop_reason: str | int | None = None


class _Answer(BaseModel):
    """What both endpoints' whole answers carry beside their choices."""
    id: str
    object: str
    created: int
    model: str
    usage: UsageBody
    system_fingerprint: str | None = None


class CompletionResponse(_Answer):
    """A whole answer of /v1/completions (with stream: server-sent events of text_completion chunks)."""
    object: str = "text_completion"
    choices: list[CompletionChoice]


class ChatChoiceMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatChoiceMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None  # stop, length, tool_calls, abort, grammar
    stop_reason: str | int | None = None


class ChatCompletionResponse(_Answer):
    """A whole answer of /v1/chat/completions (with stream: server-sent events of chat.completion.chunk)."""
    object: str = "chat.completion"
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
