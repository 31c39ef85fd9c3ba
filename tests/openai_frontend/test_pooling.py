"""/v1/embeddings, /score and /rerank without a server (issue 47): inputs -> `llm`
pooling requests, vectors -> OpenAI / vLLM bodies, and the errors a body gets before
Triton is asked. Against a served encoder: tests/e2e/test_openai_eval_embed.py."""
from __future__ import annotations

import base64
import math

import numpy as np
import pytest

from backend.triton_server import free_port
from openai_frontend.pooling import (cosine, decode_embedding, embedding_body, encode_embedding,
                                     pooling_payload, rerank_body, score_body, score_pairs,
                                     split_inputs)
from tests.openai_frontend.refusals import refused

KEY = "sk-test"


def test_inputs_in_openais_four_forms():
    assert split_inputs("a") == ["a"] and split_inputs(["a", "b"]) == ["a", "b"]
    assert split_inputs([1, 2]) == [[1, 2]] and split_inputs([[1], [2, 3]]) == [[1], [2, 3]]
    for value, fragment in [([], "empty list"), ("", "must not be empty"),
                            (["a", ""], "input[1] must not be empty"), ([[1], []], "not a mix"),
                            ([1, "a"], "not a mix"), ([[1], "a"], "not a mix"),
                            ([1, True], "not a mix"), ([1.0], "not a mix"), ([-1], "not a mix"),
                            (3, "got int"), (None, "got NoneType")]:
        error = refused(lambda: split_inputs(value), "input")
        assert fragment in error.message, (value, error.message)


def test_payload_holds_only_what_the_client_set():
    assert pooling_payload("hi") == {"input": "hi", "pooling_params": {}}
    assert pooling_payload([1, 2], dimensions=8, truncate_prompt_tokens=-1,
                           use_activation=False) == {
        "input": [1, 2], "pooling_params": {"dimensions": 8, "truncate_prompt_tokens": -1,
                                            "use_activation": False}}
    assert pooling_payload(["q", "d"])["input"] == ["q", "d"]  # a cross-encoder's pair


def test_base64_is_little_endian_float32_as_openai_clients_read_it():
    vector = [0.1, -2.5, 3.0e-8, 1234.5]
    text = encode_embedding(vector, "base64")
    # what the openai client does with encoding_format="base64"
    read = np.frombuffer(base64.b64decode(text), dtype="<f4")
    assert np.allclose(read, np.array(vector, dtype=np.float32))
    assert decode_embedding(text) == [float(np.float32(v)) for v in vector]
    assert encode_embedding(vector, "float") is vector


def test_embedding_body_is_openais_shape():
    body = embedding_body("m", [[1.0, 0.0], [0.5, 0.5]], 7, "float")
    assert body["object"] == "list" and body["model"] == "m"
    assert body["data"] == [{"object": "embedding", "index": 0, "embedding": [1.0, 0.0]},
                            {"object": "embedding", "index": 1, "embedding": [0.5, 0.5]}]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}


def test_score_pairs_follow_vllms_1_1_1_n_n_n_rule():
    assert score_pairs("q", "d") == [("q", "d")]
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q"], ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    refused(lambda: score_pairs(["q", "r"], ["a", "b", "c"]), "text_2")
    refused(lambda: score_pairs([], ["a"]), "text_1")
    refused(lambda: score_pairs("q", []), "text_2")
    refused(lambda: score_pairs("q", ["a", ""]), "text_2")
    refused(lambda: score_pairs("q", [], ("query", "documents")), "documents")


def test_cosine_is_torchs():
    torch = pytest.importorskip("torch")
    a, b = [1.0, 2.0, -3.0], [0.5, -1.0, 4.0]
    expected = torch.nn.functional.cosine_similarity(torch.tensor([a]), torch.tensor([b])).item()
    assert math.isclose(cosine(a, b), expected, rel_tol=1e-6)
    assert cosine([0.0, 0.0], [1.0, 0.0]) == 0.0  # no division by zero


def test_score_and_rerank_bodies():
    body = score_body("m", [0.25, 0.75], 10)
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] == 10
    assert body["data"] == [{"index": 0, "object": "score", "score": 0.25},
                            {"index": 1, "object": "score", "score": 0.75}]
    docs, scores = ["a", "b", "c", "d"], [0.1, 0.9, 0.5, 0.9]
    ranked = rerank_body("m", docs, scores, top_n=0, prompt_tokens=4)["results"]
    # highest first; the tie keeps the documents' order
    assert [r["index"] for r in ranked] == [1, 3, 2, 0]
    assert ranked[0] == {"index": 1, "document": {"text": "b"}, "relevance_score": 0.9}
    top = rerank_body("m", docs, scores, top_n=2, prompt_tokens=4)
    assert [r["index"] for r in top["results"]] == [1, 3]
    assert top["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert len(rerank_body("m", docs, scores, top_n=9, prompt_tokens=4)["results"]) == 4


@pytest.fixture(scope="module")
def routes():
    """The app with no Triton behind it: what a body gets before Triton is asked."""
    from fastapi.testclient import TestClient

    from openai_frontend.app import create_app
    from openai_frontend.chat import load_tokenizer
    from openai_frontend.options import FrontendOptions

    app = create_app(f"127.0.0.1:{free_port()}", "llm", "served", load_tokenizer(None),
                     FrontendOptions(api_keys=(KEY,), max_sequences_per_request=3))
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"model": "served", "input": []}, "input"),
    ("/v1/embeddings", {"model": "served", "input": ""}, "input"),
    ("/v1/embeddings", {"model": "served", "input": [1, "a"]}, "input"),
    ("/v1/embeddings", {"model": "served", "input": ["a", "b", "c", "d"]}, "input"),
    ("/v1/embeddings", {"model": "served", "input": "a", "encoding_format": "bytes"},
     "encoding_format"),
    ("/score", {"model": "served", "text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
    ("/rerank", {"model": "served", "query": "q", "documents": []}, "documents"),
    ("/v2/rerank", {"query": "q", "documents": ["a", "b", "c", "d"]}, "documents"),
])
def test_bad_bodies_are_400_naming_the_field(routes, path, body, param):
    response = routes.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_unknown_model_is_404_and_a_good_body_reaches_triton(routes):
    response = routes.post("/v1/embeddings", json={"model": "other", "input": "a"})
    assert response.status_code == 404
    # model left out: the served one (vLLM's rule); Triton is down here, so 503
    for path, body in [("/v1/embeddings", {"input": ["a", "b"]}),
                       ("/score", {"text_1": "a", "text_2": ["b", "c"]}),
                       ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 1})]:
        assert routes.post(path, json=body).status_code == 503, path


@pytest.mark.parametrize("path", ["/v1/embeddings", "/score", "/v1/score", "/rerank",
                                  "/v1/rerank", "/v2/rerank"])
def test_pooling_routes_need_the_api_key(routes, path):
    response = routes.post(path, json={}, headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
