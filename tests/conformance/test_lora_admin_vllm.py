"""/v1/load_lora_adapter and /v1/unload_lora_adapter answer as vLLM 0.32's own
OpenAIServingModels does: the same scenarios through vLLM's handlers (an engine stand-in
whose add_lora fails as vLLM's worker does for a missing folder and for a bad adapter) and
through our route (a stand-in `llm` model failing as our backend does), the same status,
error type and message, or the same success text."""
from __future__ import annotations

from fastapi.testclient import TestClient

from openai_frontend.errors import bad_request
from openai_frontend.options import FrontendOptions

# (route, body); "ghost" has no folder, "broken" is no adapter for the base.
SCENARIOS = [
    ("load", {"lora_name": "fresh", "lora_path": "/loras/fresh"}),
    ("load", {"lora_name": "fresh", "lora_path": "/loras/other"}),
    ("load", {"lora_name": "", "lora_path": "/loras/x"}),
    ("load", {"lora_name": "served", "lora_path": "/loras/x"}),
    ("load", {"lora_name": "ghost", "lora_path": "/loras/ghost"}),
    ("load", {"lora_name": "broken", "lora_path": "/loras/broken"}),
    ("unload", {"lora_name": "fresh"}),
    ("unload", {"lora_name": "fresh"}),
    ("unload", {"lora_name": ""}),
    ("unload", {"lora_name": "ghost"}),
]
BROKEN = "rank 64 is greater than max_lora_rank 16"

_VLLM = """
import asyncio, json, sys
from collections import defaultdict
from types import SimpleNamespace
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vllm.exceptions import LoRAAdapterNotFoundError
from vllm.utils.counter import AtomicCounter

payload = json.load(sys.stdin)

class Engine:
    async def add_lora(self, request):
        if request.lora_name == "ghost":
            raise LoRAAdapterNotFoundError(request.lora_name, request.lora_path)
        if request.lora_name == "broken":
            raise ValueError(payload["broken"])

models = OpenAIServingModels.__new__(OpenAIServingModels)
models.engine_client = Engine()
models.registry = SimpleNamespace(is_base_model=lambda name: name == "served")
models.lora_requests, models.lora_id_counter = {}, AtomicCounter(0)
models.lora_resolver_lock = defaultdict(asyncio.Lock)

async def main():
    out = []
    for route, body in payload["scenarios"]:
        if route == "load":
            got = await models.load_lora_adapter(LoadLoRAAdapterRequest(**body))
        else:
            got = await models.unload_lora_adapter(UnloadLoRAAdapterRequest(**body))
        out.append([200, None, got] if isinstance(got, str) else
                   [got.error.code, got.error.type, got.error.message])
    return out

print(json.dumps(asyncio.run(main())))
"""


class BackendLike:
    """Fails the one-token run as our backend does (engine/lora/adapter.py's reasons)."""

    def __init__(self, real) -> None:
        self.real = real

    async def generate(self, prompt, sampling, stream, logprobs):
        name, path = sampling["lora_name"], sampling["lora_path"]
        if name == "ghost":
            raise bad_request(f"LoRA adapter {name!r} ({path}): folder does not exist")
        if name == "broken":
            raise bad_request(BROKEN)
        return
        yield

    async def close(self) -> None:
        await self.real.close()


def _ours() -> list[list]:
    from openai_frontend.app import create_app

    app = create_app("127.0.0.1:1", "llm", "served", None,
                     FrontendOptions(runtime_lora_updating=True))
    out = []
    with TestClient(app) as client:
        app.state.llm = BackendLike(app.state.llm)
        for route, body in SCENARIOS:
            response = client.post(f"/v1/{route}_lora_adapter", json=body)
            if response.status_code == 200:
                out.append([200, None, response.text])
            else:
                error = response.json()["error"]
                out.append([error["code"], error["type"], error["message"]])
    return out


def test_load_and_unload_answer_as_vllms_handlers(vllm_side):
    theirs = vllm_side.run(_VLLM, {"scenarios": SCENARIOS, "broken": BROKEN}, timeout=180)
    assert _ours() == theirs
