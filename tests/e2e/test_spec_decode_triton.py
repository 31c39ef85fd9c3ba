"""Speculative decoding on a real tritonserver, configured as vllm_backend users configure
it: `speculative_config` in model.json (n-gram lookup, up to 4 draft tokens a step) on the
embedded SmolLM2. One server, explicit model control:

- spec_llm: a copy-heavy greedy prompt streams; a step that accepts drafts hands the
  stream several tokens at once, and the streamed text, token counts and logprobs (one
  entry per token) add up to the non-streamed answer, which equals what plain decoding
  (plain_llm, the same model without speculation) answers; vLLM's spec-decode counters
  are on the metrics port, per-position series 0..3 included, and plain_llm has none;
  max_tokens ending inside a step of accepted drafts drops that step's later tokens.
- bad_spec: an unknown speculative method fails that model's load naming the key."""
from __future__ import annotations

import json
import time

import pytest
import tritonclient.grpc as grpcclient

from tests.e2e.shared import assert_loads_fail, running_server
from tests.e2e.test_vllm_dropin import SAMPLE_CONFIG, _model, _parameters
from tests.e2e.triton_clients import (Outcome, infer_one, llm_inputs, metric, scrape_metrics,
                                     series_labels)

pytestmark = pytest.mark.slow

K = 4
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
               "prompt_lookup_min": 2}
# The embedded SmolLM2 with a small pool (vLLM's keys), metrics on as the pbtxt asks.
# float32: in bf16 a verification step's logits (several positions in one pass) differ
# from one-token decode's in the last bits, and this prompt has a near tie (" The" or
# "\n" after the first copy) that bf16 breaks either way. No prefix cache: the requests
# below ask the same prompt and their logprobs are compared bit for bit, and a later
# request would compute its prompt's tail as a short chunk after cached blocks (the fused
# step's rows, not the first request's prefill kernels: equal values, other last bits).
ENGINE_JSON = {"dtype": "float32", "max_model_len": 1024, "num_gpu_blocks_override": 128,
               "max_num_seqs": 8, "disable_log_requests": True,
               "enable_prefix_caching": False}
CONFIG = SAMPLE_CONFIG + _parameters({"REPORT_CUSTOM_METRICS": "true"})
PROMPT = ("Repeat this text exactly: The quick brown fox jumps over the lazy dog. "
          "The quick brown fox jumps over the lazy dog.\nRepeated:")
MAX_TOKENS = 40
SAMPLING = {"temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": 0}
FLAGS = {"return_num_output_tokens": True, "return_logprobs": True}
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    work = tmp_path_factory.mktemp("triton-spec")
    repo = work / "models"
    _model(repo, "spec_llm", CONFIG, {**ENGINE_JSON, "speculative_config": SPECULATIVE})
    _model(repo, "plain_llm", CONFIG, ENGINE_JSON)
    _model(repo, "bad_spec", CONFIG, {**ENGINE_JSON, "speculative_config": {
        **SPECULATIVE, "method": "eagle9"}})
    with running_server(repo, work, load=["spec_llm", "plain_llm"], timeout=300) as handle:
        yield handle


def _ask(server, model: str, stream: bool, **sampling) -> Outcome:
    outcome = infer_one(server.grpc_url, model, llm_inputs(
        PROMPT, {**SAMPLING, **sampling}, stream=stream, exclude_input_in_output=True, **FLAGS))
    assert outcome.error is None, outcome.error
    return outcome


def _tokens_and_logprobs(outcome: Outcome) -> tuple[list[int], list[list[dict]]]:
    """Each response's num_output_tokens and logprobs entries."""
    counts = [int(r["num_output_tokens"].reshape(-1)[0]) for r in outcome.responses
              if "num_output_tokens" in r]
    logprobs = [json.loads(r["logprobs"].reshape(-1)[0]) for r in outcome.responses
                if "logprobs" in r]
    return counts, logprobs


def test_a_speculative_stream_adds_up_to_the_plain_answer(spec_server):
    whole = _ask(spec_server, "spec_llm", stream=False)
    streamed = _ask(spec_server, "spec_llm", stream=True)
    plain = _ask(spec_server, "plain_llm", stream=False)
    # Greedy verification keeps exactly what the target alone would have sampled.
    assert whole.text and whole.text == plain.text
    assert streamed.text == whole.text

    (total,), (whole_logprobs,) = _tokens_and_logprobs(whole)
    assert 1 < total <= MAX_TOKENS and len(whole_logprobs) == total
    # Greedy: each sampled token ranks first.
    assert all(next(iter(entry.values()))["rank"] == 1 for entry in whole_logprobs)
    counts, logprobs = _tokens_and_logprobs(streamed)
    assert sum(counts) == total
    # One logprobs entry per token each response brought, the same entries in order.
    assert [len(entries) for entries in logprobs] == counts
    assert [entry for entries in logprobs for entry in entries] == whole_logprobs
    # Accepted drafts: some step handed the stream more than one token.
    assert max(counts) > 1, counts


def test_max_tokens_cuts_a_step_of_accepted_drafts(spec_server):
    """The prompt's copy comes back in steps of K + 1 tokens after the first; 13 ends
    inside one, whose later tokens (and their logprobs) are dropped."""
    cut = 13
    streamed = _ask(spec_server, "spec_llm", stream=True, max_tokens=cut)
    plain = _ask(spec_server, "plain_llm", stream=False, max_tokens=cut)
    assert streamed.text == plain.text
    counts, logprobs = _tokens_and_logprobs(streamed)
    assert sum(counts) == cut and [len(entries) for entries in logprobs] == counts
    (plain_logprobs,) = _tokens_and_logprobs(plain)[1]
    assert [list(entry) for entries in logprobs for entry in entries] == [
        list(entry) for entry in plain_logprobs]  # the same tokens


def _spec_series(server, model: str) -> dict[tuple[str, str | None], float]:
    """(family, position label or None) -> value, for `model`'s spec-decode series."""
    out = {}
    for key, value in scrape_metrics(server.metrics_url, "vllm:spec_decode").items():
        name, labels = series_labels(key)
        if labels.get("model") == model:
            out[(name, labels.get("position"))] = value
    return out


def test_spec_decode_counters_on_the_metrics_port(spec_server):
    _ask(spec_server, "spec_llm", stream=False)  # drafts, whatever ran before
    deadline = time.monotonic() + 20
    while True:  # the sender thread records after the response went out
        series = _spec_series(spec_server, "spec_llm")
        if series.get((SPEC_COUNTERS[2], None), 0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert set(series) == {(name, None) for name in SPEC_COUNTERS} | {
        (PER_POS, str(position)) for position in range(K)}
    drafts, draft_tokens, accepted = (series[(name, None)] for name in SPEC_COUNTERS)
    assert accepted > 0 and drafts > 0
    assert accepted <= draft_tokens <= K * drafts
    per_pos = [series[(PER_POS, str(position))] for position in range(K)]
    # A draft's token at position i is accepted only after those before it.
    assert sum(per_pos) == accepted and per_pos[0] > 0
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    assert _spec_series(spec_server, "plain_llm") == {}  # vLLM registers them only when on
    # Every token of a multi-token step is counted as generated.
    values = scrape_metrics(spec_server.metrics_url)
    assert metric(values, "vllm:generation_tokens_total", "spec_llm") == metric(
        values, "vllm:request_generation_tokens_sum", "spec_llm") > 0


def test_an_unknown_speculative_method_fails_that_load_naming_the_key(spec_server):
    client = grpcclient.InferenceServerClient(spec_server.grpc_url)
    assert_loads_fail(client, {"bad_spec": ["speculative_config.method", "eagle9"]})
    assert client.is_model_ready("spec_llm")
