"""Multi-LoRA on a real tritonserver with vllm_backend's LoRA layout: model.json with
enable_lora / max_lora_rank and multi_lora.json beside it in the version folder.

- lora_model: clients sending lora_name (gRPC stream, HTTP generate) get the adapter's
  text, the same as the offline engine with that LoRARequest (the engine's own tests hold
  it to HF + peft); a bad name is refused INVALID_ARG naming it while the requests sent
  with it finish unharmed.
- the OpenAI route: adapters as model ids (--lora-modules), and loaded / unloaded at run
  time (/v1/load_lora_adapter, the model's allow_runtime_lora_updating).
- KV events: lora_model publishes them; a subscriber decoding with vLLM's own classes
  finds each adapter's blocks under its name and id, a runtime-loaded one included, with
  the block hashes vLLM's hasher gives that adapter's request.
- ensemble: the TensorRT-LLM-style ensemble passes `lora_name` to the token model.
- no_multi_lora / bad_rank: enable_lora without multi_lora.json, or an adapter above
  max_lora_rank, fail that model's load naming the file or the adapter."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from backend.triton_server import free_port
from tests.e2e.shared import TINY_ENGINE_ARGS, assert_loads_fail, loaded, running_server
from tests.e2e.triton_clients import infer_one, llm_inputs

pytestmark = pytest.mark.slow

CONFIG = 'backend: "tle"\ninstance_group [ { count: 1 kind: KIND_MODEL } ]\n'
METRICS_ON = 'parameters { key: "REPORT_CUSTOM_METRICS" value: { string_value: "true" } }\n'
PROMPT = "The capital of France is"
SAMPLING = {"max_tokens": 12, "temperature": 0}
BLOCK_SIZE = int(TINY_ENGINE_ARGS["block_size"])


def _model(repo, name, model_json, multi_lora=None, config=CONFIG):
    version = repo / name / "1"
    version.mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (version / "model.json").write_text(json.dumps(model_json, indent=2))
    if multi_lora is not None:
        (version / "multi_lora.json").write_text(json.dumps(multi_lora, indent=2))


@pytest.fixture(scope="module")
def lora_env(tmp_path_factory, tiny_model_dir):
    from testing.lora_adapter import make_lora_adapter_dir

    work = tmp_path_factory.mktemp("triton-lora")
    weights = work / "weights" / "loras"
    alpha = make_lora_adapter_dir(tiny_model_dir, weights / "alpha", seed=1, r=8)
    beta = make_lora_adapter_dir(tiny_model_dir, weights / "beta", seed=2, r=16,
                                 target_modules=("q_proj", "v_proj"))
    # In no multi_lora.json: loaded at run time through the OpenAI route; and a folder
    # that is no adapter (its weights file is not safetensors).
    delta = make_lora_adapter_dir(tiny_model_dir, weights / "delta", seed=3, r=8)
    epsilon = make_lora_adapter_dir(tiny_model_dir, weights / "epsilon", seed=4, r=8)
    broken = weights / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((alpha / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    repo = work / "models"
    base_json = {"model": str(tiny_model_dir), **TINY_ENGINE_ARGS, "enforce_eager": "true"}
    kv_ports = free_port(), free_port()
    kv_events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{kv_ports[0]}",
                 "replay_endpoint": f"tcp://*:{kv_ports[1]}", "topic": "kv@lora_model"}
    _model(repo, "lora_model", {**base_json, "enable_lora": "true", "max_lora_rank": 16,
                                "max_loras": 2, "allow_runtime_lora_updating": True,
                                "prefix_caching_hash_algo": "sha256_cbor",
                                "kv_events_config": kv_events},
           {"alpha": str(alpha), "beta": str(beta)}, config=CONFIG + METRICS_ON)
    _model(repo, "no_multi_lora", {**base_json, "enable_lora": "true"})
    _model(repo, "bad_rank", {**base_json, "enable_lora": "true", "max_lora_rank": 8},
           {"alpha": str(alpha), "beta": str(beta)})
    # The adapters from config.pbtxt parameters alone (what scripts/serve.py --lora-modules
    # writes), and that parameter without enable_lora.
    pbtxt = CONFIG + "".join(
        f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in
        {"model": str(tiny_model_dir), **TINY_ENGINE_ARGS, "enable_lora": "true",
         "max_lora_rank": "16", "lora_modules": f"beta={beta}"}.items())
    (repo / "pbtxt_lora" / "1").mkdir(parents=True)
    (repo / "pbtxt_lora" / "config.pbtxt").write_text(pbtxt)
    (repo / "lora_off" / "1").mkdir(parents=True)
    (repo / "lora_off" / "config.pbtxt").write_text(pbtxt.replace(
        'key: "enable_lora" value: { string_value: "true" }',
        'key: "enable_lora" value: { string_value: "false" }'))
    # The TensorRT-LLM-style ensemble over a token model with the same adapters.
    from backend.repository_layout import copy_repository
    from backend.triton_server import REPO_ROOT

    copy_repository(REPO_ROOT / "model_repository", repo,
                    models=["tensorrt_llm", "preprocessing", "postprocessing", "ensemble"],
                    params={"tensorrt_llm": {"model": str(tiny_model_dir), **TINY_ENGINE_ARGS,
                                             "enable_lora": "true", "max_lora_rank": "16",
                                             "max_loras": "2"},
                            "preprocessing": {"tokenizer": str(tiny_model_dir)},
                            "postprocessing": {"tokenizer": str(tiny_model_dir)}})
    (repo / "tensorrt_llm" / "1" / "multi_lora.json").write_text(
        json.dumps({"alpha": str(alpha), "beta": str(beta)}))
    # A `backend: "python"` model.py imports an installed copy of the package before the
    # PYTHONPATH checkout (the tle backend's model.py puts PYTHONPATH first; this does too).
    model_py = repo / "tensorrt_llm" / "1" / "model.py"
    model_py.write_text("import os, sys\nsys.path[:0] = [p for p in os.environ.get('PYTHONPATH', '')"
                        ".split(os.pathsep) if p and p not in sys.path]\n" + model_py.read_text())
    with running_server(repo, work, timeout=300) as handle:
        yield dict(server=handle, tiny=str(tiny_model_dir), alpha=str(alpha), beta=str(beta),
                   delta=str(delta), epsilon=str(epsilon), broken=str(broken),
                   kv_replay_port=kv_ports[1])


@pytest.fixture(scope="module")
def expected(lora_env):
    from engine import LLM, LoRARequest, SamplingParams

    args = {k: v for k, v in TINY_ENGINE_ARGS.items()}
    llm = LLM(lora_env["tiny"], enable_lora=True, max_lora_rank=16, max_loras=2, **args)
    params = SamplingParams(temperature=0, max_tokens=12)
    loras = {None: None, "alpha": LoRARequest("alpha", 1, lora_env["alpha"]),
             "beta": LoRARequest("beta", 2, lora_env["beta"]),
             "delta": LoRARequest("delta", 3, lora_env["delta"])}
    texts = {name: llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0]
             .outputs[0].text for name, lora in loras.items()}
    assert len(set(texts.values())) == 4  # each adapter changes the text
    return texts


def _grpc(client_url, lora_name, stream=True):
    sampling = dict(SAMPLING) if lora_name is None else {**SAMPLING, "lora_name": lora_name}
    return infer_one(client_url, "lora_model",
                     llm_inputs(PROMPT, sampling, stream=stream, exclude_input_in_output=True))


def test_clients_sending_lora_name_get_the_adapters_text(lora_env, expected):
    import tritonclient.grpc as grpcclient

    server = lora_env["server"]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with loaded(client, "lora_model"):
        # Mixed in flight together: two adapters, the base, and a name nobody serves.
        names = ["alpha", "nosuch", None, "beta", "alpha"]
        with ThreadPoolExecutor(len(names)) as pool:
            outcomes = list(pool.map(lambda n: _grpc(server.grpc_url, n), names))
        for name, outcome in zip(names, outcomes):
            if name == "nosuch":
                assert outcome.error is not None and "LoRA nosuch is not supported" in outcome.error
                assert "alpha" in outcome.error and "beta" in outcome.error
                continue
            assert outcome.error is None, (name, outcome.error)
            assert len(outcome.responses) > 1  # streamed
            assert outcome.text == expected[name], name
        http = requests.post(f"http://{server.http_url}/v2/models/lora_model/generate",
                             json={"text_input": PROMPT, "parameters": {
                                 **SAMPLING, "lora_name": "beta",
                                 "exclude_input_in_output": True}}, timeout=120)
        assert http.status_code == 200, http.text
        assert http.json()["text_output"] == expected["beta"]
        refused = requests.post(f"http://{server.http_url}/v2/models/lora_model/generate",
                                json={"text_input": PROMPT, "parameters": {"lora_name": "gamma"}},
                                timeout=120)
        assert refused.status_code == 400 and "LoRA gamma is not supported" in refused.text
        _check_lora_info(server.metrics_url)


def _check_lora_info(metrics_url):
    """vllm:lora_requests_info as vLLM 0.32 exports it: its labels name the adapters with
    requests in flight, its value is the update's Unix time; the newest series (what
    llm-d's picker reads) shows none once every request is done."""
    from tests.e2e.triton_clients import scrape_metrics, series_labels

    series = [(series_labels(key)[1], value) for key, value in scrape_metrics(metrics_url).items()
              if series_labels(key)[0] == "vllm:lora_requests_info"]
    assert series, "vllm:lora_requests_info not exported"
    for labels, value in series:
        assert labels["max_lora"] == "2" and labels["model"] == "lora_model"
        assert abs(value - time.time()) < 600
    running = {name for labels, _ in series for name in labels["running_lora_adapters"].split(",")}
    assert {"alpha", "beta"} <= running
    newest = max(series, key=lambda item: item[1])[0]
    assert newest["running_lora_adapters"] == newest["waiting_lora_adapters"] == ""


def test_bad_lora_setups_fail_the_load_naming_why(lora_env):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(lora_env["server"].grpc_url)
    assert_loads_fail(client, {
        "no_multi_lora": ["enable_lora is true", "multi_lora.json does not exist"],
        "bad_rank": ["LoRA adapter 'beta'", "rank 16", "greater than max_lora_rank 8"],
        "lora_off": ["parameter 'lora_modules' needs enable_lora=true"],
    })


def test_adapters_from_config_pbtxt_parameters(lora_env, expected):
    import tritonclient.grpc as grpcclient

    server = lora_env["server"]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with loaded(client, "pbtxt_lora"):
        out = infer_one(server.grpc_url, "pbtxt_lora", llm_inputs(
            PROMPT, {**SAMPLING, "lora_name": "beta"}, exclude_input_in_output=True))
        assert out.error is None and out.text == expected["beta"]


@pytest.fixture(scope="module")
def openai_route(lora_env):
    """lora_model loaded, and `python -m openai_frontend` over it with --lora-modules and
    VLLM_ALLOW_RUNTIME_LORA_UPDATING: (openai client, route url). One model load and one
    route start for the route's two tests."""
    import os
    import types

    import openai
    import tritonclient.grpc as grpcclient

    from tests.e2e.test_openai_frontend import start_frontend, stop_frontend

    server = lora_env["server"]
    shim = types.SimpleNamespace(grpc=server.grpc_url, metrics=server.metrics_url,
                                 model_dir=lora_env["tiny"])
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with loaded(client, "lora_model"):
        process, url = start_frontend(shim, "--model", "lora_model", "--lora-modules",
                                      f"alpha={lora_env['alpha']}",
                                      json.dumps({"name": "beta", "path": lora_env["beta"]}),
                                      env={**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
        try:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                timeout=120), url
        finally:
            stop_frontend(process)


def test_openai_route_serves_each_adapter_as_a_model_id(lora_env, expected, openai_route):
    """vLLM's --lora-modules: /v1/models lists the base and the adapters, `model` picks one."""
    import openai

    api, _ = openai_route
    cards = {m.id: m for m in api.models.list().data}
    assert list(cards) == ["tiny-llama", "alpha", "beta"]
    assert cards["alpha"].root == lora_env["alpha"]
    assert cards["alpha"].parent == "tiny-llama"
    for name in ("tiny-llama", "alpha", "beta"):
        got = api.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.model == name
        assert got.choices[0].text == expected[None if name == "tiny-llama" else name]
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gamma", prompt=PROMPT, max_tokens=2)


def _load_lora(url, name, path):
    return requests.post(f"{url}/v1/load_lora_adapter", timeout=120,
                         json={"lora_name": name, "lora_path": path})


def _unload_lora(url, name):
    return requests.post(f"{url}/v1/unload_lora_adapter", timeout=30, json={"lora_name": name})


def test_openai_route_loads_and_unloads_adapters_at_run_time(lora_env, expected, openai_route):
    """vLLM's /v1/load_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING on the route,
    allow_runtime_lora_updating on the model): a folder in no multi_lora.json serves the
    same text as the offline engine with that LoRARequest, bad folders are refused with
    vLLM's errors while a stream on another adapter finishes unharmed, and after
    /v1/unload_lora_adapter the name is gone."""
    import openai

    from tests.e2e.triton_clients import scrape_metrics, series_labels

    api, url = openai_route
    served = ["tiny-llama", "alpha", "beta"]

    loaded_now = _load_lora(url, "delta", lora_env["delta"])
    assert loaded_now.status_code == 200, loaded_now.text
    assert loaded_now.text == "Success: LoRA adapter 'delta' added successfully."
    assert [m.id for m in api.models.list().data] == [*served, "delta"]
    got = api.completions.create(model="delta", prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == expected["delta"]

    with ThreadPoolExecutor(3) as pool:
        stream = pool.submit(lambda: "".join(
            chunk.choices[0].text for chunk in api.completions.create(
                model="alpha", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)))
        missing = pool.submit(_load_lora, url, "ghost", "/nonexistent/ghost")
        broken = pool.submit(_load_lora, url, "broken", lora_env["broken"])
        assert stream.result() == expected["alpha"]
        missing, broken = missing.result(), broken.result()
    assert missing.status_code == 404, missing.text
    assert missing.json()["error"] == {
        "message": "Loading lora ghost failed: No adapter found for /nonexistent/ghost",
        "type": "NotFoundError", "param": None, "code": 404}
    assert broken.status_code == 500, broken.text
    assert broken.json()["error"]["type"] == "InternalServerError"
    assert "LoRA adapter 'broken'" in broken.json()["error"]["message"]
    assert [m.id for m in api.models.list().data] == [*served, "delta"]

    # The runtime adapter's requests show in vllm:lora_requests_info by name.
    running = {name for key in scrape_metrics(lora_env["server"].metrics_url)
               if series_labels(key)[0] == "vllm:lora_requests_info"
               for name in series_labels(key)[1]["running_lora_adapters"].split(",")}
    assert "delta" in running

    gone = _unload_lora(url, "delta")
    assert gone.status_code == 200
    assert gone.text == "Success: LoRA adapter 'delta' removed successfully."
    assert [m.id for m in api.models.list().data] == served
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="delta", prompt=PROMPT, max_tokens=2)


# Runs under vLLM's interpreter: each replayed payload decoded by vLLM's KVEventBatch
# (a layout it does not accept raises), its BlockStored events listed; and each case's
# block hashes from vLLM's request block hasher, as the ints its publisher sends.
VLLM_STORED_AND_HASHES = r"""
import json, sys
from msgspec.msgpack import Decoder
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.request import Request

args = json.load(sys.stdin)
decoder = Decoder(type=KVEventBatch)
stored = [{f: getattr(e, f) for f in ("block_hashes", "token_ids", "lora_id", "lora_name",
                                      "extra_keys")}
          for payload in args["payloads"] for e in decoder.decode(bytes.fromhex(payload)).events
          if isinstance(e, BlockStored)]
fn = get_hash_fn_by_name("sha256_cbor")
kcu.init_none_hash(fn)
hashes = {}
for name, case in args["cases"].items():
    request = Request(request_id=name, prompt_token_ids=case["tokens"],
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                      block_hasher=kcu.get_request_block_hasher(args["block_size"], fn),
                      lora_request=None if case["lora"] is None else LoRARequest(*case["lora"]))
    hashes[name] = [kcu.maybe_convert_block_hash(h) for h in request.block_hashes]
print(json.dumps({"stored": stored, "hashes": hashes}))
"""


def test_kv_events_name_each_adapter_a_runtime_one_included(lora_env, openai_route, vllm_side):
    """An adapter loaded at run time (/v1/load_lora_adapter), a configured one and the base
    serve one prompt; the model's KV events, replayed from sequence 0 and decoded by vLLM's
    KVEventBatch, store each one's prompt blocks under its own lora_name and lora_id, with
    vLLM's extra keys and the hashes vLLM's own hasher gives a request for that adapter
    (its name and folder in every block's key), so no two of them share a block. After the
    runtime adapter is unloaded and loaded again from another folder under its name, its
    blocks hash anew."""
    import os

    from transformers import AutoTokenizer

    from tests.engine.core.kv_cache.test_kv_events import _replay_all

    api, url = openai_route
    prompt = "Adapters keep their own cache blocks, whatever the prompt says. " * 6

    def load(name, path):
        answer = _load_lora(url, name, path)
        assert answer.status_code == 200, answer.text

    load("epsilon", lora_env["epsilon"])
    for model in ("tiny-llama", "alpha", "epsilon"):
        api.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert _unload_lora(url, "epsilon").status_code == 200
    load("epsilon", lora_env["delta"])
    api.completions.create(model="epsilon", prompt=prompt, max_tokens=2, temperature=0)

    tokens = AutoTokenizer.from_pretrained(lora_env["tiny"]).encode(prompt)
    num_blocks = (len(tokens) - 1) // BLOCK_SIZE  # the last prompt token is computed again
    assert num_blocks >= 3
    # vLLM's LoRARequest(name, id, path); its hash keys the name and the folder, not the id.
    cases = {"base": None, "alpha": ["alpha", 1, lora_env["alpha"]],
             "epsilon": ["epsilon", 1, lora_env["epsilon"]],
             "epsilon_again": ["epsilon", 1, lora_env["delta"]]}
    seed = {"PYTHONHASHSEED": os.environ["PYTHONHASHSEED"]} if "PYTHONHASHSEED" in os.environ else {}
    # The publisher sends a step's batch a moment after the step: ask again until the
    # last request's blocks are in.
    deadline = time.monotonic() + 15
    while True:
        payloads = [payload.hex() for _, payload in
                    _replay_all(lora_env["kv_replay_port"], 0, topic=b"kv@lora_model")]
        got = vllm_side.run(VLLM_STORED_AND_HASHES, {
            "payloads": payloads, "block_size": BLOCK_SIZE,
            "cases": {k: {"tokens": tokens, "lora": v} for k, v in cases.items()}}, env=seed)
        by_hash = {h: (event, i) for event in got["stored"]
                   for i, h in enumerate(event["block_hashes"])}
        if all(h in by_hash for chain in got["hashes"].values() for h in chain[:num_blocks]) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    ids = {}
    for name, lora in cases.items():
        chain = got["hashes"][name][:num_blocks]
        assert all(h in by_hash for h in chain), f"{name}: its prompt blocks were not stored"
        for index, block_hash in enumerate(chain):
            event, i = by_hash[block_hash]
            assert event["token_ids"][i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE] \
                == tokens[index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE], name
            assert event["lora_name"] == (None if lora is None else lora[0]), name
            keys = (event["extra_keys"] or [None] * (i + 1))[i]
            assert keys == (None if lora is None else [lora[0]]), name
            ids.setdefault(name, set()).add(event["lora_id"])
    assert ids["base"] == {None}
    assert all(len(v) == 1 and None not in v for k, v in ids.items() if k != "base"), ids
    # Every adapter, and one name at two folders, keeps an id of its own.
    assert len({next(iter(v)) for v in ids.values()}) == len(cases)
    first_blocks = [got["hashes"][name][0] for name in cases]
    assert len(set(first_blocks)) == len(cases)
    assert _unload_lora(url, "epsilon").status_code == 200


def test_ensemble_clients_send_lora_name(lora_env, expected):
    import numpy as np
    import tritonclient.grpc as grpcclient

    from tests.e2e.triton_clients import ensemble_inputs

    server = lora_env["server"]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with loaded(client, "ensemble"):
        for name in ("alpha", "beta", None):
            extra = {} if name is None else {"lora_name": np.array([[name.encode()]], dtype=np.object_)}
            out = infer_one(server.grpc_url, "ensemble", ensemble_inputs(
                PROMPT, 12, stream=True, exclude_input_in_output=np.array([[True]]), **extra))
            assert out.error is None, out.error
            assert out.text == expected[name], name
        bad = infer_one(server.grpc_url, "ensemble", ensemble_inputs(
            PROMPT, 4, lora_name=np.array([[b"nosuch"]], dtype=np.object_)))
        assert bad.error is not None and "LoRA nosuch is not supported" in bad.error
