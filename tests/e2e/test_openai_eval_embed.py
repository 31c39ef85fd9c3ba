"""Issue 47 through the OpenAI route and a real tritonserver: completions echo with
logprobs (what lm-eval's loglikelihood tasks send) equal to the offline engine's prompt
logprobs, for text and token-id prompts alike; max_tokens 0 with echo; vLLM's
prompt_logprobs; /v1/embeddings, /score and /rerank on served encoders, read by the
official `openai` client where it has a method. The server (a tiny float32 Llama, a tiny
BERT embedder and a tiny cross-encoder) is tests/e2e/test_pooling_triton.py's fixture."""
from __future__ import annotations

import math
from contextlib import ExitStack
from types import SimpleNamespace

import numpy as np
import pytest
import requests

from tests.e2e.test_openai_frontend import openai_client, running_frontend
# The pooling server's fixtures, used as they are (one server for this module; its
# `server` stands in for the session's, which this module does not use).
from tests.e2e.test_pooling_triton import (DOC, QUERY, TEXTS, folders, offline,  # noqa: F401
                                           server, url)

openai = pytest.importorskip("openai", reason="openai is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
K = 2
# float32 on both sides: the served and the offline numbers differ by batching only.
TOL = 1e-4


@pytest.fixture(scope="module")
def routes(url, folders):  # noqa: F811 - the imported fixture
    """One route per served model: {name: base url}."""
    with ExitStack() as stack:
        yield {name: stack.enter_context(running_frontend(
                   SimpleNamespace(grpc=url, metrics="", model_dir=folders[name]),
                   "--model", name, "--served-model-name", name))
               for name in ("generator", "embedder", "reranker")}


@pytest.fixture(scope="module")
def reference(offline):  # noqa: F811
    """The offline engine's prompt ids and prompt logprobs for PROMPT, top K."""
    from engine import SamplingParams

    llm = offline("generator")
    (want,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1,
                                                  prompt_logprobs=K))
    ids = list(want.prompt_token_ids)
    (by_ids,) = llm.generate(ids,
                             SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=K))
    assert [None if p is None else {t: v.logprob for t, v in p.items()}
            for p in by_ids.prompt_logprobs] == \
        [None if p is None else {t: v.logprob for t, v in p.items()} for p in want.prompt_logprobs]
    return SimpleNamespace(ids=ids, logprobs=want.prompt_logprobs, tokenizer=llm.get_tokenizer())


def assert_prompt_logprobs(logprobs, reference):
    n = len(reference.ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.tokens[:n] == [reference.tokenizer.decode([t]) for t in reference.ids]
    for i in range(1, n):
        want = reference.logprobs[i]
        assert math.isclose(logprobs.token_logprobs[i], want[reference.ids[i]].logprob,
                            abs_tol=TOL), i
        top = {reference.tokenizer.decode([t]): v.logprob for t, v in want.items()}
        assert set(logprobs.top_logprobs[i]) == set(top), i
        for token, value in logprobs.top_logprobs[i].items():
            assert math.isclose(value, top[token], abs_tol=TOL), (i, token)
    # text_offset runs over the returned text: each token starts where the text shows it
    offsets = logprobs.text_offset
    assert offsets[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs.tokens))


def test_echo_logprobs_with_max_tokens_0_are_the_offline_prompt_logprobs(routes, reference):
    api = openai_client(routes["generator"])
    by_text = api.completions.create(model="generator", prompt=PROMPT, echo=True, logprobs=K,
                                     max_tokens=0)
    by_ids = api.completions.create(model="generator", prompt=reference.ids, echo=True,
                                    logprobs=K, max_tokens=0)
    for answer in (by_text, by_ids):
        (choice,) = answer.choices
        assert len(choice.logprobs.tokens) == len(reference.ids)  # the prompt alone
        assert_prompt_logprobs(choice.logprobs, reference)
        assert answer.usage.prompt_tokens == len(reference.ids)
    assert by_text.choices[0].text == PROMPT
    assert by_ids.choices[0].text == reference.tokenizer.decode(reference.ids)
    # text and ids: the same numbers
    assert by_text.choices[0].logprobs.token_logprobs == by_ids.choices[0].logprobs.token_logprobs
    # streamed: one chunk with the prompt alone, as the whole answer
    chunks = list(api.completions.create(model="generator", prompt=reference.ids, echo=True,
                                         logprobs=K, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == by_ids.choices[0].text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == \
        by_ids.choices[0].logprobs.tokens


def test_echo_logprobs_put_the_prompts_before_the_completions(routes, reference):
    api = openai_client(routes["generator"])
    plain = api.completions.create(model="generator", prompt=PROMPT, logprobs=K, max_tokens=3,
                                   temperature=0)
    echoed = api.completions.create(model="generator", prompt=PROMPT, logprobs=K, max_tokens=3,
                                    temperature=0, echo=True)
    (choice,) = echoed.choices
    n = len(reference.ids)
    assert choice.text == PROMPT + plain.choices[0].text
    assert_prompt_logprobs(choice.logprobs, reference)
    assert choice.logprobs.tokens[n:] == plain.choices[0].logprobs.tokens
    assert np.allclose(choice.logprobs.token_logprobs[n:], plain.choices[0].logprobs.token_logprobs,
                       atol=TOL)
    # vLLM's whole answer carries the prompt's logprobs on the choice too
    assert len(choice.model_extra["prompt_logprobs"]) == n

    # streamed: the first chunk carries the prompt's; the pieces join to the whole answer
    chunks = list(api.completions.create(model="generator", prompt=PROMPT, logprobs=K,
                                         max_tokens=3, temperature=0, echo=True, stream=True))
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert pieces[0].logprobs.tokens[:n] == choice.logprobs.tokens[:n]
    assert "".join(p.text for p in pieces) == choice.text
    assert [t for p in pieces for t in p.logprobs.tokens] == choice.logprobs.tokens
    assert [o for p in pieces for o in p.logprobs.text_offset] == choice.logprobs.text_offset


def test_prompt_logprobs_in_extra_body_are_returned_as_vllm_returns_them(routes, reference):
    base = routes["generator"]
    answer = requests.post(f"{base}/v1/completions", json={
        "model": "generator", "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": K},
        timeout=120).json()
    (choice,) = answer["choices"]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(reference.ids)
    for i in range(1, len(got)):
        assert [int(t) for t in got[i]] == list(reference.logprobs[i])
        for token, entry in got[i].items():
            assert math.isclose(entry["logprob"], reference.logprobs[i][int(token)].logprob,
                                abs_tol=TOL)
    chat = requests.post(f"{base}/v1/chat/completions", json={
        "model": "generator", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "prompt_logprobs": 1}, timeout=120).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1


def test_embeddings_through_the_openai_client_equal_the_offline_engines(  # noqa: F811
        routes, offline):
    api = openai_client(routes["embedder"])
    llm = offline("embedder")
    ids = llm.get_tokenizer().encode(TEXTS[1])
    wanted = [o.outputs.embedding for o in llm.embed([*TEXTS, ids])]
    # the client asks base64 by default and decodes it itself
    answer = api.embeddings.create(model="embedder", input=TEXTS)
    floats = api.embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
    by_ids = api.embeddings.create(model="embedder", input=[ids])
    got = [d.embedding for d in answer.data] + [by_ids.data[0].embedding]
    for vector, want in zip(got, wanted):
        assert np.allclose(vector, want, atol=1e-5)
    assert [d.index for d in answer.data] == [0, 1, 2]
    assert np.allclose([d.embedding for d in floats.data], got[:3], atol=1e-6)
    tokenizer = llm.get_tokenizer()
    assert answer.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens


def test_the_wrong_kind_of_model_is_a_400_naming_runner(routes):
    with pytest.raises(openai.BadRequestError) as error:
        openai_client(routes["generator"]).embeddings.create(model="generator", input="hi")
    assert "runner" in str(error.value)
    with pytest.raises(openai.BadRequestError) as error:
        openai_client(routes["embedder"]).completions.create(model="embedder", prompt="hi")
    assert "runner" in str(error.value)
    with pytest.raises(openai.BadRequestError) as error:
        openai_client(routes["embedder"]).embeddings.create(model="embedder", input=[])
    assert error.value.body["param"] == "input"


def test_score_and_rerank_of_a_cross_encoder_are_its_own(routes, offline):  # noqa: F811
    base = routes["reranker"]
    documents = [DOC, TEXTS[0], TEXTS[1]]
    want = [o.outputs.score for o in offline("reranker").score(QUERY, documents)]
    scored = requests.post(f"{base}/score", json={"model": "reranker", "text_1": QUERY,
                                                  "text_2": documents}, timeout=120).json()
    assert [d["index"] for d in scored["data"]] == [0, 1, 2]
    assert np.allclose([d["score"] for d in scored["data"]], want, atol=1e-5)
    ranked = requests.post(f"{base}/v1/rerank", json={"model": "reranker", "query": QUERY,
                                                      "documents": documents, "top_n": 2},
                           timeout=120).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert ranked["results"][0]["document"] == {"text": documents[order[0]]}
    assert ranked["usage"]["prompt_tokens"] > 0


def test_score_of_an_embedder_is_the_cosine_of_its_embeddings(routes, offline):  # noqa: F811
    base = routes["embedder"]
    vectors = [np.array(o.outputs.embedding) for o in offline("embedder").embed([QUERY, DOC])]
    a, b = vectors
    want = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    for _ in range(2):  # the second time the route already knows the model's kind
        scored = requests.post(f"{base}/score", json={"text_1": QUERY, "text_2": DOC},
                               timeout=120).json()
        assert math.isclose(scored["data"][0]["score"], want, abs_tol=1e-5)
    ranked = requests.post(f"{base}/v2/rerank", json={"query": QUERY, "documents": [DOC]},
                           timeout=120).json()
    assert math.isclose(ranked["results"][0]["relevance_score"], want, abs_tol=1e-5)
