"""/v1/completions with `echo` and `logprobs`: the prompt's logprobs as OpenAI returns them (lm-evaluation-harness
scores loglikelihood tasks this way), `max_tokens: 0` with echo, streamed and whole, through real processes on
loopback: a scheduler over one CPU worker serving qwen3-tiny (random weights, fp32) and a gateway with the
checkpoint's tokenizer. The scheduler and worker plan at most 64 tokens a step, so a prompt of more than 64 tokens
is scored over several prefill chunks. References: transformers' log-softmax of the same checkpoint. Last,
lm-evaluation-harness's `local-completions` model runs a multiple-choice task written here against the gateway.
Every wait is bounded.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import random
import subprocess
import sys

import grpc
import httpx
import pytest
import torch
import transformers

from client import Client
from client.launcher import LocalCluster
from common.model_files import eos_token_ids
from gateway.jobs import completion_job
from gateway.errors import APIError
from gateway.protocol import CompletionRequest
from gateway.tokens import TokenRenderer
from tests import sim_cluster
from tests.test_gateway import Gateway

pytestmark = pytest.mark.timeout(180)

BLOCK_SIZE = 16
NUM_BLOCKS = 64
STEP_TOKENS = 64  # --max-num-batched-tokens: a longer prompt is prefilled (and scored) in several chunks
WORKER_ARGS = ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "8",
               "--max-num-batched-tokens", str(STEP_TOKENS)]
TOL = 1e-4
MODEL = "qwen3-tiny"  # the gateway's --served-model-name
WORDS = ("the river stone light market paper quiet seven orange window north tall garden music silver "
         "letter cloud early bridge winter table simple morning yellow forest small bright train").split()
LM_EVAL_S = 120  # bound on the harness's run (it takes ~10-20 s here)

wait_for = functools.partial(sim_cluster.wait_for, timeout=30.0, interval=0.05)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    c = LocalCluster(tiny_model_dir, worker_args=WORKER_ARGS, log_dir=tmp_path_factory.mktemp("echo-cluster"))
    c.start(timeout=120)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def gateway(cluster, tiny_model_dir, tmp_path_factory):
    g = Gateway(cluster.address, tmp_path_factory.mktemp("echo-gw") / "gateway.log", "--tokenizer",
                str(tiny_model_dir), "--workers", "1", "--served-model-name", MODEL)
    try:
        yield g.wait_healthy()
    finally:
        g.stop()


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with Client(cluster.address, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return transformers.Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return TokenRenderer(tiny_model_dir)


def _post(gateway: Gateway, body: dict) -> dict:
    r = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _events(gateway: Gateway, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _all_free(client: Client) -> bool:
    (worker,) = client.model_info()["workers"]
    return worker["free_blocks"] == worker["num_blocks"] and worker["num_running"] == 0


def _log_softmax(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].log_softmax(-1)


def _expected_top(renderer: TokenRenderer, row: torch.Tensor, token: int, k: int) -> dict[str, float]:
    """OpenAI's top_logprobs entry of one token as the gateway builds it: the top k by text (the first of two
    tokens with one text wins), and the token itself."""
    best = row.topk(k)
    top: dict[str, float] = {}
    for t, v in zip(best.indices.tolist(), best.values.tolist()):
        top.setdefault(renderer.render(t)[0], v)
    top.setdefault(renderer.render(token)[0], row[token].item())
    return top


def _check_logprobs(lp: dict, ids: list[int], ref: torch.Tensor, renderer: TokenRenderer, k: int) -> None:
    """`lp` covers `ids` (prompt then completion); ref[p] is the log-softmax after ids[:p + 1]."""
    assert lp["tokens"] == [renderer.render(t)[0] for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = lp["token_logprobs"][1:]
    want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < TOL
    for p in range(1, len(ids)):
        top, expected = lp["top_logprobs"][p], _expected_top(renderer, ref[p - 1], ids[p], k)
        assert top.keys() == expected.keys(), p
        assert max(abs(top[t] - expected[t]) for t in top) < TOL
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets


def test_echo_logprobs_equal_transformers_log_softmax(gateway, grpc_client, hf, renderer):
    """Prompt tokens first (the first's logprob and alternatives null), then the completion's, each equal to
    transformers' log-softmax within 1e-4 with its top 3: a text prompt of several prefill chunks, a token-id
    prompt of several chunks, and a prompt whose 48-token prefix an earlier request just cached (scored all the
    same: such a request takes no cache hit)."""
    rng = random.Random(21)
    long_text = _text(rng, 120)
    shared = [rng.randrange(200, 100_000) for _ in range(3 * BLOCK_SIZE)]
    cached = _post(gateway, {"prompt": shared + [rng.randrange(200, 100_000) for _ in range(7)], "max_tokens": 2,
                             "temperature": 0})
    assert cached["choices"][0]["logprobs"] is None  # not asked
    cases = [long_text, [rng.randrange(200, 100_000) for _ in range(150)],
             shared + [rng.randrange(200, 100_000) for _ in range(9)]]
    for prompt in cases:
        ids = grpc_client.tokenize(prompt) if isinstance(prompt, str) else prompt
        assert isinstance(prompt, list) or len(ids) > STEP_TOKENS
        out = _post(gateway, {"prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 2, "temperature": 0})
        (choice,) = out["choices"]
        generated: list[int] = []
        for _ in range(2):  # greedy, after the prompt
            generated.append(int(_log_softmax(hf, ids + generated)[-1].argmax()))
        full = ids + generated
        _check_logprobs(choice["logprobs"], full, _log_softmax(hf, full), renderer, 3)
        echoed = prompt if isinstance(prompt, str) else renderer.decode(prompt)
        assert choice["text"] == echoed + renderer.decode(generated)
        assert choice["finish_reason"] == "length"
        assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 2
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_for("all blocks free", lambda: _all_free(grpc_client))


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(gateway, grpc_client, hf, renderer):
    """max_tokens 0 with echo: the prompt alone with its logprobs (a prompt-scoring request), finish_reason
    "length", no completion tokens, n choices alike, and every KV block back; without logprobs the prompt alone;
    a one-token prompt is its token with a null logprob. Without echo, max_tokens 0 is refused naming it."""
    rng = random.Random(5)
    text = _text(rng, 40)
    ids = grpc_client.tokenize(text)
    out = _post(gateway, {"prompt": text, "echo": True, "logprobs": 2, "max_tokens": 0, "n": 2})
    ref = _log_softmax(hf, ids)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice in out["choices"]:
        assert choice["text"] == text and choice["finish_reason"] == "length"
        _check_logprobs(choice["logprobs"], ids, ref, renderer, 2)
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)

    plain = _post(gateway, {"prompt": [text, "river"], "echo": True, "max_tokens": 0})
    assert [c["text"] for c in plain["choices"]] == [text, "river"]
    assert all(c["logprobs"] is None and c["finish_reason"] == "length" for c in plain["choices"])

    (one,) = _post(gateway, {"prompt": [ids[0]], "echo": True, "logprobs": 1, "max_tokens": 0})["choices"]
    assert one["text"] == renderer.decode([ids[0]])
    assert one["logprobs"] == {"tokens": [renderer.render(ids[0])[0]], "token_logprobs": [None],
                               "top_logprobs": [None], "text_offset": [0]}

    r = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": text, "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    wait_for("all blocks free", lambda: _all_free(grpc_client))


def test_grpc_max_tokens_zero_needs_prompt_logprobs(grpc_client, hf):
    """The scheduler takes max_tokens 0 only for scoring a prompt (prompt_logprobs set): one message with the
    prompt logprobs and its token ids, no tokens, finish "length", usage 0 completion tokens; otherwise
    INVALID_ARGUMENT naming stopping.max_tokens."""
    ids = [random.Random(8).randrange(200, 100_000) for _ in range(90)]
    deltas = list(grpc_client.generate(token_ids=ids, max_tokens=0, prompt_logprobs=0))
    assert len(deltas) == 1
    (d,) = deltas
    assert d.token_ids == [] and d.text == "" and d.finish_reason == "length"
    assert d.prompt_token_ids == ids and len(d.prompt_logprobs) == len(ids) - 1
    ref = _log_softmax(hf, ids)
    assert max(abs(lp - ref[p, ids[p + 1]].item()) for p, (lp, _) in enumerate(d.prompt_logprobs)) < TOL
    assert d.usage.completion_tokens == 0 and d.usage.prompt_tokens == len(ids)
    (c,) = grpc_client.complete(token_ids=ids, max_tokens=3, temperature=0, prompt_logprobs=1)
    assert c.prompt_token_ids == ids and len(c.token_ids) == 3
    # A request that ends at its first token keeps its last chunk's logprobs (they come in that token's result).
    (c,) = grpc_client.complete(token_ids=ids[:20], max_tokens=1, temperature=0, prompt_logprobs=0)
    assert len(c.prompt_logprobs) == 19 and len(c.token_ids) == 1
    with pytest.raises(grpc.RpcError) as e:
        grpc_client.complete(token_ids=ids, max_tokens=0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stopping.max_tokens" in e.value.details()
    wait_for("all blocks free", lambda: _all_free(grpc_client))


def test_streamed_echo_logprobs_start_with_the_prompt(gateway, grpc_client):
    """Streamed, the first chunk of each choice carries the prompt and its logprobs (with its first token); the
    chunks add up to the whole answer. max_tokens 0 streams one chunk, the prompt, finished."""
    rng = random.Random(3)
    text = _text(rng, 100)
    body = {"prompt": text, "echo": True, "logprobs": 2, "max_tokens": 4, "temperature": 0}
    (whole,) = _post(gateway, body)["choices"]
    n_prompt = len(grpc_client.tokenize(text))
    chunks = [c["choices"][0] for c in _events(gateway, body)]
    assert chunks[0]["text"].startswith(text)
    assert len(chunks[0]["logprobs"]["tokens"]) == n_prompt + 1
    assert "".join(c["text"] for c in chunks) == whole["text"]
    joined = {k: [v for c in chunks if c["logprobs"] for v in c["logprobs"][k]] for k in whole["logprobs"]}
    assert joined["tokens"] == whole["logprobs"]["tokens"]
    assert joined["text_offset"] == whole["logprobs"]["text_offset"]
    assert joined["token_logprobs"][0] is None and joined["top_logprobs"][0] is None
    assert joined["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=TOL)
    assert chunks[-1]["finish_reason"] == "length"

    (only,) = [c["choices"][0] for c in _events(gateway, {**body, "max_tokens": 0})]
    assert only["text"] == text and only["finish_reason"] == "length"
    assert only["logprobs"]["tokens"] == whole["logprobs"]["tokens"][:n_prompt]
    assert only["logprobs"]["token_logprobs"][1:] == pytest.approx(
        whole["logprobs"]["token_logprobs"][1:n_prompt], abs=TOL)
    wait_for("all blocks free", lambda: _all_free(grpc_client))


def test_echo_token_ids_needs_a_tokenizer():
    """A token-id prompt is echoed as its decoded text: a gateway without --tokenizer refuses it (400, echo)."""
    with pytest.raises(APIError) as e:
        completion_job(CompletionRequest(prompt=[1, 2, 3], echo=True, logprobs=1), TokenRenderer(None))
    assert e.value.status == 400 and e.value.param == "echo"
    job = completion_job(CompletionRequest(prompt="hi", echo=True, logprobs=2, max_tokens=0), TokenRenderer(None))
    assert job.params["prompt_logprobs"] == 2 and job.params["max_tokens"] == 0
    assert completion_job(CompletionRequest(prompt="hi", logprobs=2), None).params["prompt_logprobs"] is None


def test_priority_follows_vllm_lower_is_served_earlier():
    """vLLM's priority field serves lower values earlier; the gRPC field (the scheduler's) serves larger ones
    earlier, so the gateway sends the negation."""
    for given, sent in ((-7, 7), (0, 0), (3, -3), (None, 0)):
        assert completion_job(CompletionRequest(prompt="hi", priority=given), None).params["priority"] == sent


# ---- lm-evaluation-harness ------------------------------------------------------------------------------


TASK_YAML = """\
task: splitserve_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
QUESTIONS = [
    ("What colour is the sky on a clear day?", ["blue", "green", "red"], 0),
    ("How many legs does a cat have?", ["two", "four", "six"], 1),
    ("Which is a fruit?", ["carrot", "potato", "apple"], 2),
    ("What do bees make?", ["honey", "milk", "silk"], 0),
    ("Which animal barks?", ["cow", "dog", "fish"], 1),
]


def _lm_eval(gateway, tiny_model_dir, tmp_path, tasks: dict[str, str], tokenized: bool, batch_size: int
             ) -> tuple[dict, dict[str, list[dict]]]:
    """Runs lm-eval's local-completions on `tasks` (name -> YAML; the QUESTIONS as JSON lines in tmp_path, offline),
    in one process; returns its results and each task's logged samples."""
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    folder = tmp_path / "tasks"
    folder.mkdir()
    for task, task_yaml in tasks.items():
        (folder / f"{task}.yaml").write_text(task_yaml.format(data=data))
    model_args = ",".join([
        f"model={MODEL}", f"base_url={gateway.url}/v1/completions", f"tokenizer={tiny_model_dir}",
        "tokenizer_backend=huggingface", f"tokenized_requests={tokenized}", "num_concurrent=2", "max_retries=1",
        "timeout=60"])
    out = tmp_path / "results"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
         "--tasks", ",".join(tasks), "--include_path", str(folder), "--output_path", str(out),
         "--batch_size", str(batch_size), "--log_samples"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=LM_EVAL_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (results_file,) = out.rglob("results_*.json")
    samples = {}
    for task in tasks:
        (samples_file,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in samples_file.read_text().splitlines()]
    return json.loads(results_file.read_text()), samples


def _check_loglikelihoods(results: dict, samples: list[dict], hf, tiny_model_dir) -> None:
    """The multiple-choice task's accuracy in [0, 1], from loglikelihoods equal to transformers' on the same
    checkpoint: each choice's, as the harness summed it from the echoed logprobs."""
    assert 0.0 <= results["results"]["splitserve_local_mc"]["acc,none"] <= 1.0
    assert results["n-samples"]["splitserve_local_mc"]["effective"] == len(QUESTIONS)
    assert len(samples) == len(QUESTIONS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    for sample in samples:
        for i, (ll, greedy) in enumerate(sample["filtered_resps"]):
            args = sample["arguments"][f"gen_args_{i}"]
            context, whole = tokenizer.encode(args["arg_0"]), tokenizer.encode(args["arg_0"] + args["arg_1"])
            assert whole[:len(context)] == context
            ref = _log_softmax(hf, whole)
            want = sum(ref[p - 1, whole[p]].item() for p in range(len(context), len(whole)))
            assert abs(float(ll) - want) < 1e-3
            assert (greedy == "True") == all(int(ref[p - 1].argmax()) == whole[p]
                                             for p in range(len(context), len(whole)))


def test_lm_eval_local_completions_scores_a_local_task(gateway, hf, tiny_model_dir, tmp_path):
    """lm-evaluation-harness's `local-completions` model (echo + logprobs, max_tokens 1) on a 5-question
    multiple-choice task written here (no download), with token-id prompts (its default); text prompts: below."""
    # 4 prompts a request: the gateway scores each
    results, samples = _lm_eval(gateway, tiny_model_dir, tmp_path, {"splitserve_local_mc": TASK_YAML}, True, 4)
    _check_loglikelihoods(results, samples["splitserve_local_mc"], hf, tiny_model_dir)


GEN_TASK_YAML = """\
task: splitserve_local_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def test_lm_eval_local_completions_scores_and_generates_with_text_prompts(gateway, hf, tiny_model_dir, tmp_path):
    """In one run of the harness with text prompts: the multiple-choice task as above, and its `generate_until` path
    (greedy text with a stop string, max_tokens) on a local task: an exact_match in [0, 1], and each answer
    transformers' greedy continuation, cut at the stop."""
    results, samples = _lm_eval(gateway, tiny_model_dir, tmp_path, {"splitserve_local_mc": TASK_YAML,
                                                                    "splitserve_local_gen": GEN_TASK_YAML}, False, 4)
    _check_loglikelihoods(results, samples["splitserve_local_mc"], hf, tiny_model_dir)
    samples = samples["splitserve_local_gen"]
    assert 0.0 <= results["results"]["splitserve_local_gen"]["exact_match,none"] <= 1.0
    assert len(samples) == len(QUESTIONS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    for sample in samples:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            greedy = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6, min_new_tokens=6,
                                 pad_token_id=0)[0, len(ids):].tolist()
        eos = set(eos_token_ids(tiny_model_dir))
        greedy = greedy[:next((i for i, t in enumerate(greedy) if t in eos), len(greedy))]
        want = tokenizer.decode(greedy, skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == want, (prompt, sample["resps"], want)


def test_vllm_token_ids_and_prompt_logprobs(gateway, grpc_client, hf, renderer):
    """vLLM's answer fields: `return_token_ids` (the prompt's ids and each choice's tokens beside the text; streamed,
    the prompt's in the first chunk and each chunk's own tokens), `prompt_logprobs` (null, then each prompt token's
    logprob and its top n by token id, ranked, equal to transformers' log-softmax; streamed, in the first chunk),
    `return_tokens_as_token_ids` and stream_options.continuous_usage_stats (every chunk, its choice's usage so far).
    Over gRPC, return_prompt_token_ids gives the prompt's ids without scoring it (its cached prefix is used)."""
    rng = random.Random(17)
    text = _text(rng, 30)
    ids = grpc_client.tokenize(text)
    ref = _log_softmax(hf, ids)
    generated: list[int] = []
    for _ in range(3):
        generated.append(int(_log_softmax(hf, ids + generated)[-1].argmax()))
    body = {"prompt": text, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    (choice,) = _post(gateway, {**body, "prompt_logprobs": 2})["choices"]
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == generated
    assert choice["text"] == renderer.decode(generated)
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for p in range(1, len(ids)):
        row = ref[p - 1]
        assert scored[p][str(ids[p])]["logprob"] == pytest.approx(row[ids[p]].item(), abs=TOL)
        top = [int(t) for t, e in scored[p].items() if e["rank"] is not None]
        assert top == row.topk(2).indices.tolist()
        assert [scored[p][str(t)]["rank"] for t in top] == [1, 2]
        assert all(e["decoded_token"] == renderer.render(int(t))[0] for t, e in scored[p].items())
    chunks = [c["choices"][0] for c in _events(gateway, {**body, "prompt_logprobs": 2})]
    assert chunks[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == generated
    assert [list(e or ()) for e in chunks[0]["prompt_logprobs"]] == [list(e or ()) for e in scored]
    # vLLM's continuous_usage_stats: every chunk has its choice's usage so far, the last the whole
    options = {"include_usage": True, "continuous_usage_stats": True}
    *events, last = _events(gateway, {**body, "stream_options": options})
    so_far = list(itertools.accumulate(len(e["choices"][0]["token_ids"]) for e in events))
    assert [e["usage"] for e in events] == [{"prompt_tokens": len(ids), "completion_tokens": k,
                                              "total_tokens": len(ids) + k} for k in so_far]
    assert so_far[-1] == 3 and last["choices"] == [] and last["usage"]["completion_tokens"] == 3

    messages = [{"role": "user", "content": text}]
    chat_ids = grpc_client.tokenize(messages=messages)
    chat = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0, "return_token_ids": True,
            "logprobs": True, "return_tokens_as_token_ids": True}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json={**chat, "prompt_logprobs": 0}, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    (c,) = answer["choices"]
    assert answer["prompt_token_ids"] == chat_ids and len(c["token_ids"]) == 3
    assert [e["token"] for e in c["logprobs"]["content"]] == [f"token_id:{t}" for t in c["token_ids"]]
    assert [list(e) for e in answer["prompt_logprobs"][1:]] == [[str(t)] for t in chat_ids[1:]]
    assert answer["prompt_logprobs"][1][str(chat_ids[1])]["decoded_token"] == f"token_id:{chat_ids[1]}"
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json={**chat, "stream": True, "prompt_logprobs": 0},
                      timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == chat_ids
    assert events[0]["prompt_logprobs"] == answer["prompt_logprobs"]
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", timeout=60,
                      json={**chat, "stream": True, "stream_options": options}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[0]["usage"] == {"prompt_tokens": len(chat_ids), "completion_tokens": 0,
                                  "total_tokens": len(chat_ids)}
    assert all(e["usage"]["prompt_tokens"] == len(chat_ids) for e in events) and events[-1]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == events[-1]["usage"]["completion_tokens"] == 3
    assert [t for e in events for ch in e["choices"] for t in ch.get("token_ids", [])] == c["token_ids"]

    r = httpx.post(f"{gateway.url}/v1/completions", json={**body, "prompt_logprobs": 1, "echo": True, "logprobs": 1},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text

    grpc_client.complete(token_ids=ids, max_tokens=1)  # its prefix cached
    (again,) = grpc_client.complete(token_ids=ids, max_tokens=1, return_prompt_token_ids=True)
    assert again.prompt_token_ids == ids and again.prompt_logprobs is None
    assert again.usage.cached_prompt_tokens > 0
    wait_for("all blocks free", lambda: _all_free(grpc_client))
