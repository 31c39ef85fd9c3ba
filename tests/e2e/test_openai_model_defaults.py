"""The model's generation_config and --reasoning-parser through a real tritonserver and
`python -m openai_frontend`. A server of its own serving only `llm`, on a tiny model whose
generation_config.json recommends greedy sampling and 7 new tokens (the session server's
model recommends nothing): a request that sets neither gets them, on the `llm` model and
through the route; one that sets them wins. The tiny model never writes </think>, so under
deepseek_r1 (the template opened the reasoning) its whole answer is reasoning_content and
content is null, whole and streamed. The splitting itself is unit-tested on crafted texts
(tests/openai_frontend/test_reasoning.py)."""
from __future__ import annotations

import json

import pytest

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT
from tests.e2e.shared import TINY_ENGINE_ARGS, running_server
from tests.e2e.test_openai_frontend import MESSAGES, SERVED, start_frontend, stop_frontend, triton

openai = pytest.importorskip("openai", reason="openai is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.slow

RECOMMENDED_MAX_TOKENS = 7


class _Server:
    """What start_frontend and triton() read of the session's Server."""

    def __init__(self, handle, model_dir):
        self.handle, self.model_dir = handle, model_dir
        self.grpc, self.metrics = handle.grpc_url, handle.metrics_url


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from testing.tiny_model import make_tiny_model_dir

    work = tmp_path_factory.mktemp("model-defaults")
    model = make_tiny_model_dir(work / "tiny")
    path = model / "generation_config.json"
    generation = json.loads(path.read_text()) if path.exists() else {}
    generation.update(temperature=0.0, max_new_tokens=RECOMMENDED_MAX_TOKENS)
    path.write_text(json.dumps(generation))
    repo = copy_repository(REPO_ROOT / "model_repository", work / "models", models=["llm"],
                           params={"llm": {"model": str(model), **TINY_ENGINE_ARGS}})
    with running_server(repo, work, load=["llm"]) as handle:
        yield _Server(handle, model)


@pytest.fixture(scope="module")
def chat_prompt(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model_dir).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


def test_requests_that_leave_sampling_out_get_the_models_values(server, chat_prompt):
    # The `llm` model itself: no temperature, no max_tokens.
    _, _, _, counts, _ = triton(server, chat_prompt)
    assert counts == [RECOMMENDED_MAX_TOKENS]
    greedy, _, _, _, _ = triton(server, chat_prompt, temperature=0.0, max_tokens=7)
    process, url = start_frontend(server)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        answers = [client.chat.completions.create(model=SERVED, messages=MESSAGES)
                   for _ in range(2)]
        for got in answers:  # greedy, as recommended: the same text, 7 tokens
            assert got.usage.completion_tokens == RECOMMENDED_MAX_TOKENS
            assert got.choices[0].message.content == greedy[0]
        # What the client sets wins.
        got = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=3)
        assert got.usage.completion_tokens == 3
        # Completions keep OpenAI's default of 16 tokens, as on vLLM's server.
        got = client.completions.create(model=SERVED, prompt="Hello")
        assert got.usage.completion_tokens == 16
    finally:
        stop_frontend(process)


def test_deepseek_r1_answers_carry_reasoning_content(server, chat_prompt):
    from openai_frontend.reasoning import ReasoningParser

    texts, _, _, _, _ = triton(server, chat_prompt, temperature=0, max_tokens=10)
    reasoning, content = ReasoningParser("deepseek_r1").plan(chat_prompt, None).split(texts[0])
    assert (reasoning, content) == (texts[0], None)  # no </think> in the tiny model's text

    process, url = start_frontend(server, "--reasoning-parser", "deepseek_r1")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=10,
                                             temperature=0)
        message = got.choices[0].message.model_dump()
        assert (message["reasoning_content"], message["content"]) == (reasoning, content)
        assert got.choices[0].finish_reason == "length"
        stream = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=10,
                                                temperature=0, stream=True)
        deltas = [c.choices[0].delta.model_dump() for c in stream if c.choices]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
        assert "".join(d.get("content") or "" for d in deltas) == ""
    finally:
        stop_frontend(process)
