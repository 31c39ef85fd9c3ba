"""--lora-modules as vLLM spells it, and the adapters as model ids on /v1/models (no
Triton behind the service here; tests/e2e/test_lora_triton.py has the real path)."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from openai_frontend.__main__ import frontend_options, parse_args
from openai_frontend.lora_modules import LoRAModule, parse_lora_modules


def test_both_of_vllms_spellings():
    modules = parse_lora_modules(["sql=/loras/sql", json.dumps(
        {"name": "chat", "path": "/loras/chat", "base_model_name": "llama"})])
    assert modules == (LoRAModule("sql", "/loras/sql"), LoRAModule("chat", "/loras/chat", "llama"))
    assert parse_lora_modules(None) == ()


@pytest.mark.parametrize("value,fragment", [
    ("nothing", "expected name=path or a JSON object"),
    ('{"name": "x"}', "expected name=path"),
    ('{"name": "x", "path": "/p", "rank": 8}', "expected name=path"),
    ("=/p", "name and path must both be set"),
])
def test_bad_entries_name_themselves(value, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_lora_modules([value])
    with pytest.raises(ValueError, match="listed twice"):
        parse_lora_modules(["a=/1", "a=/2"])


def test_cli_flag_reaches_the_options():
    args = parse_args(["--lora-modules", "sql=/loras/sql", "chat=/loras/chat"])
    assert [m.name for m in frontend_options(args, {}).lora_modules] == ["sql", "chat"]
    with pytest.raises(SystemExit):
        parse_args(["--lora-modules", "broken"])


def test_models_list_the_base_then_the_adapters():
    from openai_frontend.app import create_app
    from openai_frontend.chat import load_tokenizer
    from openai_frontend.options import FrontendOptions

    options = FrontendOptions(lora_modules=parse_lora_modules(["sql=/loras/sql"]))
    app = create_app("127.0.0.1:1", "llm", "served", load_tokenizer(None), options)
    with TestClient(app) as client:
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["root"], c.get("parent")) for c in cards] == [
            ("served", "llm", None), ("sql", "/loras/sql", "served")]
        assert client.get("/v1/models/sql").json()["parent"] == "served"
        assert client.get("/v1/models/other").status_code == 404
