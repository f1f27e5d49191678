"""The OpenAI-compatible gateway (gateway/), end to end through real processes on loopback, driven by the
official `openai` package and plain HTTP (httpx), next to the gRPC client as the reference.

- `cluster` + `gateway`: a scheduler over one CPU worker serving qwen3-tiny (random weights), and a
  gateway with an API key, the checkpoint's tokenizer (logprob token strings) and the Qwen3 reasoning
  parser. Greedy answers through the gateway must equal the gRPC client's, token for token.
- `slow` + `slow_gateway` (+ `deadline_gateway`): a scheduler that admits one running and one waiting
  request (`--max-num-seqs 1 --max-waiting 1`) over a simulated worker (no model, 50 ms a step), for load
  refusal (429), disconnects (the request's KV blocks come back), the deadline (504) and, last, a dead
  worker (503).
Every wait is bounded; assertions are on states (status codes, error bodies, block counters), not timings.
"""
from __future__ import annotations


import asyncio
import functools
import importlib.metadata
import json
import os
from pathlib import Path
import signal
import subprocess
import sys
import time

import grpc
import httpx
import jsonschema
import openai
import pytest

from client import Client
from client.client import build_request
from client.launcher import LocalCluster, free_port
from gateway import protocol
from gateway.app import GatewayConfig, create_app
from gateway.errors import APIError, from_grpc, openai_param, validation_param
from gateway.reasoning import ReasoningStream, split_reasoning
from protos.splitserve_pb2_grpc import GenerationStub
from tests import sim_cluster

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[1]
API_KEY = "sk-test-gateway"
BLOCK_SIZE = 16
NUM_BLOCKS = 64
WORKER_ARGS = ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "16",
               "--max-num-batched-tokens", "1024"]
STEP_MS = 50  # the simulated worker's step time
HTTP_WORKERS = 2  # uvicorn worker processes of the main gateway
START_S = 120.0
WAIT_S = 20.0
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


# ---- processes -------------------------------------------------------------------------------------


class Gateway:
    def __init__(self, scheduler: str, log_path: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "--scheduler", scheduler, "--host", "127.0.0.1",
                 "--port", str(self.port), *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                env={**{k: v for k, v in os.environ.items() if k != "SPLITSERVE_API_KEY"}, "PYTHONUNBUFFERED": "1"},
                start_new_session=True)

    def wait_healthy(self, timeout: float = 60.0) -> "Gateway":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.popen.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"gateway not healthy after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    c = LocalCluster(tiny_model_dir, worker_args=WORKER_ARGS, log_dir=tmp_path_factory.mktemp("gw-cluster"))
    c.start(timeout=START_S)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def gateway(cluster, tiny_model_dir, tmp_path_factory):
    g = Gateway(cluster.address, tmp_path_factory.mktemp("gw") / "gateway.log", "--api-key", API_KEY,
                "--tokenizer", str(tiny_model_dir), "--reasoning-parser", "qwen3", "--workers", str(HTTP_WORKERS))
    try:
        yield g.wait_healthy()
    finally:
        g.stop()


@pytest.fixture(scope="module")
def oai(gateway) -> openai.OpenAI:
    with gateway.openai(API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with Client(cluster.address, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def slow(tiny_model_dir, tmp_path_factory):
    c = LocalCluster(tiny_model_dir, worker_command="simulate",
                     worker_args=["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
                                  "--base-ms", str(STEP_MS)],
                     scheduler_args=["--max-num-seqs", "1", "--max-waiting", "1"],
                     log_dir=tmp_path_factory.mktemp("gw-slow"))
    c.start(timeout=START_S)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def slow_gateway(slow, tmp_path_factory):
    g = Gateway(slow.address, tmp_path_factory.mktemp("gw-slow") / "gateway.log")
    try:
        yield g.wait_healthy()
    finally:
        g.stop()


def _free(address: str) -> dict:
    with Client(address, timeout=10) as c:
        (worker,) = c.model_info()["workers"]
    return worker


# the bound of this module's functional waits
wait_for = functools.partial(sim_cluster.wait_for, timeout=WAIT_S)


def _post(gateway: Gateway, path: str, body, key: str | None = API_KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{gateway.url}{path}", content=content, headers={**headers, "Content-Type": "application/json"},
                      timeout=60, **kw)


# ---- health, models, API keys ----------------------------------------------------------------------


def test_health_and_models(gateway, oai, grpc_client):
    r = httpx.get(f"{gateway.url}/health", timeout=10)  # open without a key, for probes
    assert r.status_code == 200 and r.json()["scheduler"] == "SERVING"
    r = httpx.get(f"{gateway.url}/version", timeout=10)  # vLLM's, open too
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("splitserve")}
    info = grpc_client.model_info()
    (model,) = oai.models.list().data
    assert model.id == info["model"] and model.object == "model"
    assert model.model_extra["max_model_len"] == info["max_model_len"]


def _http_workers(gateway: Gateway) -> set[int]:
    """Pids of the gateway's uvicorn worker processes (its spawned children, not multiprocessing's helpers)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == gateway.popen.pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.add(int(entry.name))
    return pids


def test_http_workers_share_the_port_and_a_dead_one_is_replaced(gateway, grpc_client):
    """--workers 2: two processes answer on the one port; kill -9 one, uvicorn starts another, and
    answers stay right (each worker has its own connection to the scheduler)."""
    wait_for("both HTTP workers", lambda: len(_http_workers(gateway)) == HTTP_WORKERS)
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    (ref,) = grpc_client.complete(PROMPT, max_tokens=6, temperature=0)
    want = ref.text

    def answers(n: int) -> list[str]:
        return [_post(gateway, "/v1/completions", body).json()["choices"][0]["text"] for _ in range(n)]

    assert answers(6) == [want] * 6
    before = _http_workers(gateway)
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    wait_for("a new HTTP worker", lambda: len(_http_workers(gateway) - before) == 1
             and len(_http_workers(gateway)) == HTTP_WORKERS)
    wait_for("health", lambda: httpx.get(f"{gateway.url}/health", timeout=5).status_code == 200)
    assert answers(6) == [want] * 6


def test_api_key_required(gateway):
    for key in (None, "wrong-key"):
        r = _post(gateway, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key=key)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["WWW-Authenticate"] == "Bearer"
    assert httpx.get(f"{gateway.url}/v1/models", timeout=10).status_code == 401
    # every route that runs the model or reads it is behind the keys, not only /v1's
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]}), ("/classify", {"input": "x"}),
                       ("/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]}),
                       ("/v2/rerank", {"query": "a", "documents": ["b"]}), ("/invocations", {"prompt": "x"}),
                       ("/reset_prefix_cache", {}), ("/flush_cache", {})):
        assert httpx.post(f"{gateway.url}{path}", json=body, timeout=10).status_code == 401, path
    for path in ("/health", "/ping", "/version", "/metrics", "/openapi.json"):
        assert httpx.get(f"{gateway.url}{path}", timeout=10).status_code == 200, path
    with gateway.openai("wrong-key") as bad, pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="x", messages=MESSAGES, max_tokens=1)


def test_reset_prefix_cache_and_sglangs_flush_cache(gateway, oai):
    """vLLM's /reset_prefix_cache and SGLang's /flush_cache: a prompt whose prefix was cached is computed whole after
    either (the scheduler's ResetPrefixCache: tests/test_services.py)."""
    prompt = " ".join(["cache me"] * 40)
    for path in ("/reset_prefix_cache", "/flush_cache"):
        oai.completions.create(model="", prompt=prompt, max_tokens=1)
        hit = oai.completions.create(model="", prompt=prompt, max_tokens=1)
        assert hit.usage.prompt_tokens_details.cached_tokens > 0
        r = httpx.post(f"{gateway.url}{path}", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        assert r.status_code == 200 and r.json()["dropped_blocks"] > 0, (path, r.text)
        cold = oai.completions.create(model="", prompt=prompt, max_tokens=1)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0, path


def test_sagemakers_ping_and_invocations(gateway):
    """SageMaker's container routes, as vLLM serves them: /ping is /health (GET or POST); /invocations takes a chat
    completion's, a completion's or an embedding's body, by what it is valid as, and refuses one that is none."""
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{gateway.url}/ping", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    assert _post(gateway, "/invocations", {"messages": MESSAGES, "max_tokens": 2}).json()["object"] == "chat.completion"
    assert _post(gateway, "/invocations", {"prompt": "x", "max_tokens": 2}).json()["object"] == "text_completion"
    embedded = _post(gateway, "/invocations", {"input": "x"}).json()
    assert embedded["object"] == "list" and embedded["data"][0]["object"] == "embedding"
    for body in ({"nothing": 1}, "not json"):
        r = _post(gateway, "/invocations", body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_metrics_count_every_request_over_all_http_workers(gateway):
    """/metrics (open, as vLLM's) adds up the HTTP worker processes: the counts after a burst of requests are
    the same whichever worker answers the scrape, and they grew by exactly the requests made."""
    def counts() -> dict:
        return sim_cluster.scrape(gateway.port)

    route = "/v1/models/{model_id:path}"
    before = counts()
    for _ in range(6):
        assert httpx.get(f"{gateway.url}/v1/models/{'x' * 3}", headers={"Authorization": f"Bearer {API_KEY}"},
                         timeout=10).status_code == 404
    for _ in range(4):
        assert _post(gateway, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key=None).status_code == 401
    assert _post(gateway, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200
    scrapes = [counts() for _ in range(2 * HTTP_WORKERS)]  # several scrapes: more than one worker answers
    name = "splitserve:gateway_http_requests_total"
    for after in scrapes:
        def grew(**labels) -> float:
            return sim_cluster.sample(after, name, **labels) - sim_cluster.sample(before, name, **labels)
        assert grew(route=route, method="GET", status="404") == 6
        assert grew(route="/v1/completions", method="POST", status="401") == 4
        assert grew(route="/v1/completions", method="POST", status="200") == 1
        assert sim_cluster.sample(after, "splitserve:gateway_http_requests_in_flight", route="/v1/completions") == 0
        assert sim_cluster.sample(after, "splitserve:gateway_http_request_duration_seconds_count",
                                  route="/v1/completions") >= 5


# ---- completions and chat through the openai package -------------------------------------------------


def test_completions_greedy_equal_grpc(oai, grpc_client):
    (ref,) = grpc_client.complete(PROMPT, max_tokens=12, temperature=0)
    out = oai.completions.create(model="", prompt=PROMPT, max_tokens=12, temperature=0)
    (choice,) = out.choices
    assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.prompt_tokens_details.cached_tokens >= 0

    chunks = list(oai.completions.create(model="", prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason

    # A prompt of token ids, and a list of prompts (choices: prompt-major, n per prompt).
    ids = grpc_client.tokenize(PROMPT)
    assert oai.completions.create(model="", prompt=ids, max_tokens=12, temperature=0).choices[0].text == ref.text
    (ref2,) = grpc_client.complete("Once upon a time", max_tokens=6, temperature=0)
    many = oai.completions.create(model="", prompt=[PROMPT, "Once upon a time"], n=2, max_tokens=6, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices[2:]] == [ref2.text] * 2
    echo = oai.completions.create(model="", prompt=PROMPT, max_tokens=12, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + ref.text
    # vLLM's truncate_prompt_tokens: the prompt's last 3 tokens, as if they had been sent; not with echo
    (ref3,) = grpc_client.complete(token_ids=ids[-3:], max_tokens=6, temperature=0)
    cut = oai.completions.create(model="", prompt=PROMPT, max_tokens=6, temperature=0,
                                 extra_body={"truncate_prompt_tokens": 3})
    assert cut.choices[0].text == ref3.text and cut.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="", prompt=PROMPT, max_tokens=6, echo=True,
                               extra_body={"truncate_prompt_tokens": 3})
    assert e.value.body["param"] == "truncate_prompt_tokens"
    assert ref.text.startswith(many.choices[0].text) and many.choices[0].text == many.choices[1].text


def test_chat_greedy_equal_grpc(oai, grpc_client):
    (ref,) = grpc_client.complete(messages=MESSAGES, max_tokens=12, temperature=0)
    out = oai.chat.completions.create(model="", messages=MESSAGES, max_tokens=12, temperature=0)
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.message.model_extra.get("reasoning_content") is None  # no think block in this answer
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens and out.usage.completion_tokens == len(ref.token_ids)

    stream = oai.chat.completions.create(model="", messages=MESSAGES, max_completion_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)

    # Qwen3's switch reaches the chat template: thinking off puts an empty think block in the prompt.
    (ref_off,) = grpc_client.complete(messages=MESSAGES, max_tokens=8, temperature=0, enable_thinking=False)
    off = oai.chat.completions.create(model="", messages=MESSAGES, max_tokens=8, temperature=0,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == ref_off.text
    assert off.usage.prompt_tokens == ref_off.usage.prompt_tokens == ref.usage.prompt_tokens + 4


def test_continue_final_message_continues_an_assistants_start(oai, grpc_client):
    """vLLM's continue_final_message: the last message, an assistant's start, rendered open (no generation prompt), as
    the scheduler renders it for gRPC; the answer goes on from it."""
    started = [*MESSAGES, {"role": "assistant", "content": "The colour is"}]
    (ref,) = grpc_client.complete(messages=started, continue_final_message=True, max_tokens=6, temperature=0,
                                  ignore_eos=True)
    ids = grpc_client.tokenize(messages=started, continue_final_message=True)
    out = oai.chat.completions.create(model="", messages=started, max_tokens=6, temperature=0,
                                      extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                  "ignore_eos": True})
    assert out.choices[0].message.content == ref.text and out.usage.prompt_tokens == len(ids)
    assert ids != grpc_client.tokenize(messages=started)


def test_include_stop_str_in_output_keeps_the_stop_string(oai, grpc_client):
    """vLLM's include_stop_str_in_output: the text ends with the stop string that ended it (without: before it)."""
    (ref,) = grpc_client.complete(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    stop = ref.text.strip()[2:5]
    end = ref.text.find(stop)
    assert len(stop) == 3 and end > 0
    for include, want in ((True, ref.text[:end + 3]), (False, ref.text[:end])):
        out = oai.completions.create(model="", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        assert (out.choices[0].text, out.choices[0].finish_reason) == (want, "stop")


def test_allowed_token_ids_reach_the_sampler(oai, grpc_client, gateway):
    """vLLM's allowed_token_ids: the gateway's completion is the gRPC one restricted the same way; an id past the
    vocabulary is a 400 naming the field."""
    allowed = [11, 220, 1000]
    (ref,) = grpc_client.complete(PROMPT, max_tokens=6, temperature=0, ignore_eos=True, allowed_token_ids=allowed)
    assert set(ref.token_ids) <= set(allowed)
    out = oai.completions.create(model="", prompt=PROMPT, max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert out.choices[0].text == ref.text
    bad = _post(gateway, "/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [1 << 30]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids", bad.text


def test_bad_words_reach_the_sampler(oai, grpc_client, gateway, tiny_model_dir):
    """vLLM's bad_words: a word of the plain completion's tokens is kept out of the gateway's completion as out of the
    gRPC one; more words than the scheduler takes is a 400 naming the field."""
    from tokenizers import Tokenizer

    (plain,) = grpc_client.complete(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    word = next(tokenizer.decode([t]) for t in plain.token_ids  # a token that is a word of its own
                if tokenizer.encode(tokenizer.decode([t]).lstrip(), add_special_tokens=False).ids == [t])
    (ref,) = grpc_client.complete(PROMPT, max_tokens=6, temperature=0, ignore_eos=True, bad_words=[word])
    assert ref.token_ids != plain.token_ids
    out = oai.completions.create(model="", prompt=PROMPT, max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True, "bad_words": [word]})
    assert out.choices[0].text == ref.text
    bad = _post(gateway, "/v1/completions", {"prompt": PROMPT, "bad_words": ["x"] * 129})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bad_words", bad.text


def test_chat_content_parts_render_as_the_clients(oai, grpc_client, gateway):
    """OpenAI's content parts, through the gateway and the gRPC client alike (client.content_text): texts joined by
    newlines, the same prompt and tokens; a part that is not text is 400 naming it."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a colour."}]}]
    (ref,) = grpc_client.complete(messages=parts, max_tokens=6, temperature=0)
    (joined,) = grpc_client.complete(messages=[{"role": "user", "content": "Name\na colour."}], max_tokens=6,
                                     temperature=0)
    out = oai.chat.completions.create(model="", messages=parts, max_tokens=6, temperature=0)
    assert out.choices[0].message.content == ref.text == joined.text
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens == joined.usage.prompt_tokens
    image = [{"role": "user", "content": [parts[0]["content"][0], {"type": "image_url", "image_url": {"url": "x"}}]}]
    r = httpx.post(f"{gateway.url}/v1/chat/completions", headers={"authorization": f"Bearer {API_KEY}"}, timeout=30,
                   json={"model": "", "messages": image, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1]", r.text


def test_chat_default_max_tokens_fills_the_model(oai, grpc_client):
    """No max_tokens in chat: up to the model's length (OpenAI's default), not the proto's 16."""
    out = oai.chat.completions.create(model="", messages=MESSAGES, temperature=0, seed=3)
    max_model_len = grpc_client.model_info()["max_model_len"]
    if out.choices[0].finish_reason == "length":
        assert out.usage.total_tokens == max_model_len
    else:
        assert out.usage.completion_tokens > 16


def test_n_and_logprobs(oai, grpc_client):
    chat = oai.chat.completions.create(model="", messages=MESSAGES, n=3, max_tokens=6, temperature=0.9, seed=7,
                                       logprobs=True, top_logprobs=2)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage.completion_tokens == 18
    assert len({c.message.content for c in chat.choices}) > 1  # each completion gets its own seed
    for c in chat.choices:
        assert len(c.logprobs.content) == 6
        for lp in c.logprobs.content:
            assert lp.logprob <= 0 and len(lp.top_logprobs) == 2 and lp.bytes
            assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob

    # n > 1 streamed: a role chunk, then the deltas of each choice, which match the whole answers.
    whole = oai.chat.completions.create(model="", messages=MESSAGES, n=2, max_tokens=6, temperature=0.9, seed=5)
    texts = ["", ""]
    for chunk in oai.chat.completions.create(model="", messages=MESSAGES, n=2, max_tokens=6, temperature=0.9,
                                             seed=5, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in whole.choices]

    # Greedy: the tokens' bytes spell the answer; the logprobs are the gRPC client's.
    (ref,) = grpc_client.complete(messages=MESSAGES, max_tokens=8, temperature=0, logprobs=2)
    greedy = oai.chat.completions.create(model="", messages=MESSAGES, max_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=2).choices[0]
    assert bytes(b for lp in greedy.logprobs.content for b in lp.bytes).decode() == greedy.message.content
    assert [lp.logprob for lp in greedy.logprobs.content] == pytest.approx([lp for lp, _ in ref.logprobs], abs=1e-4)
    assert all(lp.top_logprobs[0].token == lp.token for lp in greedy.logprobs.content)

    # Completions: the legacy logprobs object, in one answer and streamed.
    (ref,) = grpc_client.complete(PROMPT, max_tokens=8, temperature=0, logprobs=3)
    one = oai.completions.create(model="", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3).choices[0]
    assert one.text == ref.text and "".join(one.logprobs.tokens) == one.text
    assert one.logprobs.token_logprobs == pytest.approx([lp for lp, _ in ref.logprobs], abs=1e-4)
    assert all(len(top) >= 3 and one.logprobs.tokens[i] in top for i, top in enumerate(one.logprobs.top_logprobs))
    assert one.logprobs.text_offset[0] == 0 and one.logprobs.text_offset[1] == len(one.logprobs.tokens[0])
    streamed = list(oai.completions.create(model="", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                           stream=True))
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == one.logprobs.tokens


def test_stop_seed_and_extensions(oai, grpc_client):
    (ref,) = grpc_client.complete(PROMPT, max_tokens=12, temperature=0)
    stop = ref.text[3:6]
    out = oai.completions.create(model="", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]).choices[0]
    assert out.finish_reason == "stop" and stop not in out.text and ref.text.startswith(out.text)
    assert out.model_extra["stop_reason"] == stop
    kwargs = dict(model="", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=11, presence_penalty=0.5,
                  frequency_penalty=0.5, user="tester",
                  extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1})
    a, b = (oai.completions.create(**kwargs).choices[0].text for _ in range(2))
    (c,) = grpc_client.complete(PROMPT, max_tokens=10, temperature=1.0, seed=11, presence_penalty=0.5,
                                frequency_penalty=0.5, top_k=20, min_p=0.01, repetition_penalty=1.1)
    assert a == b == c.text


def test_logit_bias_reaches_the_sampler(oai, grpc_client):
    """OpenAI's logit_bias (token ids as JSON strings) gives gRPC's logit_bias tokens, on both endpoints."""
    (free,) = grpc_client.complete(PROMPT, max_tokens=6, temperature=0)
    bias = {free.token_ids[0]: -100.0, 40: 3.0}
    (ref,) = grpc_client.complete(PROMPT, max_tokens=6, temperature=0, logit_bias=bias)
    assert ref.token_ids[0] != free.token_ids[0]
    out = oai.completions.create(model="", prompt=PROMPT, max_tokens=6, temperature=0,
                                 logit_bias={str(t): b for t, b in bias.items()})
    assert out.choices[0].text == ref.text


# ---- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100_000}, "max_tokens"),  # the scheduler's check
    ("/v1/completions", {"prompt": "x", "n": 1000}, "n"),  # the scheduler's check
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10_000_000], "max_tokens": 1}, "prompt"),  # outside the vocabulary
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 200}}, "logit_bias"),  # the scheduler's check
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 100_000}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "frequency_penalty": "high"}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": "yes"}},
     "chat_template_kwargs.enable_thinking"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs.messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": "extreme"}, "reasoning_effort"),
    # the scheduler renders the model's template only (no --trust-request-chat-template)
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template": "{{ messages[0].content }}"}, "chat_template"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template": "{{ messages[0].content }}", "max_tokens": 4},
     "chat_template"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages[0].content }}"}, "chat_template"),
    ("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True},
     "add_generation_prompt"),
    # past float32 (the document allowed them; the scheduler refused them as inf)
    ("/v1/completions", {"prompt": "x", "temperature": 1e39}, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "repetition_penalty": 1e39}, "repetition_penalty"),
    # a tool_choice whose function is not an object (was a 500), a tool call's id that is not a string
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": 5, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, *MESSAGES]},
     "messages[0].tool_calls[0].id"),
    # JSON Schema's false, refused by the gateway (true is any JSON: test_values_the_document_allows_are_taken)
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "a", "schema": False}}},
     "response_format"),
])
def test_invalid_parameter_is_400_naming_it(gateway, path, body, param):
    r = _post(gateway, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_values_the_document_allows_are_taken(gateway):
    """Found by tests/test_gateway_schemathesis.py: a repetition_penalty float32 rounds to 0 (was refused as not
    > 0), the largest float32 temperature, JSON Schema's true as a response_format's schema (llguidance refused it),
    OpenAI's largest seed."""
    for extra in ({"repetition_penalty": 1e-40}, {"temperature": 3.4e38},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "any", "schema": True}}},
                  {"seed": (1 << 63) - 1}):
        r = _post(gateway, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **extra})
        assert r.status_code == 200, (extra, r.text)


def test_other_client_errors(gateway, oai):
    r = _post(gateway, "/v1/completions", "{not json")
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the body is not valid JSON")
    r = _post(gateway, "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="", messages=MESSAGES, temperature=-0.5)
    assert e.value.status_code == 400 and e.value.param == "temperature"


def test_error_mapping():
    class Failed(grpc.RpcError):
        def __init__(self, code, details):
            self._code, self._details = code, details

        def code(self):
            return self._code

        def details(self):
            return self._details

    expected = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
                grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNKNOWN: 500}
    for code, status in expected.items():
        error = from_grpc(Failed(code, "temperature must be >= 0"))
        assert isinstance(error, APIError) and error.status == status
        assert set(error.body()["error"]) == {"message", "type", "param", "code"}
        assert (error.param == "temperature") == (status == 400)
        assert ("Retry-After" in error.headers()) == (status in (429, 503))
    assert openai_param("prompt.chat.messages[1].role must be one of", prompt_param="messages") == "messages"
    assert openai_param("prompt (9 tokens) + max_tokens (5000) exceeds max_model_len (512)",
                        max_tokens_param="max_completion_tokens") == "max_completion_tokens"
    assert openai_param("sampling.top_k must be -1, 0 (off) or positive") == "top_k"
    assert openai_param("logprobs must be None or >= 0", logprobs_param="top_logprobs") == "top_logprobs"
    assert openai_param("something else went wrong") is None
    assert validation_param(("body", "messages", 0, "content", "str")) == "messages[0].content"
    assert validation_param(("body", "prompt", "list[list[int]]", 1, 0)) == "prompt[1][0]"


# ---- the OpenAPI document -----------------------------------------------------------------------------


@functools.cache
def _document() -> dict:
    return create_app(GatewayConfig()).openapi()


def _document_takes(doc: dict, schema: dict, body) -> bool:
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).is_valid(body)


USER = {"role": "user", "content": "x"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SCHEMA_BODIES = [  # (schema, body, taken); each refused one is a rule of the gateway's own code
    ("CompletionRequest", {"prompt": "x"}, True),
    ("CompletionRequest", {"prompt": [[1, 2]], "max_tokens": 0, "echo": True}, True),
    ("CompletionRequest", {"prompt": "x", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}, True),
    ("CompletionRequest", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}, True),
    ("CompletionRequest", {"prompt": "x", "nope": 1}, False),
    ("CompletionRequest", {"prompt": ""}, False),
    ("CompletionRequest", {"prompt": [[]]}, False),
    ("CompletionRequest", {"prompt": "x", "max_tokens": 0}, False),
    ("CompletionRequest", {"prompt": "x", "stream_options": {"include_usage": True}}, False),
    ("CompletionRequest", {"prompt": "x", "n": protocol.MAX_N + 1}, False),
    ("CompletionRequest", {"prompt": "x", "stop": ["a"] * (protocol.MAX_STOP_STRINGS + 1)}, False),
    ("CompletionRequest", {"prompt": "x", "stop": ""}, False),
    ("CompletionRequest", {"prompt": "x", "logit_bias": {"abc": 1}}, False),
    ("CompletionRequest", {"prompt": "x", "logit_bias": {"5": 101}}, False),
    ("CompletionRequest", {"prompt": "x", "priority": 101}, False),
    ("CompletionRequest", {"prompt": "x", "temperature": 1e39}, False),
    ("CompletionRequest", {"prompt": "x", "suffix": "s"}, False),
    ("CompletionRequest", {"prompt": "x", "cache_salt": "s" * protocol.MAX_CACHE_SALT}, True),
    ("CompletionRequest", {"prompt": "x", "cache_salt": "s" * (protocol.MAX_CACHE_SALT + 1)}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": -1}, True),
    ("EmbeddingRequest", {"input": "x", "truncate_prompt_tokens": -2}, False),
    ("EmbeddingRequest", {"input": ["a", "b"], "encoding_format": "base64", "dimensions": 8}, True),
    ("EmbeddingRequest", {"input": [[1, 2], [3]]}, True),
    ("EmbeddingRequest", {"input": []}, False),
    ("EmbeddingRequest", {"input": "a", "dimensions": 0}, False),
    ("EmbeddingRequest", {"input": "a", "encoding_format": "int8"}, False),
    ("CompletionRequest", {"prompt": "x", "guided_regex": ""}, False),
    ("ChatCompletionRequest", {"messages": [USER]}, True),
    ("ChatCompletionRequest", {"messages": [USER, {"role": "assistant"}]}, True),
    ("ChatCompletionRequest", {"messages": [{"role": "developer", "content": [{"type": "text", "text": "x"}]}]}, True),
    ("ChatCompletionRequest", {"messages": [USER], "tools": [TOOL], "tool_choice": "required"}, True),
    ("ChatCompletionRequest", {"messages": [USER], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": True}}}, True),
    ("ChatCompletionRequest", {"messages": [{"role": "user"}]}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "wizard", "content": "x"}]}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, False),
    ("ChatCompletionRequest", {"messages": [USER] * (protocol.MAX_CHAT_MESSAGES + 1)}, False),
    ("ChatCompletionRequest", {"messages": [USER], "top_logprobs": 2}, False),
    ("ChatCompletionRequest", {"messages": [USER], "tool_choice": "required"}, False),
    ("ChatCompletionRequest", {"messages": [USER], "tools": [TOOL], "tool_choice": {"function": "f"}}, False),
    ("ChatCompletionRequest", {"messages": [USER], "functions": [{"name": "f"}]}, False),
    ("ChatCompletionRequest", {"messages": [USER], "chat_template_kwargs": {"add_vision_id": True}}, True),
    ("ChatCompletionRequest", {"messages": [USER], "chat_template_kwargs": {"a-b": True}}, False),
    ("ChatCompletionRequest", {"messages": [USER], "chat_template_kwargs": {"tools": []}}, False),
    ("ChatCompletionRequest", {"messages": [USER], "continue_final_message": True, "add_generation_prompt": False},
     True),
    ("ChatCompletionRequest", {"messages": [USER], "continue_final_message": True, "add_generation_prompt": True},
     False),
    ("ChatCompletionRequest", {"messages": [USER], "add_generation_prompt": False}, False),
    ("/tokenize", {"messages": [USER], "continue_final_message": True, "add_generation_prompt": True}, False),
    ("ChatCompletionRequest", {"messages": [USER], "response_format": {"type": "json_schema",
                                                                      "json_schema": {"name": "a"}}}, False),
    ("ChatCompletionRequest", {"messages": [USER], "response_format": {
        "type": "structural_tag", "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<a"]}},
     True),
    ("ChatCompletionRequest", {"messages": [USER], "response_format": {
        "type": "structural_tag", "structures": [{"begin": "<a>", "end": "</a>"}], "triggers": []}}, False),
    ("ResponsesRequest", {"input": "x"}, True),
    ("ResponsesRequest", {"input": [USER, {"type": "reasoning", "id": "rs_1"}], "store": False}, True),
    ("ResponsesRequest", {"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": "required"}, True),
    ("ResponsesRequest", {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {}}}}, True),
    ("ResponsesRequest", {"input": ""}, False),
    ("ResponsesRequest", {"input": [{"type": "reasoning", "id": "rs_1"}]}, False),
    ("ResponsesRequest", {"input": "x", "tool_choice": "required"}, False),
    ("ResponsesRequest", {"input": "x", "store": True}, False),
    ("ResponsesRequest", {"input": "x", "previous_response_id": "resp_1"}, False),
    ("ResponsesRequest", {"input": "x", "include": []}, False),
    ("ResponsesRequest", {"input": "x", "tools": [{"type": "web_search"}]}, False),
    ("ResponsesRequest", {"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, False),
    ("ChatCompletionRequest", {"messages": [USER], "bad_words": [" x "]}, True),
    ("ChatCompletionRequest", {"messages": [USER], "bad_words": [" \x1c"]}, False),
    ("/tokenize", {"prompt": "x"}, True),
    ("/tokenize", {"messages": [USER]}, True),
    ("/tokenize", {}, False),
    ("/tokenize", {"prompt": "x", "messages": [USER]}, False),
    ("/tokenize", {"prompt": ""}, False),
]


@pytest.mark.parametrize("name, body, taken", SCHEMA_BODIES)
def test_the_document_states_the_gateways_request_rules(name, body, taken):
    """Found by tests/test_gateway_schemathesis.py: the document allowed what the gateway refuses (unknown fields,
    the scheduler's limits, a message without content, both or none of /tokenize's prompt and messages, ...)."""
    doc = _document()
    if name.startswith("/"):
        schema = doc["paths"][name]["post"]["requestBody"]["content"]["application/json"]["schema"]
    else:
        schema = {"$ref": f"#/components/schemas/{name}"}
    assert _document_takes(doc, schema, body) == taken


def test_the_document_describes_the_answers():
    """Found by tests/test_gateway_schemathesis.py: /metrics is text, /health's 503 is its own body (not an error
    body), /detokenize may be 501, and a stream's events carry chunks (the document said a string)."""
    doc = _document()
    paths = doc["paths"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    health = paths["/health"]["get"]["responses"]
    assert health["503"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/HealthBody"}
    assert _document_takes(doc, health["503"]["content"]["application/json"]["schema"],
                           {"status": "unavailable", "scheduler": "NOT_SERVING"})
    assert "501" in paths["/detokenize"]["post"]["responses"]
    event = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert _document_takes(doc, event, {"data": "[DONE]"})
    data = event["properties"]["data"]["anyOf"][1]
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
    assert _document_takes(doc, data["contentSchema"], chunk)
    assert not _document_takes(doc, data["contentSchema"], {**chunk, "created": "1"})
    event = paths["/v1/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    data = event["properties"]["data"]["contentSchema"]
    assert _document_takes(doc, data, {"type": "response.output_text.delta", "sequence_number": 3, "delta": "Hi"})
    assert not _document_takes(doc, data, {"type": "response.completed"})


def test_the_documented_limits_are_the_schedulers():
    from gateway import schemas
    from scheduler_svc import requests, sampling, structured

    assert (protocol.MAX_N, protocol.MAX_PRIORITY, protocol.MAX_CHAT_MESSAGES, protocol.MAX_EMBED_INPUTS,
            protocol.MAX_CACHE_SALT) == (requests.MAX_N, requests.MAX_PRIORITY, requests.MAX_CHAT_MESSAGES,
                                         requests.MAX_EMBED_INPUTS, requests.MAX_CACHE_SALT)
    assert (protocol.MAX_STOP_STRINGS, protocol.MAX_STOP_STRING_LEN, protocol.MAX_STOP_TOKEN_IDS,
            protocol.MAX_LOGIT_BIAS, protocol.MAX_LOGPROBS, protocol.MAX_ALLOWED_TOKEN_IDS, protocol.MAX_BAD_WORDS) == (
        sampling.MAX_STOP_STRINGS, sampling.MAX_STOP_STRING_LEN, sampling.MAX_STOP_TOKEN_IDS, sampling.MAX_LOGIT_BIAS,
        sampling.MAX_LOGPROBS, sampling.MAX_ALLOWED_TOKEN_IDS, sampling.MAX_BAD_WORDS)
    assert schemas.MAX_CHOICES == structured.MAX_CHOICES


# ---- Qwen3 reasoning parser -------------------------------------------------------------------------


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nLet me see.\n</think>\n\nBlue.", "Let me see.\n", "Blue."),
    ("  <think>a</think>b", "a", "b"),
    ("Blue.", None, "Blue."),
    ("<think>\n\n</think>\n\nBlue.", "", "Blue."),
    ("<think>cut off before the end", "cut off before the end", ""),
    ("Blue <think>not at the start</think>", None, "Blue <think>not at the start</think>"),
    ("<thin", None, "<thin"),
    ("", None, ""),
])
def test_reasoning_split(text, reasoning, content):
    _check_split("qwen3", text, reasoning, content)


@pytest.mark.parametrize("text, reasoning, content", [
    ("\nLet me see.\n</think>\n\nBlue.", "Let me see.\n", "Blue."),  # the prompt opened the block
    ("<think>\nLet me see.</think>Blue.", "Let me see.", "Blue."),  # a model that opens it again
    ("</think>\n\nBlue.", "", "Blue."),
    ("still thinking when cut off", "still thinking when cut off", ""),
    ("Blue <think>inside</think> then", "Blue <think>inside", "then"),
    ("<thin", "<thin", ""),
    ("", None, ""),
])
def test_deepseek_r1_reasoning_split(text, reasoning, content):
    """DeepSeek-R1's answers (GLM-4.5's, Qwen3-Thinking-2507's) start inside their reasoning."""
    _check_split("deepseek_r1", text, reasoning, content)


def _check_split(parser: str, text: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, parser) == (reasoning, content)
    for size in (1, 2, 3, 5):  # streamed in pieces, tags split anywhere: the same result
        stream, r, c = ReasoningStream(parser), "", ""
        for i in range(0, len(text), size):
            dr, dc = stream.feed(text[i:i + size])
            r, c = r + dr, c + dc
        dr, dc = stream.finish()
        assert ((r + dr) if stream.saw_reasoning else None, c + dc) == (reasoning, content)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_in_chat_answers(parser):
    """The chat renderers with the parser on, fed deltas as the scheduler sends them (one answer that thinks:
    Qwen3's opens its think block, DeepSeek-R1's starts inside it), stream and whole: reasoning_content apart, the
    same split both ways."""
    from types import SimpleNamespace

    from client.client import Delta, Usage
    from gateway.backend import GatewayConfig
    from gateway.events import chat_events
    from gateway.jobs import Job
    from gateway.render import chat_message
    from gateway.tokens import TokenRenderer

    pieces = ["<think>", "\nThe user", " wants a colour.\n", "</think>", "\n\nBlue", "."][parser == "deepseek_r1":]
    deltas = [Delta(0, [i], t) for i, t in enumerate(pieces)]
    deltas[-1].finish_reason, deltas[-1].usage = "stop", Usage(9, len(pieces), 0)
    backend = SimpleNamespace(config=GatewayConfig(reasoning_parser=parser), tokens=TokenRenderer())
    body = SimpleNamespace(include_reasoning=True)

    async def source():
        for d in deltas:
            yield 0, d

    async def events():
        job = Job([{"token_ids": [1]}], {}, 1)
        return [e async for e in chat_events(source(), None, job, backend, "id", "m", 0, body, True)]

    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(events()) if e != "data: [DONE]\n\n"]
    streamed = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in streamed) == "The user wants a colour.\n"
    assert "".join(d.get("content", "") for d in streamed) == "Blue."
    assert chunks[-1]["usage"]["completion_tokens"] == len(pieces)
    whole = chat_message("".join(pieces), parser, include_reasoning=True)
    assert whole == {"role": "assistant", "content": "Blue.", "reasoning_content": "The user wants a colour.\n"}
    assert chat_message("Blue.", None, include_reasoning=True) == {"role": "assistant", "content": "Blue."}


def test_a_harmony_gateway_keeps_the_special_tokens_in_chat_text(cluster, tiny_model_dir, tmp_path_factory, oai):
    """With --reasoning-parser openai_gptoss a chat answer's text keeps the tokenizer's special tokens (harmony's
    markers are special tokens of gpt-oss's tokenizer) through the services: a special token the sampler is pushed to
    write stays in the content (not harmony, so all content), where the default gateway's answer drops it."""
    from tokenizers import Tokenizer

    special = "<|im_start|>"
    token = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).token_to_id(special)
    kwargs = dict(model="", messages=MESSAGES, max_tokens=3, temperature=0, logit_bias={str(token): 100.0},
                  extra_body={"ignore_eos": True})
    assert oai.chat.completions.create(**kwargs).choices[0].message.content == ""
    g = Gateway(cluster.address, tmp_path_factory.mktemp("gw-harmony") / "gateway.log", "--reasoning-parser",
                "openai_gptoss", "--workers", "1")
    try:
        with g.wait_healthy().openai() as client:
            message = client.chat.completions.create(**kwargs).choices[0].message
            assert message.content == special * 3 and message.model_extra.get("reasoning_content") is None
    finally:
        g.stop()


# ---- load, disconnects, deadlines, dead workers (slow cluster) --------------------------------------


def test_load_refusal_is_429(slow, slow_gateway):
    """One request runs, one waits (--max-num-seqs 1 --max-waiting 1): the next is refused, 429."""
    with grpc.insecure_channel(slow.address) as channel:
        stub = GenerationStub(channel)
        running = stub.Generate(build_request(PROMPT, max_tokens=400, ignore_eos=True), timeout=60)
        try:
            next(running)
            waiting = stub.Generate(build_request(PROMPT, max_tokens=400, ignore_eos=True), timeout=60)
            try:
                wait_for("a waiting request", lambda: _free(slow.address)["num_waiting"] == 1)
                r = _post(slow_gateway, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, key=None)
                assert r.status_code == 429, r.text
                assert r.json()["error"]["type"] == "rate_limit_error" and r.headers["Retry-After"]
                with slow_gateway.openai() as client, pytest.raises(openai.RateLimitError):
                    client.chat.completions.create(model="", messages=MESSAGES, max_tokens=4, stream=True)
            finally:
                waiting.cancel()
        finally:
            running.cancel()
    wait_for("blocks freed", lambda: _free(slow.address)["free_blocks"] == NUM_BLOCKS)


def test_echoed_prompt_logprobs_over_a_simulated_worker(slow_gateway):
    """The simulated worker makes up a logprob for every token asked (-(1 + t % 8) / 8, its top n the tokens
    after it), so echo with logprobs answers over it as over a model: the prompt's (the first null), then the
    completion's, each with its top 2."""
    r = _post(slow_gateway, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 2,
                                                "ignore_eos": True}, key=None)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    prompt_len = r.json()["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == prompt_len + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(-8 * v in range(1, 9) for v in lp["token_logprobs"][1:])
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])


def _leave_stream(slow, stream, is_text) -> None:
    """Reads `stream` until 3 of its items hold text (is_text), then leaves it: the request held blocks until then,
    and gives them all back within 5 s of the client leaving."""
    pieces = 0
    for item in stream:
        pieces += bool(is_text(item))
        if pieces == 3:
            break
    assert _free(slow.address)["free_blocks"] < NUM_BLOCKS
    left = time.monotonic()
    stream.close()
    wait_for("blocks freed", lambda: _free(slow.address)["free_blocks"] == NUM_BLOCKS, timeout=5)
    assert _free(slow.address)["num_running"] == 0 and time.monotonic() - left < 5


def test_disconnect_frees_blocks(slow, slow_gateway):
    """A client that leaves mid-answer (streaming, chat or Responses, or not) cancels the gRPC call: the blocks come
    back long before the answer would have ended (300 tokens at 50 ms a step: 15 s)."""
    assert _free(slow.address)["free_blocks"] == NUM_BLOCKS
    with slow_gateway.openai() as client:
        _leave_stream(slow, client.chat.completions.create(model="", messages=MESSAGES, max_tokens=300, stream=True,
                                                           extra_body={"ignore_eos": True}),
                      lambda chunk: chunk.choices and chunk.choices[0].delta.content)
        # the Responses API's events, which wrap the chat stream's (the simulated worker never draws EOS)
        _leave_stream(slow, client.responses.create(model="", input="hi", max_output_tokens=300, stream=True),
                      lambda event: event.type == "response.output_text.delta")

    # Not streaming: the client gives up while the answer is being computed.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow_gateway.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True},
                   timeout=httpx.Timeout(60, read=1.0))
    wait_for("blocks freed", lambda: _free(slow.address)["free_blocks"] == NUM_BLOCKS, timeout=5)


def test_deadline_is_504(slow, tmp_path_factory):
    g = Gateway(slow.address, tmp_path_factory.mktemp("gw-deadline") / "gateway.log", "--request-timeout", "1")
    try:
        g.wait_healthy()
        r = httpx.post(f"{g.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "timeout"
    finally:
        g.stop()
    wait_for("blocks freed", lambda: _free(slow.address)["free_blocks"] == NUM_BLOCKS, timeout=5)


def test_no_worker_is_503(slow, slow_gateway):
    """Last of the module: the slow cluster's only worker dies."""
    (worker,) = [p for p in slow.processes if p.name.startswith("worker")]
    worker.popen.kill()
    worker.popen.wait(10)
    wait_for("health 503", lambda: httpx.get(f"{slow_gateway.url}/health", timeout=5).status_code == 503)
    r = _post(slow_gateway, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, key=None)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "service_unavailable" and r.headers["Retry-After"]
    with slow_gateway.openai() as client, pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="", messages=MESSAGES, max_tokens=4)
    assert e.value.status_code == 503


# ---- /v1/responses' events from a streamed chat answer's (gateway/responses.py; live: test_gateway_structured.py) ---


def _chat_chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> str:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                  "choices": choices, "usage": usage}) + "\n\n"


def _response_events(chunks: list[str]) -> list[tuple[str, dict]]:
    from gateway.protocol import ResponsesRequest
    from gateway.responses import response_events

    async def source():
        for c in chunks:
            yield c

    async def run():
        return [e async for e in response_events(source(), ResponsesRequest(input="x"), "resp_1", "m", 1)]

    out = []
    for raw in asyncio.run(run()):
        head, data = raw.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}" and raw.endswith("\n\n")
        out.append((event["type"], event))
    assert [e["sequence_number"] for _, e in out] == list(range(len(out)))
    return out


USAGE = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 3}}


def test_response_events_of_reasoning_a_message_and_a_call():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    events = _response_events([
        _chat_chunk({"role": "assistant", "content": ""}), _chat_chunk({"reasoning_content": "Let me "}),
        _chat_chunk({"reasoning_content": "think."}), _chat_chunk({"content": "Hi"}),
        _chat_chunk({"content": " there"}),
        _chat_chunk({"tool_calls": [call]}, "tool_calls"), _chat_chunk(usage=USAGE), "data: [DONE]\n\n"])
    item = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    assert [kind for kind, _ in events] == [
        "response.created", "response.in_progress",
        *item, *["response.reasoning_text.delta"] * 2, "response.reasoning_text.done", *done,
        *item, *["response.output_text.delta"] * 2, "response.output_text.done", *done,
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and [i["type"] for i in final["output"]] == [
        "reasoning", "message", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert final["output"][1]["content"][0]["text"] == "Hi there"
    assert {k: final["output"][2][k] for k in ("call_id", "name", "arguments")} == {
        "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}
    assert final["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 7,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
    added = [e for kind, e in events if kind == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2] and added[2]["item"]["status"] == "in_progress"
    assert all(e["item_id"] == final["output"][e["output_index"]]["id"] for kind, e in events if "item_id" in e)


def test_response_events_end_incomplete_at_the_token_limit_and_failed_after_an_error():
    events = _response_events([_chat_chunk({"content": "Hi"}, "length"), _chat_chunk(usage=USAGE),
                               "data: [DONE]\n\n"])
    final = events[-1][1]["response"]
    assert events[-1][0] == "response.incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    error = {"error": {"message": "the scheduler is unavailable", "type": "server_error", "param": None,
                       "code": "service_unavailable"}}
    events = _response_events([_chat_chunk({"content": "Hi"}), "data: " + json.dumps(error) + "\n\n",
                               "data: [DONE]\n\n"])
    kinds = [kind for kind, _ in events]
    assert "error" in kinds and kinds[-1] == "response.failed"
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "service_unavailable"
    assert failed["output"][0]["content"][0]["text"] == "Hi"  # what came before the failure
