"""policy=fair and admission=no_evict through Triton (model llm_fair, tests/e2e/conftest.py):
the tenant reaches the scheduler and its per-tenant metrics; a bad tenant is refused alone."""
from __future__ import annotations

import time

import pytest
import requests

from tests.e2e.shared import PROMPTS, greedy
from tests.e2e.triton_clients import infer_many, llm_inputs, scrape_metrics, series_labels

pytestmark = pytest.mark.slow

MODEL = "llm_fair"


def served(server, tenant: str) -> float:
    total = 0.0
    for key, value in scrape_metrics(server.metrics, prefix="tle:").items():
        name, labels = series_labels(key)
        if (name == "tle:tenant_tokens_served_total" and labels.get("model") == MODEL
                and labels.get("tenant") == tenant):
            total += value
    return total


def test_tenant_reaches_the_scheduler_and_its_metrics(server, reference):
    before = served(server, "acme"), served(server, "gold")
    tensors = [llm_inputs(PROMPTS[0], {"temperature": 0, "max_tokens": 8, "tenant": "acme"}),
               llm_inputs(PROMPTS[1], {"temperature": 0, "max_tokens": 8, "tenant": "gold"})]
    outcomes = infer_many(server.grpc, MODEL, tensors)
    expected = reference.generate(PROMPTS[:2], greedy(8))
    # Not streamed: the prompt comes first (vllm_backend's default).
    assert [o.text for o in outcomes] == [p + e.outputs[0].text
                                          for p, e in zip(PROMPTS[:2], expected)]
    # Every prompt token and all but the last output token were computed for the tenant.
    prompt_len = len(reference.get_tokenizer().encode(PROMPTS[0]))
    deadline = time.monotonic() + 20
    while served(server, "acme") - before[0] < prompt_len + 7 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert served(server, "acme") - before[0] == prompt_len + 7
    assert served(server, "gold") > before[1]
    # The HTTP route's parameters carry it too.
    r = requests.post(f"{server.http}/v2/models/{MODEL}/generate", timeout=60, json={
        "text_input": PROMPTS[2], "parameters": {"max_tokens": 2, "tenant": "http-tenant"}})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 20
    while not served(server, "http-tenant") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert served(server, "http-tenant") > 0


@pytest.mark.parametrize("tenant", [5, "", "x" * 200])
def test_bad_tenant_is_refused_with_invalid_arg(server, tenant):
    r = requests.post(f"{server.http}/v2/models/{MODEL}/generate", timeout=60, json={
        "text_input": "hi", "parameters": {"max_tokens": 2, "tenant": tenant}})
    assert r.status_code == 400, r.text  # INVALID_ARG
    assert "tenant must be a non-empty printable string" in r.json()["error"]
    r = requests.post(f"{server.http}/v2/models/{MODEL}/generate", timeout=60, json={
        "text_input": "hi", "parameters": {"max_tokens": 2}})
    assert r.status_code == 200, r.text  # the model keeps serving
