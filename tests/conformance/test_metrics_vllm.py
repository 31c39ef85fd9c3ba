"""Our metrics against vLLM 0.32's own: vLLM's PrometheusStatLogger is built in its venv
(a VllmConfig for the same tiny model folder and max_model_len our server runs) and its
prometheus_client registry exposed as a vLLM server exposes it; that text and what our
tritonserver exposes on its metrics port after a request are read by the same parser.

Every `vllm:` family we export must be one of vLLM's with its exposed name (counters with
`_total`), kind, label names and bucket edges, or one of vllm_backend's (its
src/utils/metrics.py at 8de0c14 in triton-inference-server/vllm_backend). The families
of vLLM's we do not export are an explained allow-list, so a family vLLM adds, or one we
drop, fails here."""
from __future__ import annotations

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
from vllm.config import ModelConfig, VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger

args = json.load(sys.stdin)
model = ModelConfig(model=args["model"], skip_tokenizer_init=True,
                    max_model_len=args["max_model_len"], served_model_name=args["name"])
logger = PrometheusStatLogger(VllmConfig(model_config=model), engine_indexes=[0])
logger.log_engine_initialized()  # registers vllm:cache_config_info
print(json.dumps(generate_latest(REGISTRY).decode()))
"""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from testing.tiny_model import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def vllm_families(vllm_side, tiny_model_dir):
    text = vllm_side.run(VLLM_REGISTRY, {"model": str(tiny_model_dir), "name": MODEL,
                                         "max_model_len": int(TINY_ENGINE_ARGS["max_model_len"])})
    families = parse_exposition(text)
    # prometheus_client writes each counter's and histogram's creation time as a gauge
    # `<name>_created`: a timestamp of the client library, no metric of vLLM's.
    created = {f"{name.removesuffix('_total')}_created" for name, f in families.items()
               if f.kind == "counter"}
    created |= {f"{name}_created" for name, f in families.items() if f.kind == "histogram"}
    return {name: f for name, f in families.items()
            if name.startswith("vllm:") and name not in created}


@pytest.fixture(scope="module")
def our_families(tmp_path_factory, tiny_model_dir):
    """What our server exposes once one request finished (finish_reason length)."""
    work = tmp_path_factory.mktemp("triton-metrics")
    repo = copy_repository(REPO_ROOT / "model_repository", work / "models", models=[MODEL],
                           params={MODEL: {"model": str(tiny_model_dir), **TINY_ENGINE_ARGS}})
    with running_server(repo, work, load=[MODEL]) as handle:
        infer_many(handle.grpc_url, MODEL, [llm_inputs(
            "The capital of France is", {"temperature": 0, "max_tokens": MAX_TOKENS,
                                         "min_tokens": MAX_TOKENS})])
        deadline = time.monotonic() + 20
        while True:  # the sender thread records after the response went out
            families = parse_exposition(requests.get(handle.metrics_url, timeout=10).text)
            success = families.get("vllm:request_success_total")
            if (success is not None and success.value() >= 1) or time.monotonic() > deadline:
                return {name: f for name, f in families.items() if name.startswith("vllm:")}
            time.sleep(0.2)


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
        return our_families[name].value(suffix, **labels)

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
