"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter on the route, against the app
with a fake `llm` model in Triton's place (it refuses a folder as the backend does: a
Triton error naming the adapter). Status codes, error types and texts are vLLM 0.32's
(OpenAIServingModels). tests/e2e/test_lora_triton.py runs them on the real server."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from openai_frontend.errors import APIError, bad_request
from openai_frontend.lora_modules import LoRAModule
from openai_frontend.runtime_lora import runtime_updating
from openai_frontend.triton_client import Chunk

GOOD = "/loras/good"
# What the backend answers for these folders (engine/lora/adapter.py's reasons).
REFUSALS = {
    "/loras/missing": bad_request("LoRA adapter 'x' (/loras/missing): folder does not exist"),
    "/loras/empty": bad_request("LoRA adapter 'x' (/loras/empty): no adapter_config.json"),
    "/loras/rank64": bad_request("LoRA adapter 'x' (/loras/rank64): rank 64 of model.layers.0"
                                 ".self_attn.q_proj is greater than max_lora_rank 16"),
    "/loras/down": APIError(503, "Triton at localhost:1 is unavailable",
                            code="service_unavailable"),
}


class FakeLLM:
    """Answers every request with one final chunk, and records what it was sent."""

    def __init__(self, real) -> None:
        self.real = real
        self.sent: list[dict] = []

    async def generate(self, prompt, sampling, stream, logprobs):
        self.sent.append(dict(sampling))
        if sampling.get("lora_path") in REFUSALS:
            raise REFUSALS[sampling["lora_path"]]
        yield Chunk(["ok"], ["length"], 1, [1], None, final=True)

    async def close(self) -> None:
        await self.real.close()


# These routes and /v1/completions never tokenize (chat and /tokenize do), and loading the
# embedded model's tokenizer costs seconds.
NO_TOKENIZER = None


@pytest.fixture
def app_and_llm():
    from openai_frontend.app import create_app
    from openai_frontend.options import FrontendOptions

    options = FrontendOptions(lora_modules=(LoRAModule("static", "/loras/static"),),
                              runtime_lora_updating=True)
    app = create_app("127.0.0.1:1", "llm", "served", NO_TOKENIZER, options)
    with TestClient(app) as client:
        app.state.llm = llm = FakeLLM(app.state.llm)
        yield client, llm


def load(client, name, path, **extra):
    return client.post("/v1/load_lora_adapter",
                       json={"lora_name": name, "lora_path": path, **extra})


def vllm_error(response, status, err_type):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == (err_type, status)
    return error["message"]


def test_a_loaded_adapter_is_a_model_id_until_unloaded(app_and_llm):
    import openai

    client, llm = app_and_llm
    response = load(client, "fresh", GOOD)
    assert response.status_code == 200 and response.text == \
        "Success: LoRA adapter 'fresh' added successfully."
    # The engine checked the folder with a one-token run of the adapter.
    assert llm.sent == [{"max_tokens": 1, "temperature": 0, "lora_name": "fresh",
                         "lora_path": GOOD}]
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client,
                        max_retries=0)
    cards = {m.id: m for m in api.models.list().data}
    assert list(cards) == ["served", "static", "fresh"]
    assert (cards["fresh"].root, cards["fresh"].parent) == (GOOD, "served")
    assert api.completions.create(model="fresh", prompt="Hi", max_tokens=2).model == "fresh"
    assert llm.sent[-1]["lora_name"] == "fresh" and llm.sent[-1]["lora_path"] == GOOD
    # --lora-modules' adapters are the Triton model's configured ones: by name alone.
    api.completions.create(model="static", prompt="Hi", max_tokens=2)
    assert llm.sent[-1]["lora_name"] == "static" and "lora_path" not in llm.sent[-1]

    response = client.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"})
    assert response.status_code == 200 and response.text == \
        "Success: LoRA adapter 'fresh' removed successfully."
    assert [m.id for m in api.models.list().data] == ["served", "static"]
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="fresh", prompt="Hi", max_tokens=2)
    assert "cannot be found" in vllm_error(
        client.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"}), 404, "NotFoundError")


@pytest.mark.parametrize("path,status,err_type,message", [
    ("/loras/missing", 404, "NotFoundError",
     "Loading lora bad failed: No adapter found for /loras/missing"),
    ("/loras/empty", 404, "NotFoundError",
     "Loading lora bad failed: No adapter found for /loras/empty"),
    ("/loras/rank64", 500, "InternalServerError", "greater than max_lora_rank 16"),
    ("/loras/down", 503, "ServiceUnavailableError", "unavailable"),
])
def test_a_folder_the_engine_refuses_is_not_served(app_and_llm, path, status, err_type, message):
    client, _ = app_and_llm
    assert message in vllm_error(load(client, "bad", path), status, err_type)
    assert "bad" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert load(client, "bad", GOOD).status_code == 200  # the name is free for a good folder


def test_vllms_checks_before_the_engine_is_asked(app_and_llm):
    client, llm = app_and_llm
    assert load(client, "fresh", GOOD).status_code == 200
    sent = len(llm.sent)
    for name, path, extra, fragment in [
        ("", GOOD, {}, "Both 'lora_name' and 'lora_path' must be provided."),
        ("fresh", "", {}, "Both 'lora_name' and 'lora_path' must be provided."),
        ("served", GOOD, {}, "The lora adapter 'served' conflicts with a served base model."),
        ("fresh", "/loras/other", {}, "The lora adapter 'fresh' has already been loaded. If you "
                                      "want to load the adapter in place, set 'load_inplace' "
                                      "to True."),
        ("static", "/loras/other", {}, "has already been loaded"),
        ("fresh", GOOD, {"load_inplace": True}, "load changed weights from a new folder"),
        ("moe", GOOD, {"is_3d_lora_weight": True}, "is_3d_lora_weight"),
    ]:
        assert fragment in vllm_error(load(client, name, path, **extra), 400, "InvalidUserInput")
    assert len(llm.sent) == sent  # none of them reached the engine
    assert "needs to be provided" in vllm_error(
        client.post("/v1/unload_lora_adapter", json={"lora_name": ""}), 400, "InvalidUserInput")
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400
    # In place from a new folder: the name now serves that folder.
    assert load(client, "fresh", "/loras/good-v2", load_inplace=True).status_code == 200
    client.post("/v1/completions", json={"model": "fresh", "prompt": "Hi", "max_tokens": 1})
    assert llm.sent[-1]["lora_path"] == "/loras/good-v2"


def test_the_routes_exist_only_under_vllms_variable():
    from openai_frontend.app import create_app

    app = create_app("127.0.0.1:1", "llm", "served", NO_TOKENIZER)
    with TestClient(app) as client:
        assert load(client, "fresh", GOOD).status_code == 404
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 404
    assert runtime_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": " True "})
    assert runtime_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert not runtime_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes"})
    assert not runtime_updating({})
    from openai_frontend.__main__ import frontend_options, parse_args

    on = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    assert frontend_options(parse_args([]), on).runtime_lora_updating
    assert not frontend_options(parse_args([]), {}).runtime_lora_updating
