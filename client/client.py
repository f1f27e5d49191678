"""Sync and asyncio clients of the public `splitserve.v1.Generation` API.

gRPC failures reach the caller as `grpc.RpcError` (status code and details intact). Leaving a
`generate()` stream early (break, close(), task cancellation) cancels the call, which makes the
server abort the request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.channel import ChannelSecurity, PathOrPem, create_channel
from client.scores import Scores, Text, cross_encoder_pairs, pair_scores, score_plan
from common.usage import Usage
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc

GENERATION_SERVICE = "splitserve.v1.Generation"

Metadata = Sequence[tuple[str, str | bytes]]
# One generated token: (its logprob, [(token_id, logprob) of the top alternatives]).
TokenLogprob = tuple[float, list[tuple[int, float]]]

_FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_GRAMMAR: "grammar",
}
# Health states worth polling through while a server starts.
_NOT_READY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(slots=True)
class Delta:
    """New tokens and text of one completion since its previous delta."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # None until the completion's last delta: "stop", "length" or "abort"
    stop_reason: str | None = None  # the stop string or token that ended it, if any
    usage: Usage | None = None  # on the completion's last delta
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first delta, when asked: prompt tokens 1.. (None: none)
    prompt_token_ids: list[int] | None = None  # on the first delta, with prompt_logprobs or return_prompt_token_ids
    cumulative_logprob: float | None = None  # a beam's summed logprob (use_beam_search), on its one delta
    weight_version: str | None = None  # on the last delta: the version of the weights that computed the tokens
    # (None: the server did not say)


@dataclass(slots=True)
class Embeddings:
    """What Embed returns: one vector per input, in order, and each input's token count."""

    vectors: list[list[float]]
    prompt_tokens: list[int]
    pooling: str  # how the model pools: last, mean or cls


@dataclass(slots=True)
class Classifications:
    """What Classify returns: for each input, in order, the probability and the logit of each label (a cross-encoder:
    one label, its relevance), and its token count."""

    probs: list[list[float]]
    logits: list[list[float]]
    prompt_tokens: list[int]
    labels: list[str]  # the model's, in the order of each input's values


@dataclass(slots=True)
class Completion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # of prompt tokens 1.. (the first has no context)
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs or return_prompt_token_ids: as encoded
    cumulative_logprob: float | None = None  # a beam's summed logprob (use_beam_search)
    weight_version: str | None = None  # the version of the weights that computed it (update_weights names them)


class GenerateParams(TypedDict, total=False):
    """Keyword arguments of `generate()` / `complete()`; mirrors `build_request`."""

    token_ids: list[int] | None
    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    enable_thinking: bool | None
    chat_template_kwargs: dict[str, Any] | None
    continue_final_message: bool
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    seed: int | None
    logit_bias: dict[int, float] | None
    allowed_token_ids: Sequence[int] | None
    bad_words: Sequence[str] | None
    prompt_logprobs: int | None
    structured: dict[str, Any] | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool
    include_stop_str_in_output: bool
    min_tokens: int | None
    logprobs: int | None
    n: int | None
    priority: int
    skip_special_tokens: bool | None
    stream_interval: int | None
    request_id: str
    lora: str
    cache_salt: str
    truncate_prompt_tokens: int | None
    return_prompt_token_ids: bool
    use_beam_search: bool
    length_penalty: float | None


def build_request(
    prompt: str | None = None,
    *,
    token_ids: list[int] | None = None,
    messages: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
    enable_thinking: bool | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    logit_bias: dict[int, float] | None = None,
    allowed_token_ids: Sequence[int] | None = None,
    bad_words: Sequence[str] | None = None,
    prompt_logprobs: int | None = None,
    structured: dict[str, Any] | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    include_stop_str_in_output: bool = False,
    min_tokens: int | None = None,
    logprobs: int | None = None,
    n: int | None = None,
    priority: int = 0,
    skip_special_tokens: bool | None = None,
    stream_interval: int | None = None,
    request_id: str = "",
    lora: str = "",
    cache_salt: str = "",
    truncate_prompt_tokens: int | None = None,
    return_prompt_token_ids: bool = False,
    use_beam_search: bool = False,
    length_penalty: float | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest in which only the arguments given (not None) are set; the server defaults the rest.

    structured: the output's constraint, one of {"json_schema": a schema (dict or JSON text)},
    {"json_object": True}, {"regex": str}, {"choice": [str, ...]}, {"grammar": Lark or GBNF text},
    {"structural_tag": {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]} (dict or JSON text)}, with
    "reasoning": "qwen3", "deepseek_r1" or "openai_gptoss" beside it where a reasoning model's thinking comes first,
    free. priority: larger is more urgent (GenerateRequest.priority: vLLM's HTTP field negated). lora: a LoRA adapter
    the workers serve (model_info()["lora_adapters"]), by name. cache_salt: cached prefixes are shared only between
    requests of the same salt. truncate_prompt_tokens: keep the prompt's last n tokens (-1: as many as the model
    takes). return_prompt_token_ids: each completion's first delta carries the prompt's token ids
    (Delta.prompt_token_ids), as the scheduler encoded it. use_beam_search: the n best beams of a beam search
    (GenerateRequest.use_beam_search), scored with length_penalty (default 1), each in one delta. chat_template: the
    messages rendered by this jinja template's text instead of the model's (ChatPrompt.chat_template: only where the
    scheduler runs with --trust-request-chat-template)."""
    if sum(p is not None for p in (prompt, token_ids, messages)) != 1:
        raise ValueError("give exactly one of prompt, token_ids or messages")
    request = pb.GenerateRequest(request_id=request_id, priority=priority, lora=lora, cache_salt=cache_salt,
                                 truncate_prompt_tokens=truncate_prompt_tokens,
                                 return_prompt_token_ids=return_prompt_token_ids, use_beam_search=use_beam_search,
                                 length_penalty=length_penalty)
    if prompt is not None:
        request.text = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    if messages is not None:
        request.chat.CopyFrom(_chat_prompt(messages, enable_thinking, tools, chat_template_kwargs,
                                           continue_final_message, chat_template))
    elif enable_thinking is not None or tools or chat_template_kwargs or continue_final_message or chat_template:
        raise ValueError("enable_thinking, tools, chat_template_kwargs, continue_final_message and chat_template "
                         "apply to chat messages only")

    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                "repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
                "frequency_penalty": frequency_penalty, "seed": seed}
    for name, value in sampling.items():
        if value is not None:
            setattr(request.sampling, name, value)
    if logit_bias:
        request.sampling.logit_bias.update(logit_bias)
    if allowed_token_ids:
        request.sampling.allowed_token_ids.extend(allowed_token_ids)
    if bad_words:
        request.sampling.bad_words.extend(bad_words)

    if max_tokens is not None:
        request.stopping.max_tokens = max_tokens
    if min_tokens is not None:
        request.stopping.min_tokens = min_tokens
    if stop:
        request.stopping.stop.extend([stop] if isinstance(stop, str) else stop)
    if stop_token_ids:
        request.stopping.stop_token_ids.extend(stop_token_ids)
    if ignore_eos:
        request.stopping.ignore_eos = True
    if include_stop_str_in_output:
        request.stopping.include_stop_str_in_output = True

    if logprobs is not None:
        request.logprobs = logprobs
    if prompt_logprobs is not None:
        request.prompt_logprobs = prompt_logprobs
    if structured is not None:
        request.structured.CopyFrom(structured_output(structured))
    if n is not None:
        request.n = n
    if skip_special_tokens is not None:
        request.skip_special_tokens = skip_special_tokens
    if stream_interval is not None:
        request.stream_interval = stream_interval
    return request


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


def structured_output(spec: dict[str, Any]) -> pb.StructuredOutput:
    """{kind: value} with exactly one of STRUCTURED_KINDS, and optionally "reasoning" (a reasoning model's thinking
    stays free and the constraint applies after it: "qwen3", "deepseek_r1" or "openai_gptoss"), as the request's
    StructuredOutput."""
    kinds = {k: v for k, v in spec.items() if k != "reasoning"}
    if len(kinds) != 1 or next(iter(kinds)) not in STRUCTURED_KINDS:
        raise ValueError(f"structured takes exactly one of {', '.join(STRUCTURED_KINDS)} (and optionally reasoning), "
                         f"got {sorted(spec)}")
    (kind, value), = kinds.items()
    if kind in ("json_schema", "structural_tag") and not isinstance(value, str):
        value = json.dumps(value)
    reasoning = spec.get("reasoning") or ""
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(choices=list(value)), reasoning=reasoning)
    return pb.StructuredOutput(**{kind: value}, reasoning=reasoning)


def _chat_prompt(messages: list[dict[str, Any]], enable_thinking: bool | None,
                 tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
                 continue_final_message: bool = False, chat_template: str | None = None) -> pb.ChatPrompt:
    """Messages in OpenAI's shape: content (None for an assistant's tool calls), tool_calls
    ([{"id", "function": {"name", "arguments": JSON text or dict}}]), tool_call_id (a tool's answer).
    template_kwargs: more keyword arguments of the chat template (gpt-oss's reasoning_effort, ...);
    continue_final_message: the last message is continued (rendered without its end, no generation prompt);
    chat_template: a jinja template's text rendered in place of the model's (where the scheduler trusts requests')."""
    chat = pb.ChatPrompt(messages=[_chat_message(m) for m in messages],
                         tools=[json.dumps(t) for t in tools or ()],
                         template_kwargs=json.dumps(template_kwargs) if template_kwargs else "",
                         continue_final_message=continue_final_message, chat_template=chat_template or "")
    if enable_thinking is not None:
        chat.enable_thinking = enable_thinking
    return chat


class NotTextPart(ValueError):
    """A chat message's content part that is not text: only text parts are served."""

    def __init__(self, index: int, kind: object):
        super().__init__(f"content[{index}]: only text parts are supported, got type {kind!r}")
        self.index, self.kind = index, kind


def content_text(content: str | Sequence[dict[str, Any]] | None) -> str:
    """A chat message's content as the chat template renders it: a string, or OpenAI's list of content parts, whose
    texts join with newlines (as vLLM joins them); NotTextPart for the first part that is not text."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for i, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise NotTextPart(i, part.get("type"))
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_message(m: dict[str, Any]) -> pb.ChatMessage:
    calls = []
    for c in m.get("tool_calls") or ():
        f = c.get("function", c)
        args = f.get("arguments", {})
        calls.append(pb.ToolCall(id=c.get("id", ""), name=f["name"],
                                 arguments=args if isinstance(args, str) else json.dumps(args)))
    return pb.ChatMessage(role=m["role"], content=content_text(m.get("content")), tool_calls=calls,
                          tool_call_id=m.get("tool_call_id") or "")


def _embed_request(inputs: str | Sequence[int] | Sequence[str | Sequence[int]], dimensions: int | None,
                   normalize: bool | None, priority: int, request_id: str,
                   truncate_prompt_tokens: int | None, lora: str) -> pb.EmbedRequest:
    """One input (a text, or token ids) or a list of them; the server checks the rest."""
    if isinstance(inputs, str) or (inputs and all(isinstance(t, int) for t in inputs)):
        inputs = [inputs]
    request = pb.EmbedRequest(request_id=request_id, priority=priority, dimensions=dimensions, normalize=normalize,
                              truncate_prompt_tokens=truncate_prompt_tokens, lora=lora)
    for item in inputs:
        if isinstance(item, str):
            request.inputs.add(text=item)
        else:
            request.inputs.add(token_ids=pb.TokenIds(ids=list(item)))
    return request


def _embeddings(response: pb.EmbedResponse) -> Embeddings:
    return Embeddings([list(e.values) for e in response.embeddings], [e.prompt_tokens for e in response.embeddings],
                      response.pooling)


ClassifyInput = str | Sequence[int] | tuple[str, str]  # a text, its token ids, or a (query, document) pair


def _classify_request(inputs: ClassifyInput | Sequence[ClassifyInput], priority: int, request_id: str,
                      truncate_prompt_tokens: int | None, lora: str) -> pb.ClassifyRequest:
    """One input or a list of them; a tuple of two texts is one pair (a list of two texts is two inputs)."""
    if isinstance(inputs, (str, tuple)) or (inputs and all(isinstance(t, int) for t in inputs)):
        inputs = [inputs]
    request = pb.ClassifyRequest(request_id=request_id, priority=priority,
                                 truncate_prompt_tokens=truncate_prompt_tokens, lora=lora)
    for item in inputs:
        if isinstance(item, str):
            request.inputs.add(text=item)
        elif isinstance(item, tuple):
            request.inputs.add(pair=pb.TextPair(text=item[0], text_pair=item[1]))
        else:
            request.inputs.add(token_ids=pb.TokenIds(ids=list(item)))
    return request


def _classifications(response: pb.ClassifyResponse) -> Classifications:
    got = response.classifications
    return Classifications([list(c.probs) for c in got], [list(c.logits) for c in got],
                           [c.prompt_tokens for c in got], list(response.labels))


def _tokenize_request(
    text: str | None, messages: list[dict[str, Any]] | None, enable_thinking: bool | None,
    tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False, add_special_tokens: bool | None = None, chat_template: str | None = None,
) -> pb.TokenizeRequest:
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text or messages")
    if messages is None:
        if enable_thinking is not None or chat_template_kwargs or continue_final_message or chat_template:
            raise ValueError("enable_thinking, chat_template_kwargs, continue_final_message and chat_template apply "
                             "to chat messages only")
        return pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
    return pb.TokenizeRequest(chat=_chat_prompt(messages, enable_thinking, tools, chat_template_kwargs,
                                                continue_final_message, chat_template),
                              add_special_tokens=add_special_tokens)


def _tokenized(response: pb.TokenizeResponse, return_token_strs: bool) -> list[int] | tuple[list[int], list[str]]:
    ids = list(response.token_ids)
    return (ids, list(response.tokens)) if return_token_strs else ids


def _logprobs(entries) -> list[TokenLogprob]:
    return [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in entries]


def _delta(response: pb.GenerateResponse) -> Delta:
    if response.prompt_token_ids:  # a completion's first message, when it asked for prompt logprobs or token ids
        delta = _delta_fields(response)
        delta.prompt_logprobs = _logprobs(response.prompt_logprobs) if response.prompt_logprobs else None
        delta.prompt_token_ids = list(response.prompt_token_ids)
        return delta
    return _delta_fields(response)


def _delta_fields(response: pb.GenerateResponse) -> Delta:
    # Positional, and the optional fields looked at only when present: this runs for every streamed token.
    logprobs = response.logprobs
    if response.finish_reason:
        usage = response.usage
        return Delta(response.index, list(response.token_ids), response.text,
                     _logprobs(logprobs) if logprobs else None,
                     _FINISH_REASONS[response.finish_reason], response.stop_reason or None,
                     Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens)
                     if response.HasField("usage") else None,
                     cumulative_logprob=response.cumulative_logprob if response.HasField("cumulative_logprob")
                     else None, weight_version=response.weight_version or None)
    return Delta(response.index, list(response.token_ids), response.text, _logprobs(logprobs) if logprobs else None)


@dataclass(slots=True)
class CompletionCollector:
    """Joins the deltas of one `generate()` stream into a Completion per index."""

    parts: dict[int, list[Delta]] = field(default_factory=dict)

    def add(self, delta: Delta) -> None:
        self.parts.setdefault(delta.index, []).append(delta)

    def completion(self, index: int) -> Completion:
        deltas = self.parts[index]
        last = deltas[-1]
        with_logprobs = [d.logprobs for d in deltas if d.logprobs is not None]
        return Completion(
            index=index,
            text="".join(d.text for d in deltas),
            token_ids=[t for d in deltas for t in d.token_ids],
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            usage=last.usage,
            logprobs=[lp for lps in with_logprobs for lp in lps] if with_logprobs else None,
            prompt_logprobs=deltas[0].prompt_logprobs,
            prompt_token_ids=deltas[0].prompt_token_ids,
            cumulative_logprob=last.cumulative_logprob,
            weight_version=last.weight_version,
        )

    def completions(self) -> list[Completion]:
        return [self.completion(index) for index in sorted(self.parts)]


def _model_info_dict(info: pb.ModelInfo) -> dict[str, Any]:
    """Every field, by its proto name; unlike JSON, 64-bit counters stay ints (per-worker `workers` included)."""
    return _plain(info)


def _plain(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in message.DESCRIPTOR.fields:
        if f.has_presence and not f.is_repeated and not message.HasField(f.name):
            continue
        value = getattr(message, f.name)
        if f.message_type is not None:
            value = [_plain(v) for v in value] if f.is_repeated else _plain(value)
        elif f.is_repeated:
            value = list(value)
        out[f.name] = value
    return out


def _status_name(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def _not_ready_status(error: grpc.RpcError) -> str:
    """What a health poll failed with, when that only means the server is still starting; else re-raises."""
    if error.code() not in _NOT_READY_CODES:
        raise error
    return f"{error.code().name}: {error.details()}"


class _Connection:
    """What both clients hold: the channel (plaintext unless TLS is asked for), stubs, default deadline
    and metadata."""
    aio = False

    def __init__(self, address: str = "127.0.0.1:50051", *, timeout: float | None = None,
                 metadata: Metadata | None = None, api_key: str | None = None, tls: bool = False,
                 tls_ca: PathOrPem | None = None, tls_cert: PathOrPem | None = None, tls_key: PathOrPem | None = None,
                 tls_server_name: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.security = ChannelSecurity(tls, tls_ca, tls_cert, tls_key, tls_server_name, api_key)
        self.metadata = (*(metadata or ()), *self.security.metadata()) or None
        self._channel = create_channel(address, self.security, aio=self.aio)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)


class Client(_Connection):
    """Blocking client. `timeout` (seconds) is the default deadline of every call; `metadata` goes with each.

    Security (client.channel): plaintext unless a TLS argument is given. `tls_ca` verifies the scheduler's
    certificate (`tls=True`: the system's CAs), `tls_cert` / `tls_key` are the client certificate a
    scheduler in mutual TLS requires (paths, or PEM bytes), `tls_server_name` the name its certificate
    carries when not the address's host; `api_key` is sent as `authorization: Bearer KEY`."""


    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **params: Unpack[GenerateParams]) -> Generator[Delta, None, None]:
        """Streams the deltas of every completion (interleaved by `index` when n > 1).

        Arguments are checked here; the call starts on the first `next()`.
        """
        return self._stream(build_request(prompt, **params), self._deadline(timeout))

    def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> Generator[Delta, None, None]:
        call = self._stub.Generate(request, timeout=timeout, metadata=self.metadata)
        try:
            for response in call:
                yield _delta(response)
        finally:
            call.cancel()  # no-op once the stream has ended; aborts the request when left early

    def complete(self, prompt: str | None = None, *, timeout: float | None = None,
                 **params: Unpack[GenerateParams]) -> list[Completion]:
        """The whole result: one Completion per `n`, in index order (one message each: stream_interval 0)."""
        collector = CompletionCollector()
        params.setdefault("stream_interval", 0)
        for delta in self.generate(prompt, timeout=timeout, **params):
            collector.add(delta)
        return collector.completions()

    def model_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        info = self._stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self._deadline(timeout), metadata=self.metadata)
        return _model_info_dict(info)

    def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None) -> list[str]:
        """Loads the LoRA adapter in the PEFT folder `path` (as the workers see their file systems) on every worker
        under `name` (a scheduler run with --allow-runtime-lora-updating); returns the adapters served then."""
        request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=str(path))
        return list(self._stub.LoadLoraAdapter(request, timeout=self._deadline(timeout),
                                               metadata=self.metadata).lora_adapters)

    def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> list[str]:
        """Unloads the LoRA adapter from every worker, once the requests running under it have ended (new ones are
        refused at once); returns the adapters served then."""
        request = pb.UnloadLoraAdapterRequest(lora_name=name)
        return list(self._stub.UnloadLoraAdapter(request, timeout=self._deadline(timeout),
                                                 metadata=self.metadata).lora_adapters)

    def update_weights(self, model_path: str, *, abort_requests: bool = False, weight_version: str = "",
                       timeout: float | None = None) -> int:
        """Has every worker read the model's weights again from the checkpoint folder `model_path` (another checkpoint
        of the served model, as the workers see their file systems: a trainer's new weights; a scheduler run with
        --allow-weight-updates). Requests sent before the call finish on the weights they started with (abort_requests:
        end at once, finish reason "abort", with the tokens they have), later ones run on the new; returns how many
        worker groups loaded them. weight_version names the new weights (default: model_path): every completion they
        compute carries it (Completion.weight_version, a last Delta's), as does model_info()."""
        request = pb.UpdateWeightsRequest(model_path=str(model_path), abort_requests=abort_requests,
                                          weight_version=weight_version)
        return self._stub.UpdateWeights(request, timeout=self._deadline(timeout), metadata=self.metadata).num_workers

    def reset_prefix_cache(self, *, timeout: float | None = None) -> int:
        """Drops every cached prefix no running request holds, on every worker (vLLM's /reset_prefix_cache);
        returns how many cached blocks were dropped."""
        return self._stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=self._deadline(timeout),
                                           metadata=self.metadata).dropped_blocks

    def tokenize(self, text: str | None = None, messages: list[dict[str, Any]] | None = None, *,
                 enable_thinking: bool | None = None, tools: list[dict[str, Any]] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False,
                 add_special_tokens: bool | None = None, return_token_strs: bool = False,
                 chat_template: str | None = None,
                 timeout: float | None = None) -> list[int] | tuple[list[int], list[str]]:
        """The prompt's token ids as a Generate call encodes it (the text's, or the messages' rendered by the chat
        template); add_special_tokens: whether the tokenizer's own special tokens (BOS, EOS) are added to the text
        or the rendered chat (default: to a text, not to a chat); return_token_strs: (ids, each id's token as the
        vocabulary spells it) instead; chat_template: the messages rendered by this jinja template instead of the
        model's (where the scheduler runs with --trust-request-chat-template)."""
        request = _tokenize_request(text, messages, enable_thinking, tools, chat_template_kwargs,
                                    continue_final_message, add_special_tokens, chat_template)
        response = self._stub.Tokenize(request, timeout=self._deadline(timeout), metadata=self.metadata)
        return _tokenized(response, return_token_strs)

    def embed(self, inputs: str | Sequence[int] | Sequence[str | Sequence[int]], *, dimensions: int | None = None,
              normalize: bool | None = None, priority: int = 0, request_id: str = "",
              truncate_prompt_tokens: int | None = None, lora: str = "",
              timeout: float | None = None) -> Embeddings:
        """Embeddings of a text, a list of token ids, or a list of either: the model's pooling of its final hidden
        states, the first `dimensions` values, L2-normalised unless `normalize` is False (default: the model's);
        of each input's last truncate_prompt_tokens tokens where that is given (-1: as many as the model takes); by
        the LoRA adapter `lora` where that is given."""
        request = _embed_request(inputs, dimensions, normalize, priority, request_id, truncate_prompt_tokens, lora)
        response = self._stub.Embed(request, timeout=self._deadline(timeout), metadata=self.metadata)
        return _embeddings(response)

    def classify(self, inputs: ClassifyInput | Sequence[ClassifyInput], *, priority: int = 0, request_id: str = "",
                 truncate_prompt_tokens: int | None = None, lora: str = "",
                 timeout: float | None = None) -> Classifications:
        """A sequence classifier's probabilities (and logits) of each label for a text, a list of token ids, a
        (text, text_pair) tuple (a cross-encoder's query and document), or a list of these; of each input's last
        truncate_prompt_tokens tokens where that is given; by the LoRA adapter `lora` where that is given."""
        request = _classify_request(inputs, priority, request_id, truncate_prompt_tokens, lora)
        return _classifications(self._stub.Classify(request, timeout=self._deadline(timeout), metadata=self.metadata))

    def score(self, text_1: Text | Sequence[Text], text_2: Text | Sequence[Text], *, priority: int = 0,
              request_id: str = "", truncate_prompt_tokens: int | None = None, lora: str = "",
              timeout: float | None = None) -> Scores:
        """Scores of text_1 against each text of text_2 (vLLM's score API): one text against one, one against many,
        or the i-th of each list against each other; by an embedding model the cosine similarity of their
        embeddings, by a cross-encoder its probability for the pair. ValueError where the two sides do not pair."""
        plan = score_plan(text_1, text_2)
        labels = self.model_info(timeout=timeout)["labels"]  # asked each time: a scheduler may come back another model
        kwargs = dict(priority=priority, request_id=request_id, truncate_prompt_tokens=truncate_prompt_tokens,
                      lora=lora, timeout=timeout)
        if labels:
            got = self.classify(cross_encoder_pairs(plan, labels), **kwargs)
            return Scores([p[0] for p in got.probs], sum(got.prompt_tokens))
        embedded = self.embed(plan.inputs, **kwargs)
        return Scores(pair_scores(plan, embedded.vectors), sum(embedded.prompt_tokens))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """"SERVING", "NOT_SERVING", ... of `service` ("" = the whole server)."""
        response = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                      timeout=self._deadline(timeout), metadata=self.metadata)
        return _status_name(response)

    def wait_until_ready(self, timeout: float) -> None:
        """Polls the Generation service's health until SERVING; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                status = self.health(GENERATION_SERVICE, timeout=max(min(remaining, 1.0), 0.01))
            except grpc.RpcError as e:
                status = _not_ready_status(e)
            if status == "SERVING":
                return
            if time.monotonic() + 0.1 >= deadline:
                raise TimeoutError(f"{self.address} not ready after {timeout} s (last: {status})")
            time.sleep(0.1)


class AsyncClient(_Connection):
    """asyncio client with the surface of `Client`; create it inside the running event loop."""

    aio = True

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **params: Unpack[GenerateParams]) -> AsyncGenerator[Delta, None]:
        """Streams the deltas of every completion. Cancelling the consuming task cancels the call; after a
        `break`, `await stream.aclose()` (or `contextlib.aclosing`) cancels it at once instead of at GC."""
        return self._stream(build_request(prompt, **params), self._deadline(timeout))

    async def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncGenerator[Delta, None]:
        call = self._stub.Generate(request, timeout=timeout, metadata=self.metadata)
        try:
            async for response in call:
                yield _delta(response)
        finally:
            call.cancel()

    async def complete(self, prompt: str | None = None, *, timeout: float | None = None,
                       **params: Unpack[GenerateParams]) -> list[Completion]:
        collector = CompletionCollector()
        params.setdefault("stream_interval", 0)
        async for delta in self.generate(prompt, timeout=timeout, **params):
            collector.add(delta)
        return collector.completions()

    async def model_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        info = await self._stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self._deadline(timeout),
                                             metadata=self.metadata)
        return _model_info_dict(info)

    async def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None) -> list[str]:
        """As Client.load_lora_adapter."""
        request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=str(path))
        return list((await self._stub.LoadLoraAdapter(request, timeout=self._deadline(timeout),
                                                      metadata=self.metadata)).lora_adapters)

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> list[str]:
        """As Client.unload_lora_adapter."""
        request = pb.UnloadLoraAdapterRequest(lora_name=name)
        return list((await self._stub.UnloadLoraAdapter(request, timeout=self._deadline(timeout),
                                                        metadata=self.metadata)).lora_adapters)

    async def update_weights(self, model_path: str, *, abort_requests: bool = False, weight_version: str = "",
                             timeout: float | None = None) -> int:
        """As Client.update_weights."""
        request = pb.UpdateWeightsRequest(model_path=str(model_path), abort_requests=abort_requests,
                                          weight_version=weight_version)
        return (await self._stub.UpdateWeights(request, timeout=self._deadline(timeout),
                                               metadata=self.metadata)).num_workers

    async def reset_prefix_cache(self, *, timeout: float | None = None) -> int:
        """As Client.reset_prefix_cache."""
        return (await self._stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=self._deadline(timeout),
                                                  metadata=self.metadata)).dropped_blocks

    async def tokenize(self, text: str | None = None, messages: list[dict[str, Any]] | None = None, *,
                       enable_thinking: bool | None = None, tools: list[dict[str, Any]] | None = None,
                       chat_template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False,
                       add_special_tokens: bool | None = None, return_token_strs: bool = False,
                       chat_template: str | None = None,
                       timeout: float | None = None) -> list[int] | tuple[list[int], list[str]]:
        request = _tokenize_request(text, messages, enable_thinking, tools, chat_template_kwargs,
                                    continue_final_message, add_special_tokens, chat_template)
        response = await self._stub.Tokenize(request, timeout=self._deadline(timeout), metadata=self.metadata)
        return _tokenized(response, return_token_strs)

    async def embed(self, inputs: str | Sequence[int] | Sequence[str | Sequence[int]], *,
                    dimensions: int | None = None, normalize: bool | None = None, priority: int = 0,
                    request_id: str = "", truncate_prompt_tokens: int | None = None, lora: str = "",
                    timeout: float | None = None) -> Embeddings:
        request = _embed_request(inputs, dimensions, normalize, priority, request_id, truncate_prompt_tokens, lora)
        response = await self._stub.Embed(request, timeout=self._deadline(timeout), metadata=self.metadata)
        return _embeddings(response)

    async def classify(self, inputs: ClassifyInput | Sequence[ClassifyInput], *, priority: int = 0,
                       request_id: str = "", truncate_prompt_tokens: int | None = None, lora: str = "",
                       timeout: float | None = None) -> Classifications:
        request = _classify_request(inputs, priority, request_id, truncate_prompt_tokens, lora)
        return _classifications(await self._stub.Classify(request, timeout=self._deadline(timeout),
                                                          metadata=self.metadata))

    async def score(self, text_1: Text | Sequence[Text], text_2: Text | Sequence[Text], *, priority: int = 0,
                    request_id: str = "", truncate_prompt_tokens: int | None = None, lora: str = "",
                    timeout: float | None = None) -> Scores:
        plan = score_plan(text_1, text_2)
        labels = (await self.model_info(timeout=timeout))["labels"]
        kwargs = dict(priority=priority, request_id=request_id, truncate_prompt_tokens=truncate_prompt_tokens,
                      lora=lora, timeout=timeout)
        if labels:
            got = await self.classify(cross_encoder_pairs(plan, labels), **kwargs)
            return Scores([p[0] for p in got.probs], sum(got.prompt_tokens))
        embedded = await self.embed(plan.inputs, **kwargs)
        return Scores(pair_scores(plan, embedded.vectors), sum(embedded.prompt_tokens))

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        response = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                            timeout=self._deadline(timeout), metadata=self.metadata)
        return _status_name(response)

    async def wait_until_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                status = await self.health(GENERATION_SERVICE, timeout=max(min(remaining, 1.0), 0.01))
            except grpc.RpcError as e:
                status = _not_ready_status(e)
            if status == "SERVING":
                return
            if time.monotonic() + 0.1 >= deadline:
                raise TimeoutError(f"{self.address} not ready after {timeout} s (last: {status})")
            await asyncio.sleep(0.1)
