"""Issue 47 through a real tritonserver: pooling models behind the `llm` backend
(vllm_backend's `embedding_request`) and the `prompt_logprobs` output. One server of its
own holds a tiny random BERT embedder, a tiny cross-encoder and a tiny float32 Llama
generator (the generator here rather than the session server's `llm`: one server start
for the whole file, with a small MAX_PROMPT_LOGPROBS_ENTRIES to test the cap). Every
served value is compared with the offline engine's (`engine.LLM`) on the same folder."""
from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from backend.repository_layout import set_parameters
from tests.e2e.shared import TINY_ENGINE_ARGS, running_server
from tests.e2e.triton_clients import infer_one, llm_inputs, metric, scrape_metrics
from testing.encoder_folders import make_encoder_dir

pytestmark = pytest.mark.slow

CONFIG = 'backend: "tle"\ninstance_group [ { count: 1 kind: KIND_MODEL } ]\n'
POOLING_ARGS = {"runner": "pooling", "dtype": "float32", "max_model_len": 64,
                "max_num_seqs": 8, "max_num_batched_tokens": 256}
TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world",
         "paris is the capital of france"]
QUERY, DOC = "what is the capital of france ?", "paris is the capital of france"
# prompt tokens x (k + 1) above this is refused; the prompts compared below stay under it.
MAX_ENTRIES = 200


def _model(repo, name, model_json, params=None):
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(set_parameters(CONFIG, params or {}))
    (repo / name / "1" / "model.json").write_text(json.dumps(model_json))


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_dir):
    return {"embedder": make_encoder_dir(tmp_path_factory.mktemp("bert"), "BertModel", seed=1),
            "reranker": make_encoder_dir(tmp_path_factory.mktemp("ce"),
                                         "BertForSequenceClassification", seed=7, num_labels=1),
            "generator": tiny_model_dir}


@pytest.fixture(scope="module")
def server(tmp_path_factory, folders):
    work = tmp_path_factory.mktemp("triton-pooling")
    repo = work / "models"
    _model(repo, "embedder", {"model": str(folders["embedder"]), **POOLING_ARGS},
           {"REPORT_CUSTOM_METRICS": "true"})
    # `task` (vLLM <= 0.12's name) reaches the engine from model.json too.
    _model(repo, "reranker", {"model": str(folders["reranker"]), "task": "score",
                              **{k: v for k, v in POOLING_ARGS.items() if k != "runner"}})
    _model(repo, "generator", {"model": str(folders["generator"])},
           {**TINY_ENGINE_ARGS, "MAX_PROMPT_LOGPROBS_ENTRIES": str(MAX_ENTRIES)})
    with running_server(repo, work, load=["embedder", "reranker", "generator"],
                        timeout=300) as handle:
        yield handle


@pytest.fixture(scope="module")
def url(server):
    return server.grpc_url


@pytest.fixture(scope="module")
def offline(folders):
    from engine import LLM

    engines = {}

    def get(name):
        if name not in engines:
            args = ({k: v for k, v in TINY_ENGINE_ARGS.items()} if name == "generator"
                    else POOLING_ARGS)
            engines[name] = LLM(str(folders[name]), **args)
        return engines[name]
    return get


def embedding_request(body, **flags) -> dict[str, np.ndarray]:
    text = body if isinstance(body, str) else json.dumps(body)
    tensors = {"embedding_request": np.array([text.encode()], dtype=np.object_)}
    for name, value in flags.items():
        tensors[name] = np.array([value], dtype=np.bool_)
    return tensors


def vector(outcome) -> list[float]:
    assert outcome.error is None, outcome.error
    (response,) = outcome.responses
    return json.loads(response["text_output"][0])


def assert_same_vector(got, want):
    got, want = np.array(got), np.array(want)
    cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert cosine >= 0.9999 and np.allclose(got, want, atol=1e-5), (cosine, got[:4], want[:4])


def test_embeddings_equal_the_offline_engines(url, offline):
    llm = offline("embedder")
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(TEXTS[0])
    wanted = [o.outputs.embedding for o in llm.embed([*TEXTS, ids])]
    requests_ = [embedding_request({"input": t}, return_num_input_tokens=True,
                                   return_num_output_tokens=True) for t in TEXTS]
    requests_.append(embedding_request({"input": ids}))
    with ThreadPoolExecutor(len(requests_)) as pool:  # batched together in the engine
        outcomes = list(pool.map(lambda r: infer_one(url, "embedder", r), requests_))
    for outcome, want in zip(outcomes, wanted):
        assert_same_vector(vector(outcome), want)
    for outcome, text in zip(outcomes, TEXTS):
        response = outcome.responses[0]
        assert response["num_input_tokens"].tolist() == [len(tokenizer.encode(text))]
        assert response["num_output_tokens"].tolist() == [0]
    assert "num_input_tokens" not in outcomes[-1].responses[0]
    # Options reach the engine: unnormalised and truncated vectors as the offline ones.
    from engine import PoolingParams

    options = {"use_activation": False, "truncate_prompt_tokens": 4}
    (want,) = llm.embed(TEXTS[0], PoolingParams(**options))
    got = vector(infer_one(url, "embedder", embedding_request(
        {"input": TEXTS[0], "pooling_params": options}, return_num_input_tokens=True)))
    assert_same_vector(got, want.outputs.embedding)
    assert not math.isclose(float(np.linalg.norm(got)), 1.0, abs_tol=1e-3)


def test_a_cross_encoder_scores_a_pair_as_the_offline_engine(url, offline):
    (want,) = offline("reranker").score(QUERY, DOC)
    got = vector(infer_one(url, "reranker", embedding_request({"input": [QUERY, DOC]})))
    assert len(got) == 1 and math.isclose(got[0], want.outputs.score, abs_tol=1e-5)


@pytest.mark.parametrize("model, tensors, fragments", [
    ("embedder", embedding_request({"input": "hi", "pooling_params": {"dimensions": [8]}}),
     ["dimensions", "Matryoshka"]),
    ("embedder", llm_inputs("hi"), ["runner='pooling'", "embedding_request"]),
    ("generator", embedding_request({"input": "hi"}), ["embedding_request", "runner='generate'"]),
    ("embedder", embedding_request("{not json"), ["embedding_request is not valid JSON"]),
    ("embedder", embedding_request({"input": ""}), ["embedding_request.input is empty"]),
    ("embedder", embedding_request({"input": [1, 10**6]}), ["embedding_request.input", "vocabulary"]),
    ("embedder", embedding_request({"input": [QUERY, DOC]}), ["text pairs", "embed"]),
    ("embedder", embedding_request({"input": "hi", "pooling_params": {"max_tokens": 4}}),
     ["max_tokens"]),
    ("embedder", embedding_request({"input": " ".join(["hello"] * 100)}), ["max_model_len"]),
])
def test_bad_requests_are_refused_alone_naming_the_field(url, model, tensors, fragments, offline):
    good = embedding_request({"input": TEXTS[1]})
    with ThreadPoolExecutor(2) as pool:
        bad_future = pool.submit(infer_one, url, model, tensors)
        good_future = pool.submit(infer_one, url, "embedder", good)
    bad = bad_future.result()
    assert bad.error is not None, bad.error
    assert all(f in bad.error for f in fragments), bad.error
    (want,) = offline("embedder").embed(TEXTS[1])
    assert_same_vector(vector(good_future.result()), want.outputs.embedding)


def _prompt_logprobs(text: bytes) -> list:
    return [None if p is None else {int(t): v for t, v in p.items()} for p in json.loads(text)]


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_equal_the_offline_engines(url, offline, stream):
    from engine import SamplingParams

    llm = offline("generator")
    prompt, k = "The capital of France is", 3
    (want,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=k))
    tokenizer = llm.get_tokenizer()
    outcome = infer_one(url, "generator", llm_inputs(
        prompt, {"temperature": 0, "max_tokens": 4, "prompt_logprobs": k, "n": 2}, stream=stream,
        exclude_input_in_output=True))
    assert outcome.error is None, outcome.error
    carrying = [r for r in outcome.responses if "prompt_logprobs" in r]
    assert len(carrying) == 1 and carrying[0] is outcome.responses[0]
    first, second = (_prompt_logprobs(t) for t in carrying[0]["prompt_logprobs"])
    assert first == second  # n=2: the shared prompt's, in each sequence's entry
    assert len(first) == len(want.prompt_token_ids) and first[0] is None
    for position, (got, expected) in enumerate(zip(first[1:], want.prompt_logprobs[1:]), 1):
        assert list(got) == list(expected), position  # the prompt token first, then the top k
        assert next(iter(got)) == want.prompt_token_ids[position]
        for token_id, entry in got.items():
            assert entry["rank"] == expected[token_id].rank
            assert math.isclose(entry["logprob"], expected[token_id].logprob, abs_tol=1e-4)
            assert entry["decoded_token"] == tokenizer.decode([token_id])
    plain = infer_one(url, "generator", llm_inputs(prompt, {"max_tokens": 2}))
    assert plain.error is None and all("prompt_logprobs" not in r for r in plain.responses)


def test_prompt_logprobs_over_the_cap_are_refused_naming_them(url):
    outcome = infer_one(url, "generator", llm_inputs(
        " ".join(["word"] * 60), {"max_tokens": 1, "prompt_logprobs": 5}))
    assert outcome.error is not None, outcome.error
    assert "prompt_logprobs" in outcome.error and "MAX_PROMPT_LOGPROBS_ENTRIES" in outcome.error


def test_pooling_requests_count_prompt_tokens_and_no_generation(server, offline):
    url = server.grpc_url
    tokenizer = offline("embedder").get_tokenizer()
    before = scrape_metrics(server.metrics_url)

    def value(values, name):
        return metric(values, name, "embedder")
    for text in TEXTS:
        vector(infer_one(url, "embedder", embedding_request({"input": text})))
    after = scrape_metrics(server.metrics_url)
    prompt = sum(len(tokenizer.encode(text)) for text in TEXTS)
    assert value(after, "vllm:prompt_tokens_total") - value(before, "vllm:prompt_tokens_total") == prompt
    assert value(after, "vllm:generation_tokens_total") == 0
    success = 'vllm:request_success_total'
    stops = {k: v for k, v in after.items() if k.startswith(success) and 'model="embedder"' in k
             and 'finished_reason="stop"' in k}
    assert sum(stops.values()) >= len(TEXTS), stops


def test_http_generate_serves_embedding_requests_and_refuses_bad_ones_with_400(server, offline):
    import requests

    endpoint = f"http://{server.http_url}/v2/models/embedder/generate"
    reply = requests.post(endpoint, json={"embedding_request": json.dumps({"input": TEXTS[1]})},
                          timeout=60)
    assert reply.status_code == 200, reply.text
    (want,) = offline("embedder").embed(TEXTS[1])
    assert_same_vector(json.loads(reply.json()["text_output"]), want.outputs.embedding)
    reply = requests.post(endpoint, json={"embedding_request": json.dumps({"input": ""})},
                          timeout=60)
    assert reply.status_code == 400 and "embedding_request.input is empty" in reply.text, reply.text
    reply = requests.post(f"http://{server.http_url}/v2/models/embedder/generate",
                          json={"text_input": "hello", "parameters": {"max_tokens": 2}}, timeout=60)
    assert reply.status_code == 400 and "runner='pooling'" in reply.text, reply.text
