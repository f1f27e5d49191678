"""An HTTP request as the gRPC streams that serve it (a Job): its fields checked, each prompt's arguments of
`AsyncClient.generate`, and the OpenAI names of the fields a gRPC error may blame."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import grpc

from client.client import NotTextPart, content_text
from common.model_files import TEMPLATE_ARGUMENTS
from gateway import harmony
from gateway.backend import Backend
from gateway.errors import from_grpc, invalid
from gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, grpc_priority
from gateway.structured import structured_of
from gateway.tokens import TokenRenderer
from gateway.tool_parsers import PARSERS
from gateway.tools import ToolPlan, plan_tools

TOKEN_IDS = TokenRenderer()  # return_tokens_as_token_ids: every token named `token_id:N`
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
INT32 = 1 << 31
# For a top_p or repetition_penalty the schema allows (> 0) but float32 would round to 0 (a subnormal): the same
# answer as the value itself (only the top token kept; logits scaled without bound).
MIN_FLOAT32 = 1e-30


@dataclass
class Job:
    """One HTTP request as gRPC streams: one prompt each, n completions per prompt."""
    prompts: list[dict[str, Any]]
    params: dict[str, Any]
    n: int
    param_names: dict[str, str] = field(default_factory=dict)  # OpenAI names of ambiguous fields
    failed: bool = False  # a stream failed after its start (no usage chunk then)
    tools: ToolPlan | None = None  # a chat request with tools
    harmony: bool = False  # a chat answer read as gpt-oss's harmony messages (gateway/harmony.py)
    return_token_ids: bool = False  # the answer carries the prompt's and each choice's token ids
    prompt_logprobs: bool = False  # the answer carries vLLM's prompt_logprobs
    continuous_usage: bool = False  # every chunk carries its choice's usage so far
    tokens: TokenRenderer | None = None  # how logprobs name tokens: None, the gateway's own way

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def reads_calls(self) -> bool:
        """tool_choice auto: the gateway reads the calls out of the answer's text."""
        return self.tools is not None and self.tools.mode == "auto"


def _logit_bias(body: CompletionRequest | ChatCompletionRequest) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids as strings (JSON keys) -> bias; the scheduler checks ranges."""
    if not body.logit_bias:
        return None
    try:
        bias = {int(token): value for token, value in body.logit_bias.items()}
    except ValueError:
        raise invalid("logit_bias", "logit_bias keys must be token ids") from None
    if not all(0 <= t < INT32 for t in bias):
        raise invalid("logit_bias", "logit_bias keys must be token ids")
    return bias


def _common_checks(body: CompletionRequest | ChatCompletionRequest) -> None:
    for name in body.unsupported_fields():
        raise invalid(name, f"{name} is not supported by this server", "unsupported_parameter")
    _logit_bias(body)
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "stream_options is only allowed with stream: true")
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if any(not s for s in stops):
        raise invalid("stop", "stop strings must not be empty")
    if body.stop_token_ids and not all(0 <= t < INT32 for t in body.stop_token_ids):
        raise invalid("stop_token_ids", "stop_token_ids must be token ids >= 0")
    for name in ("max_tokens", "min_tokens", "n", "top_k", "priority"):
        value = getattr(body, name, None)
        if value is not None and abs(value) >= INT32:
            raise invalid(name, f"{name} is out of range: {value}")
    if getattr(body, "max_completion_tokens", None) is not None and body.max_completion_tokens >= INT32:
        raise invalid("max_completion_tokens", "max_completion_tokens is out of range")


def _sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
              logprobs: int | None) -> dict[str, Any]:
    """The gRPC request's sampling fields."""
    return dict(
        max_tokens=max_tokens, temperature=body.temperature,
        top_p=None if body.top_p is None else max(body.top_p, MIN_FLOAT32), top_k=body.top_k,
        min_p=body.min_p, presence_penalty=body.presence_penalty,
        repetition_penalty=None if body.repetition_penalty is None else max(body.repetition_penalty, MIN_FLOAT32),
        frequency_penalty=body.frequency_penalty, seed=body.seed, logit_bias=_logit_bias(body), stop=body.stop or None,
        stop_token_ids=body.stop_token_ids or None, allowed_token_ids=body.allowed_token_ids or None,
        bad_words=body.bad_words or None,
        ignore_eos=bool(body.ignore_eos), min_tokens=body.min_tokens,
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        logprobs=logprobs, n=body.n or 1, priority=grpc_priority(body.priority), cache_salt=body.cache_salt or "",
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        skip_special_tokens=body.skip_special_tokens, structured=_structured(body),
        prompt_logprobs=body.prompt_logprobs, use_beam_search=bool(body.use_beam_search),
        length_penalty=body.length_penalty)


def _answer(job: Job, body: CompletionRequest | ChatCompletionRequest) -> Job:
    """The job, with what its answer carries beside the text."""
    job.return_token_ids = bool(body.return_token_ids)
    job.prompt_logprobs = body.prompt_logprobs is not None
    job.tokens = TOKEN_IDS if body.return_tokens_as_token_ids else None
    options = body.stream_options
    job.continuous_usage = bool(body.stream and options and options.include_usage and options.continuous_usage_stats)
    # the prompt's length, for continuous usage, is its ids' count
    job.params["return_prompt_token_ids"] = job.return_token_ids or job.continuous_usage
    return job


def _structured(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any] | None:
    found = structured_of(body)
    return None if found is None else found[1]


def completion_job(body: CompletionRequest, tokens: TokenRenderer | None = None) -> Job:
    """With echo, each prompt's "echo" is the text its choices start with (a token-id prompt decoded by `tokens`, the
    gateway's tokenizer), and with logprobs too the prompt is scored (prompt_logprobs): its tokens' logprobs come
    before the completion's, as OpenAI's do. max_tokens 0 (with echo only) scores the prompt, generating nothing."""
    _common_checks(body)
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise invalid("best_of", "best_of other than n is not supported", "unsupported_parameter")
    if body.suffix:
        raise invalid("suffix", "suffix is not supported", "unsupported_parameter")
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list[dict[str, Any]] = [{"prompt": prompt}]
    elif not prompt:
        raise invalid("prompt", "prompt must not be empty")
    elif all(isinstance(p, str) for p in prompt):
        prompts = [{"prompt": p} for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [{"token_ids": list(prompt)}]
    else:
        prompts = [{"token_ids": list(p)} for p in prompt]
    for i, p in enumerate(prompts):
        ids = p.get("token_ids")
        if ids is not None and not ids:
            raise invalid(f"prompt[{i}]" if len(prompts) > 1 else "prompt", "a token-id prompt must not be empty")
        if ids is not None and not all(0 <= t < INT32 for t in ids):
            raise invalid("prompt", "prompt token ids must be >= 0")
    if body.max_tokens == 0 and not body.echo:
        raise invalid("max_tokens", "max_tokens 0 is only allowed with echo: true (the prompt alone, scored)")
    if body.echo and body.truncate_prompt_tokens is not None:
        raise invalid("truncate_prompt_tokens", "truncate_prompt_tokens cannot be set with echo: true (the echo would "
                      "not be the prompt the model saw)")
    if body.echo:
        for p in prompts:
            if "token_ids" not in p:
                p["echo"] = p["prompt"]
            elif (text := tokens.decode(p["token_ids"]) if tokens is not None else None) is not None:
                p["echo"] = text
            else:
                raise invalid("echo", "echo of a token-id prompt needs the gateway's --tokenizer (to decode it)",
                              "unsupported_parameter")
    # max_tokens unset: the scheduler's default, 16, which is OpenAI's for completions.
    params = _sampling(body, body.max_tokens, body.logprobs)
    if body.echo and (body.logprobs is not None or body.max_tokens == 0):
        if body.prompt_logprobs is not None:
            raise invalid("prompt_logprobs", "prompt_logprobs cannot be set where echo scores the prompt (echo with "
                                             "logprobs or max_tokens 0)")
        # Scoring the prompt: max_tokens 0 needs it even without logprobs (then none are returned).
        params["prompt_logprobs"] = body.logprobs or 0
    return _answer(Job(prompts, params, n), body)


def _tool_calls(i: int, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as the client takes them; arguments must be a JSON object's text."""
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"messages[{i}].tool_calls[{j}].function", "a tool call needs function.name")
        if not isinstance(c.get("id") or "", str):
            raise invalid(f"messages[{i}].tool_calls[{j}].id", "a tool call's id is a string")
        args = fn.get("arguments", "{}")
        try:
            ok = isinstance(json.loads(args) if isinstance(args, str) else args, dict)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise invalid(f"messages[{i}].tool_calls[{j}].function.arguments", "arguments must be a JSON object")
        out.append({"id": c.get("id") or "", "function": {"name": fn["name"], "arguments": args}})
    return out


def _message_text(i: int, message) -> str:
    content = message.content
    if content is None:
        if message.role == "assistant" or message.tool_calls:
            return ""
        raise invalid(f"messages[{i}].content", "content must be a string or a list of text parts")
    try:
        return content_text(content if isinstance(content, str) else [p.model_dump() for p in content])
    except NotTextPart as e:
        raise invalid(f"messages[{i}].content[{e.index}]", f"only text parts are supported, got type {e.kind!r}",
                      "unsupported_parameter") from None


def template_kwargs(given: dict[str, Any] | None, reasoning_effort: str | None = None
                    ) -> tuple[bool | None, dict[str, Any] | None]:
    """A request's chat_template_kwargs as the client takes them: (enable_thinking, the others or None), OpenAI's
    reasoning_effort among the others where given; a 400 naming a name the template cannot take."""
    kwargs = dict(given or {})
    for key in kwargs:
        if not key.isidentifier() or key in TEMPLATE_ARGUMENTS:
            raise invalid(f"chat_template_kwargs.{key[:32]}", "a keyword argument's name is an identifier, not one of "
                                                              f"the template's own ({', '.join(TEMPLATE_ARGUMENTS)})")
    enable_thinking = kwargs.pop("enable_thinking", None)
    if enable_thinking is not None and not isinstance(enable_thinking, bool):
        raise invalid("chat_template_kwargs.enable_thinking", "enable_thinking must be true or false")
    if reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", reasoning_effort)
    return enable_thinking, kwargs or None


def continues(body: ChatCompletionRequest | Any) -> bool:
    """Whether the request continues its last message (vLLM's continue_final_message); its add_generation_prompt, if
    given, must be the opposite, the one combination the scheduler renders."""
    cont = bool(body.continue_final_message)
    if body.add_generation_prompt is not None and body.add_generation_prompt == cont:
        raise invalid("add_generation_prompt", "add_generation_prompt must be the opposite of continue_final_message "
                                               "(a generation prompt would close the message it continues)",
                      "unsupported_parameter" if not cont else "invalid_value")
    return cont


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (the same for a chat request and for /tokenize)."""
    out = []
    for i, m in enumerate(messages):
        message = {"role": ROLE_ALIASES.get(m.role, m.role), "content": _message_text(i, m)}
        if m.tool_calls:
            message["tool_calls"] = _tool_calls(i, m.tool_calls)
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


async def chat_job(body: ChatCompletionRequest, backend: Backend) -> Job:
    _common_checks(body)
    if body.functions:
        raise invalid("functions", "functions (deprecated by OpenAI) is not supported: use tools",
                      "unsupported_parameter")
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    if plan is not None and plan.structured is not None and structured_of(body) is not None:
        raise invalid("tool_choice", f"tool_choice {plan.mode!r} constrains the output, as does "
                                     f"{structured_of(body)[0]}; give one")
    if not body.messages:
        raise invalid("messages", "messages must not be empty")
    messages = chat_messages(body.messages)
    enable_thinking, kwargs = template_kwargs(body.chat_template_kwargs, body.reasoning_effort)
    cont = continues(body)
    if body.top_logprobs and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    names = {"prompt_param": "messages", "max_tokens_param": max_name, "logprobs_param": "top_logprobs"}
    constraint = structured_of(body)
    if plan is not None and plan.structured is not None:
        names["structured_param"] = "tool_choice"
    elif constraint is not None:
        names["structured_param"] = constraint[0]
    tools = plan.tools if plan is not None else None
    if max_tokens is not None:
        prompt: dict[str, Any] = {"messages": messages, "enable_thinking": enable_thinking, "tools": tools,
                                  "chat_template_kwargs": kwargs, "continue_final_message": cont,
                                  "chat_template": body.chat_template}
    else:
        # OpenAI's default for chat: up to the model's length. That needs the prompt's length, so the
        # template is applied once, by the scheduler's Tokenize, and the ids are sent.
        try:
            ids = await backend.client.tokenize(messages=messages, enable_thinking=enable_thinking, tools=tools,
                                                chat_template_kwargs=kwargs, continue_final_message=cont,
                                                chat_template=body.chat_template, timeout=backend.config.rpc_timeout)
            limit = await backend.token_limit()
        except grpc.RpcError as e:
            raise from_grpc(e, **names) from None
        if len(ids) >= limit:
            raise invalid("messages", f"the prompt has {len(ids)} tokens; this model takes at most {limit - 1}")
        max_tokens = limit - len(ids)
        prompt = {"token_ids": ids}
    params = _sampling(body, max_tokens, logprobs)
    if plan is not None and plan.structured is not None:
        params["structured"] = plan.structured
    # a thinking model thinks first, free, and the constraint applies after it (as with vLLM's reasoning parsers): for
    # harmony, to the final message's text
    reasoning = harmony.REASONING_PARSER if backend.config.harmony else backend.config.text_reasoning_parser
    if params.get("structured") and reasoning:
        params["structured"] = {**params["structured"], "reasoning": reasoning}
    # harmony's markers, and some parsers' tags, are special tokens: kept in the text
    if backend.config.harmony or (plan is not None and plan.mode == "auto"
                                  and PARSERS[backend.config.tool_call_parser].keeps_special_tokens):
        params["skip_special_tokens"] = False
    return _answer(Job([prompt], params, body.n or 1, names, tools=plan, harmony=backend.config.harmony), body)
