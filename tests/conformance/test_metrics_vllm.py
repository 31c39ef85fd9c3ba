"""Our metrics against vLLM 0.32's own: vLLM's PrometheusStatLogger is built in its venv
(a VllmConfig for the same tiny model folder and max_model_len our server runs) and its
prometheus_client registry exposed as a vLLM server exposes it; that text and what our
tritonserver exposes on its metrics port after a request are read by the same parser.

Every `vllm:` family we export must be one of vLLM's with its exposed name (counters with
`_total`), kind, label names and bucket edges, or one of vllm_backend's (its
src/utils/metrics.py at 8de0c14 in triton-inference-server/vllm_backend). The families
of vLLM's we do not export are an explained allow-list, so a family vLLM adds, or one we
drop, fails here.

A second model on the same server, `llm` with a speculative_config, holds vLLM's
spec-decode families (registered only when speculation is on, as vLLM's SpecDecodingProm
does) against vLLM's logger built with the same speculative_config: names, kinds, labels,
descriptions and the per-position series."""
from __future__ import annotations

import json
import re
import time

import pytest
import requests

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT
from testing.prometheus_text import parse_exposition
from tests.e2e.shared import TINY_ENGINE_ARGS, running_server
from tests.e2e.triton_clients import infer_many, llm_inputs

pytestmark = pytest.mark.slow

MODEL = "llm"
MAX_TOKENS = 8
# The same tiny model with n-gram speculation; its spec-decode families are vLLM's.
SPEC_MODEL = "llm_spec"
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
               "prompt_lookup_min": 2}
# vllm_backend's labels, on every series beside vLLM's.
VLLM_BACKEND_LABELS = {"model", "version"}
# vllm_backend's family under a name vLLM 0.32 does not register (its inter-token latency).
VLLM_BACKEND_ONLY = {"vllm:time_per_output_token_seconds"}
# Ours alone: KV-event batches dropped at a full publisher queue (vLLM only logs them).
OURS_ONLY = {"vllm:kv_events_dropped_total"}
# Families of vLLM's we do not export, and why: nothing here fills them.
NOT_EXPORTED = {
    # No KV connector (cross-instance KV sharing) in this engine.
    "vllm:external_prefix_cache_queries_total": "no KV connector",
    "vllm:external_prefix_cache_hits_total": "no KV connector",
    # Text-only models: no multi-modal inputs, no multi-modal cache.
    "vllm:mm_cache_queries_total": "no multi-modal cache",
    "vllm:mm_cache_hits_total": "no multi-modal cache",
    # vLLM's per-GPU FLOP / memory-traffic estimates from its model analysis; no such model here.
    "vllm:estimated_flops_per_gpu_total": "no FLOP estimate",
    "vllm:estimated_read_bytes_per_gpu_total": "no FLOP estimate",
    "vllm:estimated_write_bytes_per_gpu_total": "no FLOP estimate",
}
# Our queue limit is per instance, so its rejection counter carries `engine` where vLLM's
# frontend-wide one has none.
EXTRA_LABELS = {"vllm:admission_rejections_total": {"engine"}}
# vLLM's info gauge holds every CacheConfig field; we fill the ones routers read.
INFO_GAUGES = {"vllm:cache_config_info": {"block_size", "num_gpu_blocks", "engine"}}

VLLM_REGISTRY = r"""
import json, sys
from prometheus_client import REGISTRY, generate_latest
from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger

args = json.load(sys.stdin)
model = ModelConfig(model=args["model"], skip_tokenizer_init=True,
                    max_model_len=args["max_model_len"], served_model_name=args["name"])
# With a speculative_config its SpecDecodingProm registers vllm:spec_decode_*.
speculative = SpeculativeConfig(**args["speculative_config"], target_model_config=model,
                                target_parallel_config=ParallelConfig())
logger = PrometheusStatLogger(VllmConfig(model_config=model, speculative_config=speculative),
                              engine_indexes=[0])
logger.log_engine_initialized()  # registers vllm:cache_config_info
print(json.dumps(generate_latest(REGISTRY).decode()))
"""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from testing.tiny_model import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def vllm_text(vllm_side, tiny_model_dir):
    return vllm_side.run(VLLM_REGISTRY, {"model": str(tiny_model_dir), "name": MODEL,
                                         "max_model_len": int(TINY_ENGINE_ARGS["max_model_len"]),
                                         "speculative_config": SPECULATIVE})


@pytest.fixture(scope="module")
def vllm_families(vllm_text):
    families = parse_exposition(vllm_text)
    # prometheus_client writes each counter's and histogram's creation time as a gauge
    # `<name>_created`: a timestamp of the client library, no metric of vLLM's.
    created = {f"{name.removesuffix('_total')}_created" for name, f in families.items()
               if f.kind == "counter"}
    created |= {f"{name}_created" for name, f in families.items() if f.kind == "histogram"}
    return {name: f for name, f in families.items()
            if name.startswith("vllm:") and name not in created}


@pytest.fixture(scope="module")
def our_text(tmp_path_factory, tiny_model_dir):
    """What our server exposes once one request to MODEL finished (finish_reason length);
    SPEC_MODEL, loaded beside it, adds the spec-decode families."""
    work = tmp_path_factory.mktemp("triton-metrics")
    tiny = {"model": str(tiny_model_dir), **TINY_ENGINE_ARGS}
    repo = copy_repository(REPO_ROOT / "model_repository", work / "models", models=[MODEL],
                           renames={SPEC_MODEL: MODEL},
                           params={MODEL: tiny, SPEC_MODEL: {
                               **tiny, "speculative_config": json.dumps(SPECULATIVE)}})
    with running_server(repo, work, load=[MODEL, SPEC_MODEL]) as handle:
        infer_many(handle.grpc_url, MODEL, [llm_inputs(
            "The capital of France is", {"temperature": 0, "max_tokens": MAX_TOKENS,
                                         "min_tokens": MAX_TOKENS})])
        deadline = time.monotonic() + 20
        while True:  # the sender thread records after the response went out
            text = requests.get(handle.metrics_url, timeout=10).text
            success = parse_exposition(text).get("vllm:request_success_total")
            if (success is not None and success.value(model=MODEL) >= 1
                    or time.monotonic() > deadline):
                return text
            time.sleep(0.2)


@pytest.fixture(scope="module")
def our_families(our_text):
    """Both models' families (SPEC_MODEL's spec-decode ones included)."""
    return {name: f for name, f in parse_exposition(our_text).items() if name.startswith("vllm:")}


def test_every_vllm_family_we_export_is_vllms(vllm_families, our_families):
    for name, ours in sorted(our_families.items()):
        if name in VLLM_BACKEND_ONLY:
            assert name not in vllm_families, f"{name} is vLLM's now: compare it as such"
            assert ours.kind == "histogram" and VLLM_BACKEND_LABELS <= ours.label_names
            continue
        if name in OURS_ONLY:
            assert name not in vllm_families, f"{name} is vLLM's now: compare it as such"
            assert VLLM_BACKEND_LABELS <= ours.label_names
            continue
        assert name in vllm_families, f"we export {name}, which vLLM 0.32 does not"
        theirs = vllm_families[name]
        assert ours.kind == theirs.kind, f"{name}: ours a {ours.kind}, vLLM's a {theirs.kind}"
        if name in INFO_GAUGES:
            assert INFO_GAUGES[name] <= ours.label_names
            assert ours.label_names - VLLM_BACKEND_LABELS <= theirs.label_names, name
        else:
            expected = theirs.label_names | VLLM_BACKEND_LABELS | EXTRA_LABELS.get(name, set())
            assert ours.label_names == expected, f"{name}: labels {sorted(ours.label_names)}"
        if ours.kind == "histogram":
            (their_edges,) = {tuple(edges) for edges in theirs.buckets.values()}
            for series, edges in ours.buckets.items():
                assert tuple(edges) == their_edges, f"{name} {series}: buckets {edges}"


def test_the_vllm_families_we_do_not_export_are_the_explained_ones(vllm_families, our_families):
    missing, explained = set(vllm_families) - set(our_families), set(NOT_EXPORTED)
    assert missing == explained, (f"not exported, unexplained: {sorted(missing - explained)}; "
                                  f"explained, but exported: {sorted(explained - missing)}")


def test_the_families_carry_the_request(our_families):
    """The request's figures landed where vLLM puts them (one request, 8 tokens)."""
    def value(name, suffix="", **labels):
        return our_families[name].value(suffix, model=MODEL, **labels)

    assert value("vllm:request_success_total", finished_reason="length") == 1
    assert value("vllm:request_success_total") == 1
    assert value("vllm:generation_tokens_total") == MAX_TOKENS
    assert value("vllm:request_generation_tokens", "_sum") == MAX_TOKENS
    assert value("vllm:request_params_max_tokens", "_sum") == MAX_TOKENS
    assert value("vllm:request_params_n", "_sum") == 1
    assert value("vllm:request_max_num_generation_tokens", "_sum") == MAX_TOKENS
    prompt = value("vllm:prompt_tokens_total")
    assert prompt > 0 and value("vllm:request_prompt_tokens", "_sum") == prompt
    assert value("vllm:prompt_tokens_by_source_total", source="local_compute") + value(
        "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == prompt
    # Prompt tokens computed plus tokens sampled, over the request's steps.
    assert value("vllm:iteration_tokens_total", "_sum") == prompt + MAX_TOKENS
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_num_preemptions"):
        assert value(name, "_count") == 1, name
    assert value("vllm:inter_token_latency_seconds", "_count") == MAX_TOKENS - 1
    assert value("vllm:time_per_output_token_seconds", "_count") == MAX_TOKENS - 1
    assert value("vllm:request_decode_time_seconds", "_sum") > 0
    assert value("vllm:engine_sleep_state", sleep_state="awake") == 1
    assert value("vllm:cache_config_info", block_size=TINY_ENGINE_ARGS["block_size"],
                 num_gpu_blocks=TINY_ENGINE_ARGS["num_kv_blocks"]) == 1


def _help(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.MULTILINE))


def _positions(family) -> list[str]:
    """The `position` label of each of the family's series ("" without one)."""
    return sorted(dict(key).get("position", "") for (sample, key) in family.samples
                  if sample == family.name)


def test_the_spec_decode_families_are_vllms_and_only_where_speculation_is_on(
        vllm_text, vllm_families, our_text, our_families):
    names = {name for name in vllm_families if name.startswith("vllm:spec_decode_")}
    assert names == {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                     "vllm:spec_decode_num_accepted_tokens_total",
                     "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert names <= set(our_families)  # kinds and labels: test_every_vllm_family_we_export_is_vllms
    ours, theirs = _help(our_text), _help(vllm_text)
    for name in names:
        assert ours[name] == theirs[name], name
        # Only the speculating model has series, one per position as vLLM's.
        models = {dict(key)["model"] for (_, key) in our_families[name].samples}
        assert models == {SPEC_MODEL}, name
        assert _positions(our_families[name]) == _positions(vllm_families[name]), name
    per_pos = our_families["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert _positions(per_pos) == [str(p) for p in range(SPECULATIVE["num_speculative_tokens"])]
