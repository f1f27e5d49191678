"""Every request field is checked at the scheduler before anything is allocated: each bad value, alone,
is INVALID_ARGUMENT with a message naming the field (its path in the proto) and what it allows; the
server then still serves, with every block free.

One scheduler over one simulated worker (real tokenizer and config, no model), max_model_len 256.
"""
from __future__ import annotations

import math

import grpc
import pytest

from client import Client
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from tests.sim_cluster import WAIT_S, all_idle, config_only_model, start_simulated, wait_for

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 256
VOCAB = 151936


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = config_only_model(tmp_path_factory.mktemp("sim-model") / "qwen3-tiny")
    c = start_simulated(model, tmp_path_factory.mktemp("validation-logs"),
                        worker_args=["--num-blocks", "64", "--block-size", "16", "--max-model-len",
                                     str(MAX_MODEL_LEN)])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.address) as channel:
        yield pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.address, timeout=WAIT_S) as c:
        yield c


def req(**fields) -> pb.GenerateRequest:
    """A valid request (token ids [1, 2, 3], 2 tokens) with `fields` changed; sampling / stopping fields are
    given as sampling_<name> / stopping_<name>."""
    r = pb.GenerateRequest()
    r.token_ids.ids.extend([1, 2, 3])
    r.stopping.max_tokens = 2
    for name, value in fields.items():
        if name.startswith(("sampling_", "stopping_")):
            part, field = name.split("_", 1)
            msg = getattr(r, part)
            if isinstance(value, list):
                getattr(msg, field).extend(value)
            elif isinstance(value, dict):
                getattr(msg, field).update(value)
            else:
                setattr(msg, field, value)
        elif name == "prompt":
            value(r)
        else:
            setattr(r, name, value)
    return r


def text(s: str):
    return lambda r: setattr(r, "text", s)


def token_ids(ids: list[int]):
    def set_ids(r):
        r.ClearField("token_ids")
        r.token_ids.SetInParent()
        r.token_ids.ids.extend(ids)
    return set_ids


def chat(*messages: tuple[str, str]):
    def set_chat(r):
        r.chat.SetInParent()
        for role, content in messages:
            r.chat.messages.add(role=role, content=content)
    return set_chat


def no_prompt(r):
    r.ClearField("token_ids")


CASES = [
    # (id, request, expected field path, expected piece of the allowed range)
    ("no prompt", req(prompt=no_prompt), "prompt", "exactly one of text, token_ids or chat"),
    ("empty text", req(prompt=text("")), "prompt.text", "must not be empty"),
    ("empty token ids", req(prompt=token_ids([])), "prompt.token_ids", "must not be empty"),
    ("empty chat", req(prompt=chat()), "prompt.chat.messages", "must not be empty"),
    ("token id = vocab", req(prompt=token_ids([1, VOCAB])), "prompt.token_ids", f"[0, {VOCAB})"),
    ("negative token id", req(prompt=token_ids([-1, 5])), "prompt.token_ids", f"[0, {VOCAB})"),
    ("token ids beyond model", req(prompt=token_ids([7] * MAX_MODEL_LEN)), "prompt.token_ids",
     f"fewer than max_model_len ({MAX_MODEL_LEN})"),
    ("text beyond model", req(prompt=text("hello " * 300)), "prompt.text",
     f"fewer than max_model_len ({MAX_MODEL_LEN})"),
    ("text beyond byte cap", req(prompt=text("x" * 70_000)), "prompt.text", "at most 65536 bytes"),
    ("prompt + max_tokens beyond model", req(prompt=token_ids([7] * 200), stopping_max_tokens=57),
     "stopping.max_tokens", "at most 56"),
    ("max_tokens 0", req(stopping_max_tokens=0), "stopping.max_tokens", "at least 1"),
    ("unknown LoRA adapter", req(lora="sql"), "lora", "(they serve none)"),
    ("long cache salt", req(cache_salt="s" * 257), "cache_salt", "at most 256 characters"),
    ("truncate_prompt_tokens 0", req(truncate_prompt_tokens=0), "truncate_prompt_tokens", f"[1, {MAX_MODEL_LEN - 1}]"),
    ("truncate_prompt_tokens -2", req(truncate_prompt_tokens=-2), "truncate_prompt_tokens", "-1 (as many as"),
    ("truncate_prompt_tokens = model", req(truncate_prompt_tokens=MAX_MODEL_LEN), "truncate_prompt_tokens",
     f"[1, {MAX_MODEL_LEN - 1}]"),
    ("prompt truncated to the model + max_tokens", req(prompt=token_ids([7] * 400), truncate_prompt_tokens=-1),
     "stopping.max_tokens", "at most 1"),
    ("huge max_tokens", req(stopping_max_tokens=2**32 - 1), "stopping.max_tokens", "at most 253"),
    ("too many bad words", req(sampling_bad_words=["no"] * 129), "sampling.bad_words", "at most 128 words"),
    ("bad word of only spaces", req(sampling_bad_words=["  "]), "sampling.bad_words", "not only spaces"),
    ("bad word of too many tokens", req(sampling_bad_words=[" ".join("abcdefghijklmnopqrstuvwxyzabcdefgh")]),
     "sampling.bad_words", "at most 32 tokens"),
    ("negative temperature", req(sampling_temperature=-0.5), "sampling.temperature", ">= 0"),
    ("NaN temperature", req(sampling_temperature=math.nan), "sampling.temperature", "finite"),
    ("inf temperature", req(sampling_temperature=math.inf), "sampling.temperature", "finite"),
    ("top_p 0", req(sampling_top_p=0.0), "sampling.top_p", "(0, 1]"),
    ("top_p above 1", req(sampling_top_p=1.5), "sampling.top_p", "(0, 1]"),
    ("NaN top_p", req(sampling_top_p=math.nan), "sampling.top_p", "(0, 1]"),
    ("top_k -2", req(sampling_top_k=-2), "sampling.top_k", "-1 or 0 (off) or positive"),
    ("negative min_p", req(sampling_min_p=-0.1), "sampling.min_p", "[0, 1]"),
    ("min_p above 1", req(sampling_min_p=1.5), "sampling.min_p", "[0, 1]"),
    ("NaN min_p", req(sampling_min_p=math.nan), "sampling.min_p", "[0, 1]"),
    ("repetition_penalty 0", req(sampling_repetition_penalty=0.0), "sampling.repetition_penalty", "> 0"),
    ("NaN repetition_penalty", req(sampling_repetition_penalty=math.nan), "sampling.repetition_penalty", "> 0"),
    ("NaN presence_penalty", req(sampling_presence_penalty=math.nan), "sampling.presence_penalty", "[-2, 2]"),
    ("presence_penalty 3", req(sampling_presence_penalty=3.0), "sampling.presence_penalty", "[-2, 2]"),
    ("NaN frequency_penalty", req(sampling_frequency_penalty=math.nan), "sampling.frequency_penalty", "[-2, 2]"),
    ("frequency_penalty -inf", req(sampling_frequency_penalty=-math.inf), "sampling.frequency_penalty",
     "[-2, 2]"),
    ("unknown chat role", req(prompt=chat(("user", "hi"), ("robot", "beep"))), "prompt.chat.messages[1].role",
     "one of ['assistant', 'system', 'tool', 'user']"),
    ("empty chat role", req(prompt=chat(("", "hi"))), "prompt.chat.messages[0].role", "one of"),
    ("too many messages", req(prompt=chat(*[("user", "a")] * 257)), "prompt.chat.messages", "at most 256"),
    ("chat content beyond byte cap", req(prompt=chat(("user", "y" * 40_000), ("assistant", "z" * 40_000))),
     "prompt.chat.messages[].content", "at most 65536 bytes"),
    ("too many stop strings", req(stopping_stop=[f"s{i}" for i in range(17)]), "stopping.stop", "at most 16"),
    ("stop string too long", req(stopping_stop=["a" * 257]), "stopping.stop", "at most 256 characters"),
    ("empty stop string", req(stopping_stop=["ok", ""]), "stopping.stop", "non-empty"),
    ("stop token beyond vocab", req(stopping_stop_token_ids=[VOCAB]), "stopping.stop_token_ids",
     f"[0, {VOCAB})"),
    ("negative stop token", req(stopping_stop_token_ids=[-5]), "stopping.stop_token_ids", "non-negative"),
    ("too many stop tokens", req(stopping_stop_token_ids=list(range(65))), "stopping.stop_token_ids",
     "at most 64"),
    ("min_tokens above max_tokens", req(stopping_min_tokens=3), "stopping.min_tokens", "must not exceed"),
    ("logit_bias beyond vocab", req(sampling_logit_bias={VOCAB: 1.0}), "sampling.logit_bias", f"[0, {VOCAB})"),
    ("negative logit_bias token", req(sampling_logit_bias={-3: 1.0}), "sampling.logit_bias", "non-negative"),
    ("logit_bias above 100", req(sampling_logit_bias={5: 101.0}), "sampling.logit_bias", "[-100, 100]"),
    ("NaN logit_bias", req(sampling_logit_bias={5: math.nan}), "sampling.logit_bias", "[-100, 100]"),
    ("too many logit_bias", req(sampling_logit_bias={t: 1.0 for t in range(1025)}), "sampling.logit_bias",
     "at most 1024"),
    ("logprobs above cap", req(logprobs=21), "logprobs", "[0, 20]"),
    ("prompt_logprobs above cap", req(prompt_logprobs=21), "prompt_logprobs", "[0, 20]"),
    ("huge logprobs", req(logprobs=2**32 - 1), "logprobs", "[0, 20]"),
    ("n 0", req(n=0), "n", "[1, 16]"),
    ("n above cap", req(n=17), "n", "[1, 16]"),
    ("request_id too long", req(request_id="r" * 257), "request_id", "at most 256 printable"),
    ("request_id not printable", req(request_id="a\nb"), "request_id", "printable"),
    ("priority too high", req(priority=101), "priority", "[-100, 100]"),
    ("priority too low", req(priority=-(2**31)), "priority", "[-100, 100]"),
]


@pytest.mark.parametrize("request_, field, allowed", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_bad_field_alone_is_invalid_argument_naming_it(stub, client, request_, field, allowed):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request_, timeout=WAIT_S))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    details = e.value.details()
    assert details.startswith(field + " ") or details.startswith(field + ":"), details
    assert allowed in details, details
    # Nothing was allocated, and the server goes on serving.
    assert all_idle(client)
    (done,) = client.complete(token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True)
    assert done.finish_reason == "length" and len(done.token_ids) == 2
    wait_for("every block free", lambda: all_idle(client))


def test_the_same_request_without_the_bad_field_is_served(stub, client):
    """The base request of the cases is valid, and so are the edges of every range."""
    edges = [
        req(), req(sampling_temperature=0.0), req(sampling_top_p=1.0), req(sampling_top_k=-1),
        req(sampling_min_p=1.0), req(sampling_presence_penalty=-2.0), req(sampling_frequency_penalty=2.0),
        req(stopping_stop=[f"s{i}" for i in range(16)]), req(stopping_stop=["a" * 256]), req(logprobs=20),
        req(n=16, stopping_max_tokens=1), req(request_id="r" * 256), req(priority=100), req(priority=-100),
        req(prompt=token_ids([7] * 200), stopping_max_tokens=56), req(prompt=token_ids([VOCAB - 1])),
        req(stopping_stop_token_ids=list(range(64))), req(stopping_min_tokens=2),
        req(prompt=chat(("system", "s"), ("user", "u"), ("assistant", "a"), ("tool", "t"))),
        req(prompt=token_ids([7] * 400), truncate_prompt_tokens=200, stopping_max_tokens=56),
        req(prompt=text("hello " * 300), truncate_prompt_tokens=MAX_MODEL_LEN - 3), req(truncate_prompt_tokens=-1),
    ]
    for r in edges:
        responses = list(stub.Generate(r, timeout=WAIT_S))
        finished = [x for x in responses if x.finish_reason]
        assert len(finished) == (r.n if r.HasField("n") else 1), r
    # No max_tokens with a prompt that leaves less room than the default 16: capped, not refused.
    r = req(prompt=token_ids([7] * (MAX_MODEL_LEN - 5)))
    r.stopping.ClearField("max_tokens")
    r.stopping.ignore_eos = True
    responses = list(stub.Generate(r, timeout=WAIT_S))
    assert sum(len(x.token_ids) for x in responses) == 5 and responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    wait_for("every block free", lambda: all_idle(client))


def test_tokenize_is_bounded_too(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Tokenize(pb.TokenizeRequest(text="x" * 70_000), timeout=WAIT_S)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="bot", content="x")])),
                      timeout=WAIT_S)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in e.value.details()
    assert len(stub.Tokenize(pb.TokenizeRequest(text="hello world"), timeout=WAIT_S).token_ids) == 2
