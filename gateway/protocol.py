"""Request bodies of the OpenAI API as pydantic models: the fields OpenAI and vLLM clients send.

Types and simple ranges are checked here (a failure is a 400 naming the field); what needs the model
(token ids in the vocabulary, lengths against max_model_len, the KV capacity) is checked by the
scheduler, whose INVALID_ARGUMENT comes back as a 400 naming the field too. A field the gateway does not
implement is a 400 naming it (`unsupported_fields`), not silently ignored: a client asking for behaviour it would
not get is told so; only the fields about OpenAI's platform (metadata, store, service_tier) pass unread.

The OpenAPI document says what is accepted, up to what only the model or another field decides: where the
gateway checks a field itself with its own message (`doc`), the document states the same rule in JSON Schema.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from common.model_files import TEMPLATE_ARGUMENTS

from gateway.schemas import (CHOICES, CONTENT_RULE, ECHO_PROMPT_LOGPROBS_RULE, GENERATION_PROMPT_RULE, INPUT_RULE,
                             MAX_TOKENS_0_RULE, RESPONSE_FORMAT, STREAM_OPTIONS_RULE,
                             STRUCTURED_OUTPUTS, TOOL, TOOL_CALL, TOOL_CHOICE, TOOL_CHOICE_RULE, TOP_LOGPROBS_RULE, doc)
from gateway.tools import MAX_TOOLS

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI allows 20 in chat, 5 in completions; vLLM 20)
SEED_LIMIT = 1 << 64
MAX_INT64 = (1 << 63) - 1
MAX_INT32 = (1 << 31) - 1  # token ids and counts travel as int32
MAX_FLOAT32 = 3.4028234663852886e38  # sampling parameters travel as float32: a larger one would arrive as inf
# The scheduler's limits of one request (scheduler_svc/requests.py, sampling.py; a test holds them equal), stated
# here so that the document carries them.
MAX_N = 16
MAX_PRIORITY = 100
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 16
MAX_BAD_WORDS = 128
MAX_LOGIT_BIAS = 1024
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_CHAT_MESSAGES = 256
MAX_EMBED_INPUTS = 2048
MAX_CACHE_SALT = 256

TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
# vLLM's: keep the prompt's (or each input's) last n tokens; -1: as many as the model takes. The scheduler checks n
# against the model's length.
TruncatePromptTokens = Annotated[int | None, Field(ge=-1, le=MAX_INT32)]
NonEmpty = Annotated[str, StringConstraints(min_length=1)]
# vLLM's: lower is served earlier (the gRPC field's opposite: grpc_priority)
Priority = Annotated[int | None, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_STRING_LEN)]
# A bad word holds something besides whitespace (Python's, which counts \x1c-\x1f and \x85 too)
BadWord = Annotated[str, StringConstraints(max_length=MAX_STOP_STRING_LEN, pattern=r"[^\s\x1c-\x1f\x85]")]
Role = Literal["system", "user", "assistant", "tool", "developer"]  # developer: OpenAI's newer name of system


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, every chunk has its choice's so far


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Other fields are read to be refused by name (unsupported_fields): the document allows none.
    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False,
                                                                "allOf": [STREAM_OPTIONS_RULE]})

    def unsupported_fields(self) -> list[str]:
        """The request's fields this gateway neither implements nor may ignore."""
        return sorted(self.model_extra or ())

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=MAX_FLOAT32)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=MAX_N)
    # OpenAI documents an int64; any seed the proto's uint64 holds is taken.
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT, **doc({"type": "integer", "minimum": 0, "maximum": MAX_INT64}))
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # Token ids (as JSON keys) -> bias; the keys' check is _logit_bias's.
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, **doc({
            "type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]{1,9}$"},
            "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS_VALUE,
                                     "maximum": MAX_LOGIT_BIAS_VALUE}}))
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's platform: accepted, unread.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Extensions (vLLM's names).
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_FLOAT32)
    min_tokens: int | None = Field(None, ge=0, le=MAX_INT32)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    allowed_token_ids: list[TokenId] | None = Field(None, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[BadWord] | None = Field(None, max_length=MAX_BAD_WORDS)
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = None
    priority: Priority = 0
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT)  # cached prefixes shared only within a salt
    truncate_prompt_tokens: TruncatePromptTokens = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the prompt's tokens (and top n)
    return_token_ids: bool | None = False  # the prompt's and each choice's token ids beside the text
    return_tokens_as_token_ids: bool | None = False  # logprobs name tokens `token_id:N`
    use_beam_search: bool | None = False  # the n best beams of a beam search, greedy (GenerateRequest's)
    length_penalty: float | None = Field(None, ge=-MAX_FLOAT32, le=MAX_FLOAT32)  # a beam's score: logprob / len ** it
    # The output's constraint (gateway/structured.py): OpenAI's response_format, or vLLM's fields; at most one.
    response_format: dict[str, Any] | None = Field(None, **doc(RESPONSE_FORMAT))
    structured_outputs: dict[str, Any] | None = Field(None, **doc(STRUCTURED_OUTPUTS))
    guided_json: dict[str, Any] | NonEmpty | None = None
    guided_regex: NonEmpty | None = None
    guided_choice: list[str] | None = Field(None, **doc(CHOICES))
    guided_grammar: NonEmpty | None = None


class CompletionRequest(_GenerationRequest):
    model_config = ConfigDict(json_schema_extra={"additionalProperties": False,
                                                 "allOf": [STREAM_OPTIONS_RULE, MAX_TOKENS_0_RULE,
                                                           ECHO_PROMPT_LOGPROBS_RULE]})
    # A string, a list of strings, a list of token ids, or a list of lists of token ids; none empty.
    prompt: (NonEmpty | Annotated[list[NonEmpty], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT32)  # 0 only with echo: the prompt alone (scored)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # only equal to n
    suffix: str | None = Field(None, **doc({"type": "string", "maxLength": 0}))  # not supported: empty only


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"required": ["type", "text"]})
    type: str = Field(json_schema_extra={"const": "text"})  # the only kind supported (_message_text)
    text: str | None = Field(None, **doc({"type": "string"}, nullable=False))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra=CONTENT_RULE)
    role: Role
    content: str | list[ContentPart] | None = None  # None only for an assistant's message, or with tool_calls
    name: str | None = None
    # An assistant's calls; the arguments' check is _tool_calls's.
    tool_calls: list[dict[str, Any]] | None = Field(None, **doc({"type": "array", "items": TOOL_CALL}))
    tool_call_id: str | None = None  # a tool message: the call it answers


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)]
# keyword arguments of the model's chat template: Qwen3's enable_thinking, DeepSeek-V3.1's thinking, ...
TEMPLATE_KWARGS = {"type": "object", "properties": {"enable_thinking": {"type": ["boolean", "null"]}},
                   "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$", "not": {"enum": list(TEMPLATE_ARGUMENTS)}}}


class ChatCompletionRequest(_GenerationRequest):
    model_config = ConfigDict(json_schema_extra={"additionalProperties": False, "allOf": [
        STREAM_OPTIONS_RULE, TOP_LOGPROBS_RULE, TOOL_CHOICE_RULE, GENERATION_PROMPT_RULE]})
    messages: Messages
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = Field(None, **doc(TEMPLATE_KWARGS))
    chat_template: str | None = None  # vLLM's: a jinja template in place of the model's, where the scheduler trusts it
    # vLLM's: the last message (an assistant's start) is continued, with no generation prompt after it
    continue_final_message: bool | None = False
    add_generation_prompt: bool | None = None  # only as the opposite of continue_final_message
    # OpenAI's; the chat template's reasoning_effort (gpt-oss's: how long its analysis runs)
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    include_reasoning: bool | None = True
    tools: list[dict[str, Any]] | None = Field(None, **doc({"type": "array", "maxItems": MAX_TOOLS, "items": TOOL}))
    tool_choice: str | dict[str, Any] | None = Field(None, **doc(TOOL_CHOICE))
    # OpenAI's deprecated form of tools: not supported, so only empty.
    functions: list[dict[str, Any]] | None = Field(None, **doc({"type": "array", "maxItems": 0}))
    parallel_tool_calls: bool | None = True


# ---- /v1/responses (OpenAI's Responses API, served over the chat path: gateway/responses.py) ------------------


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    """A message of the conversation (an earlier answer's message is the assistant's)."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[InputText], Field(min_length=1)]


class FunctionCallItem(BaseModel):
    """A call an earlier answer made."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: str = Field(description="a JSON object's text")


class FunctionCallOutputItem(BaseModel):
    """What a call returned."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: str


class ReasoningItem(BaseModel):
    """An earlier answer's reasoning, passed back: accepted, not rendered (chat templates drop earlier turns'
    thinking)."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: NonEmpty


class TextFormat(BaseModel):
    """The output's form: free text, any JSON object, or JSON under `schema` (with type json_schema, required)."""
    model_config = ConfigDict(extra="ignore", json_schema_extra={"anyOf": [
        {"properties": {"type": {"enum": ["text", "json_object"]}}}, {"required": ["schema"]}]})
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: Literal["low", "medium", "high"] | None = None  # the chat template's reasoning_effort
    summary: str | None = None  # OpenAI's summaries of its reasoning: a model's own reasoning is given whole


class ResponsesRequest(BaseModel):
    """POST /v1/responses: one answer to `input` (text, or a conversation of messages, calls and their outputs),
    given whole. Responses are not stored: each request carries the conversation (store false,
    previous_response_id none)."""
    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False,
                                                                "allOf": [TOOL_CHOICE_RULE, INPUT_RULE]})

    def unsupported_fields(self) -> list[str]:
        return sorted(self.model_extra or ())

    model: str | None = None
    # one message is the instructions' (a system message), at most MAX_CHAT_MESSAGES in all
    input: NonEmpty | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_CHAT_MESSAGES - 1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=MAX_FLOAT32)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    store: bool | None = Field(None, **doc({"const": False}))  # true refused by name: nothing is stored
    previous_response_id: str | None = Field(None, **doc({"type": "null"}, nullable=False))  # likewise
    truncation: Literal["disabled"] | None = None
    user: str | None = None
    # OpenAI's platform: accepted, unread.
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # Extensions (vLLM's names).
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT, **doc({"type": "integer", "minimum": 0, "maximum": MAX_INT64}))
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_FLOAT32)
    priority: Priority = 0


class TokenizeCompletionRequest(BaseModel):
    """vLLM's /tokenize of a text prompt."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: NonEmpty
    add_special_tokens: bool = True  # the tokenizer's own (BOS, EOS), as a completion's prompt has them
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """vLLM's /tokenize of chat messages (rendered by the model's template, with the tools and keyword arguments a
    chat request gives it)."""
    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": [GENERATION_PROMPT_RULE]})
    model: str | None = None
    messages: Messages
    tools: list[dict[str, Any]] | None = Field(None, **doc({"type": "array", "maxItems": MAX_TOOLS, "items": TOOL}))
    chat_template_kwargs: dict[str, Any] | None = Field(None, **doc(TEMPLATE_KWARGS))
    chat_template: str | None = None
    continue_final_message: bool | None = False
    add_generation_prompt: bool | None = None
    add_special_tokens: bool = False  # the tokenizer's own (BOS, EOS) on top of what the template places
    return_token_strs: bool | None = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


# A string, a list of strings, a list of token ids, or a list of lists of token ids; none empty.
PooledInput = (NonEmpty | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]
               | Annotated[list[TokenId], Field(min_length=1)]
               | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                           Field(min_length=1, max_length=MAX_EMBED_INPUTS)])


class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings (vLLM's `normalize` too: false keeps the pooled state's length)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: PooledInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=MAX_INT32)
    normalize: bool | None = None
    truncate_prompt_tokens: TruncatePromptTokens = None
    priority: Priority = 0
    user: str | None = None


class ClassificationRequest(BaseModel):
    """vLLM's /classify, on a sequence classifier: each input's probability of each label."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: PooledInput
    truncate_prompt_tokens: TruncatePromptTokens = None
    priority: Priority = 0
    user: str | None = None


# Texts, or token ids; one side of a score's pairs (the two sides embedded together, within MAX_EMBED_INPUTS).
ScoreSide = (NonEmpty | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_EMBED_INPUTS // 2)])


class ScoreRequest(BaseModel):
    """vLLM's /v1/score: text_1 against each of text_2 (one text against one or many), or the i-th of each list;
    on an embedding model the cosine similarity of their embeddings, on a cross-encoder its probability of the pair
    (texts only)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    text_1: ScoreSide
    text_2: ScoreSide
    truncate_prompt_tokens: TruncatePromptTokens = None
    priority: Priority = 0
    user: str | None = None


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: NonEmpty


class RerankRequest(BaseModel):
    """vLLM's /v1/rerank (Jina's and Cohere's body): the documents by their score against the query (as
    ScoreRequest's), best first, the top_n of them (0: all)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    query: NonEmpty
    documents: Annotated[list[NonEmpty | RerankDocument], Field(min_length=1, max_length=MAX_EMBED_INPUTS - 1)]
    top_n: int = Field(0, ge=0, le=MAX_INT32)
    return_documents: bool = True
    truncate_prompt_tokens: TruncatePromptTokens = None
    priority: Priority = 0
    user: str | None = None


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""
    model_config = ConfigDict(extra="forbid")
    lora_name: NonEmpty
    lora_path: NonEmpty  # a PEFT folder, as the workers see their file systems


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's /update_weights_from_disk body."""
    model_config = ConfigDict(extra="forbid")
    model_path: NonEmpty  # a checkpoint folder of the served model, as the workers see their file systems
    load_format: Literal["auto"] | None = None  # SGLang's; checkpoints load as the model's own do
    abort_all_requests: bool = False  # SGLang's: the requests in flight end now (finish_reason "abort")
    weight_version: str | None = None  # SGLang's: the new weights' name on the answers they compute (model_path)


class UpdateWeightsFromDiskResponse(BaseModel):
    success: bool
    message: str
    model_path: str  # the folder every worker serves the weights of now
    num_workers: int  # worker groups that loaded them


class WeightVersionResponse(BaseModel):
    weight_version: str | None  # of the weights the first worker serves (None: none serves)


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: NonEmpty
    lora_int_id: int | None = None  # vLLM's, ignored: adapters go by name here


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    # The ids' check (in the model's vocabulary) is the route's.
    tokens: list[int] = Field(**doc({"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                "maximum": MAX_INT32}}, nullable=False))


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


# vLLM's prompt_logprobs: null for the first token, then {token id: {"logprob", "rank", "decoded_token"}} per token.
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None  # stop, length, abort, grammar
    stop_reason: str | int | None = None
    # return_token_ids: this answer's (a chunk's) tokens, and the prompt's (in a choice's first chunk, as
    # prompt_logprobs)
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class AnswerMetadata(BaseModel):
    """SGLang's."""
    weight_version: str | None = None  # of the weights that computed the (first) choice


class _Answer(BaseModel):
    """What both endpoints' whole answers carry beside their choices."""
    id: str
    object: str
    created: int
    model: str
    usage: UsageBody
    system_fingerprint: str | None = None
    metadata: AnswerMetadata | None = None


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
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(_Answer):
    """A whole answer of /v1/chat/completions (with stream: server-sent events of chat.completion.chunk)."""
    object: str = "chat.completion"
    choices: list[ChatChoice]
    prompt_token_ids: list[int] | None = None  # return_token_ids
    prompt_logprobs: PromptLogprobs | None = None


class _Chunk(BaseModel):
    """One server-sent event's data in a streamed answer."""
    id: str
    object: str
    created: int
    model: str
    # with stream_options.include_usage: null until the last chunk, which has it (continuous_usage_stats: every chunk
    # has its choice's so far)
    usage: UsageBody | None = None


class CompletionChunk(_Chunk):
    object: str = "text_completion"
    choices: list[CompletionChoice]


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's


class ChatCompletionChunk(_Chunk):
    object: str = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk
    prompt_logprobs: PromptLogprobs | None = None  # in the first chunk


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseBody(BaseModel):
    """A whole answer of /v1/responses (with stream: server-sent events of the Responses API's types, each event's
    data an object with its `type` and `sequence_number`). `output`: reasoning, message and function_call items."""
    id: str
    object: str = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    reasoning: dict[str, Any]
    store: bool
    previous_response_id: str | None = None
    truncation: str
    metadata: dict[str, str]
    user: str | None = None


class VersionBody(BaseModel):
    version: str


class ResetPrefixCacheResponse(BaseModel):
    dropped_blocks: int  # cached KV blocks dropped, over every worker and both tiers


class HealthBody(BaseModel):
    status: Literal["ok", "unavailable"]
    scheduler: str  # the Generation service's health: SERVING, NOT_SERVING, UNAVAILABLE, ...


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
    token_strs: list[str] | None = None  # with return_token_strs: each id's token as the vocabulary spells it


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64 of little-endian float32 with encoding_format "base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ClassificationData(BaseModel):
    index: int
    label: str  # the most probable
    probs: list[float]  # one per label, in the model's order
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: EmbeddingUsage


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None  # with return_documents


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class DetokenizeResponse(BaseModel):
    prompt: str


def grpc_priority(priority: int | None) -> int:
    """vLLM's priority (lower is served earlier) as the gRPC requests' field (larger is more urgent)."""
    return -(priority or 0)
