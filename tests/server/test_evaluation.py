"""Evaluation through `jlora serve`, against truths the server did not compute: PEFT's own logits (the committed
fixtures of tests/fixtures/peft/llama, given a word-level tokenizer so that text maps to the fixtures' ids),
the same requests run one by one, and lm-evaluation-harness as the client. Log-probabilities of echoed
prompts, of greedy continuations and of scoring requests; n, best_of and streaming; vLLM's tokenizer routes."""

import json
import os
import shutil

import numpy as np
import pytest

for _module in ("uvicorn", "starlette", "prometheus_client", "jinja2"):
    pytest.importorskip(_module)
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from jlora import testing  # noqa: E402
from jlora.sampling import sample_seeds  # noqa: E402
from tests.server.launch import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.xdist_group("evaluation")
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "peft", "llama")
ADAPTERS = ["plain", "dora", "bias", "added"]  # "added": 3 tokens past the vocabulary, which have no text
WORDS = ["<unk>", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "system", "user", "assistant"]


def word(token: int) -> str:
    """The text of a token of `testing.write_tokenizer`'s vocabulary."""
    return WORDS[token] if token < len(WORDS) else f"w{token}"


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def fixture():
    with open(os.path.join(FIXTURE, "expected.json")) as f:
        return json.load(f), np.load(os.path.join(FIXTURE, "expected.npz"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tmp_path_factory.mktemp("eval") / "model"
    shutil.copytree(os.path.join(FIXTURE, "model"), model)
    testing.write_tokenizer(str(model), 83)
    loras = [a for name in ADAPTERS for a in ("--lora", f"{name}={os.path.join(FIXTURE, name)}")]
    proc, url = start_server(str(model), "--max-seq-len", "64", *loras, "--max-loras", "4", "--max-lora-rank", "16",
                             "--max-batch", "8", "--max-extra-vocab", "8", "--served-model-name", "base")
    yield url
    stop_server(proc)


def post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_echoed_prompts_and_greedy_continuations_match_peft(server, fixture):
    """One request per adapter holds all its prompts (a batch); echo + logprobs + max_tokens 6 gives every prompt
    token's log-probability (the first's null) and the greedy tokens', against log_softmax of PEFT's logits."""
    cases, arrays = fixture
    for name in ["base", *ADAPTERS]:
        prompts = cases[name]["prompts"]
        body = post(server, "/v1/completions", {"model": name, "prompt": prompts, "echo": True, "logprobs": 3,
                                                "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert [c["index"] for c in body["choices"]] == list(range(len(prompts)))
        for i, (prompt, choice) in enumerate(zip(prompts, body["choices"])):
            greedy = cases[name]["greedy"][i]
            assert choice["token_ids"] == greedy, (name, i)
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(prompt) + 6 and lp["token_logprobs"][0] is None
            want = [log_softmax(arrays[f"{name}/{i}"])[j - 1, t] for j, t in enumerate(prompt) if j]
            want += list(log_softmax(arrays[f"{name}/{i}/greedy"])[np.arange(6), greedy])
            np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=1e-4, err_msg=f"{name}/{i}")
            assert lp["tokens"][:len(prompt)] == [word(t) if t < 83 else f"token_id:{t}" for t in prompt]
            assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
            assert all(len(top) == 3 for top in lp["top_logprobs"][1:])
            assert choice["text"].startswith(" ".join(word(t) for t in prompt if t < 83))


def test_scoring_requests_through_the_openai_client(server, fixture):
    """max_tokens 0 with echo: nothing generated, usage counts only the prompt; the official client parses it."""
    cases, arrays = fixture
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    prompt = cases["dora"]["prompts"][0]
    out = client.completions.create(model="dora", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == []
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(prompt)
    want = [log_softmax(arrays["dora/0"])[j - 1, t] for j, t in enumerate(prompt) if j]
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], want, atol=1e-4)
    assert choice.finish_reason == "length"
    both = post(server, "/v1/completions", {"model": "dora", "prompt": prompt, "echo": True, "logprobs": 1,
                                            "max_tokens": 0, "n": 2})  # the second a fork of the first
    assert [c["logprobs"] for c in both["choices"]] == [both["choices"][0]["logprobs"]] * 2
    np.testing.assert_allclose(both["choices"][0]["logprobs"]["token_logprobs"][1:], want, atol=1e-4)


def test_streamed_logprobs_are_the_whole_answers(server):
    """Streamed chunks (completions with echo, chat) carry the same tokens and log-probabilities as the answer
    in one piece; every choice of n streams."""
    body = {"model": "plain", "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0.9, "seed": 4,
            "logprobs": 2, "echo": True, "n": 2}
    whole = post(server, "/v1/completions", body)
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    for choice in whole["choices"]:
        chunks = [c for e in events for c in e["choices"] if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in chunks) == choice["text"]
        streamed = {k: [v for c in chunks if c["logprobs"] for v in c["logprobs"][k]] for k in choice["logprobs"]}
        assert streamed == choice["logprobs"]
        assert chunks[-1]["finish_reason"] == choice["finish_reason"]
    chat = {"model": "bias", "messages": [{"role": "user", "content": "the lazy dog"}], "max_tokens": 6,
            "logprobs": True, "top_logprobs": 2, "seed": 1, "n": 2}
    whole = post(server, "/v1/chat/completions", chat)
    with httpx.stream("POST", server + "/v1/chat/completions", json={**chat, "stream": True}, timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    for choice in whole["choices"]:
        chunks = [c for e in events for c in e["choices"] if c["index"] == choice["index"]]
        streamed = [t for c in chunks if c.get("logprobs") for t in c["logprobs"]["content"]]
        assert streamed == choice["logprobs"]["content"] and len(streamed) >= len(choice["token_ids"])
        assert all(len(t["top_logprobs"]) == 2 and t["bytes"] == list(t["token"].encode()) for t in streamed)


def test_n_and_best_of_are_the_seeded_samples(server):
    """Choice j of n is the request alone with seed `sample_seeds(seed, n)[j]`; best_of keeps the samples of
    highest log-probability."""
    body = {"model": "dora", "prompt": [[5, 6, 7], [9, 10]], "max_tokens": 5, "temperature": 1.0, "seed": 21,
            "ignore_eos": True}
    out = post(server, "/v1/completions", {**body, "n": 3, "logprobs": 0})
    assert [c["index"] for c in out["choices"]] == list(range(6))
    for i, prompt in enumerate(body["prompt"]):
        for j, seed in enumerate(sample_seeds(21, 3)):
            alone = post(server, "/v1/completions", {**body, "prompt": prompt, "seed": seed})
            assert out["choices"][3 * i + j]["token_ids"] == alone["choices"][0]["token_ids"], (i, j)
    best = post(server, "/v1/completions", {**body, "best_of": 3, "logprobs": 0})
    for i in range(2):
        samples = out["choices"][3 * i: 3 * i + 3]
        top = max(samples, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
        assert best["choices"][i]["token_ids"] == top["token_ids"]
    assert best["usage"]["completion_tokens"] == out["usage"]["completion_tokens"] == 30


def test_tokenizer_routes(server):
    info = httpx.get(server + "/tokenizer_info").json()
    assert info["model_max_length"] == 64 and info["unk_token"] == "<unk>" and "chat_template" in info
    ids = post(server, "/tokenize", {"prompt": "the lazy w40"})
    assert ids["tokens"] == [1, 7, 40] and ids["count"] == 3
    assert post(server, "/detokenize", {"tokens": [1, 7, 40]})["prompt"] == "the lazy w40"
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "the dog"}]})["tokens"]
    assert chat == [10, 1, 8, 11]  # the template: "user the dog assistant"
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "the dog"}],
                                      "add_generation_prompt": False})["tokens"]
    assert chat == [10, 1, 8]
    for path, body, match in [("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
                               "either 'prompt' or 'messages'"),
                              ("/detokenize", {"tokens": [1, 500]}, "outside the tokenizer's"),
                              ("/detokenize", {"tokens": [1, -1]}, "outside the tokenizer's"),
                              ("/detokenize", {"tokens": [1, "a"]}, "invalid 'tokens.1'")]:
        response = httpx.post(server + path, json=body)
        assert response.status_code == 400 and match in response.json()["error"]["message"], response.text


@pytest.mark.slow
def test_lm_eval_scores_a_multiple_choice_task_as_peft_does(server, fixture, tmp_path, monkeypatch):
    """lm-evaluation-harness's `local-completions` model, with the server's tokenizer routes, runs a
    multiple-choice task from a local JSON file under the base model and two adapters: each choice's
    loglikelihood is log_softmax of PEFT's logits (the task's contexts are prefixes of the fixture prompts, its
    choices single tokens), and the accuracy is what those give."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    lm_eval = pytest.importorskip("lm_eval")
    cases, arrays = fixture
    rng = np.random.default_rng(0)
    for name in ["base", "plain", "dora"]:
        docs, truth = [], []
        for i, prompt in enumerate(cases[name]["prompts"]):
            lp = log_softmax(arrays[f"{name}/{i}"])
            for k in range(1, len(prompt)):
                if 0 in prompt[:k + 1]:  # "<unk>" does not tokenize back to id 0
                    continue
                others = [int(t) for t in rng.choice(np.arange(1, 83), 6, replace=False) if t != prompt[k]][:3]
                choices = [prompt[k], *others]
                rng.shuffle(choices)
                docs.append({"context": " ".join(word(t) for t in prompt[:k]), "choices": [word(c) for c in choices],
                             "label": choices.index(prompt[k])})
                truth.append([lp[k - 1, c] for c in choices])
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        task = {"task": f"jlora_mc_{name}", "dataset_path": "json",
                "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{context}}",
                "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}]}
        results = lm_eval.simple_evaluate(
            model="local-completions", tasks=[task], log_samples=True,
            model_args={"base_url": server + "/v1/completions", "model": name, "tokenizer_backend": "remote",
                        "tokenized_requests": True, "batch_size": 16, "max_length": 64, "max_retries": 1})
        samples = sorted(results["samples"][f"jlora_mc_{name}"], key=lambda s: s["doc_id"])
        assert len(samples) == len(docs) > 10
        for sample, want in zip(samples, truth):
            got = [resp[0][0] for resp in sample["resps"]]
            np.testing.assert_allclose(got, want, atol=1e-4, err_msg=name)
        accuracy = np.mean([np.argmax(t) == d["label"] for t, d in zip(truth, docs)])
        assert results["results"][f"jlora_mc_{name}"]["acc,none"] == pytest.approx(accuracy)
