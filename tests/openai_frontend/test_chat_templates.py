"""The chat template a model ships is the one chat requests are rendered with, wherever the
folder keeps it: a chat_template.jinja file (transformers' layout since 4.43, the embedded
SmolLM2's) or the chat_template key of tokenizer_config.json (older checkpoints). Checked for
the OpenAI route's tokenizer (openai_frontend.chat), through the route itself to what
reaches the `llm` model, and for the engine's tokenizer (LLM.chat)."""
from __future__ import annotations

import json
import shutil

import pytest

from openai_frontend.chat import load_tokenizer, render_chat

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how are you"}]
JINJA = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
         "{% if add_generation_prompt %}[assistant]{% endif %}")
IN_CONFIG = ("{% for m in messages %}<{{ m['role'] }}|{{ m['content'] }}> {% endfor %}"
             "{% if add_generation_prompt %}<assistant|{% endif %}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(template in chat_template.jinja, template in tokenizer_config.json), nothing else
    differing: the bos tokenizer's files with its own template taken out."""
    from testing.bos_tokenizer import make_bos_tokenizer_dir

    base = make_bos_tokenizer_dir(tmp_path_factory.mktemp("base"))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))

    jinja = tmp_path_factory.mktemp("jinja") / "tok"
    shutil.copytree(base, jinja)
    (jinja / "chat_template.jinja").write_text(JINJA)

    in_config = tmp_path_factory.mktemp("in_config") / "tok"
    shutil.copytree(base, in_config)
    (in_config / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                 "chat_template": IN_CONFIG}))
    return jinja, in_config


def test_the_route_renders_either_files_template(folders):
    jinja, in_config = folders
    assert render_chat(load_tokenizer(jinja), MESSAGES) == \
        "[system] be brief [user] how are you [assistant]"
    assert render_chat(load_tokenizer(in_config), MESSAGES) == \
        "<system|be brief> <user|how are you> <assistant|"


def test_the_engines_tokenizer_reads_the_same_templates(folders):
    """LLM.chat renders with the engine's tokenizer (engine.models.model_files; the
    folders stand as the engine argument `tokenizer`)."""
    from engine.models.model_files import load_tokenizer as engine_tokenizer

    jinja, in_config = folders
    assert engine_tokenizer(None, jinja).chat_template == JINJA
    assert engine_tokenizer(None, in_config).chat_template == IN_CONFIG


def test_the_embedded_model_ships_its_template_as_chat_template_jinja():
    from openai_frontend.chat import default_tokenizer_path

    folder = default_tokenizer_path()
    assert (folder / "chat_template.jinja").is_file()
    assert load_tokenizer(folder).chat_template == (folder / "chat_template.jinja").read_text()


@pytest.mark.parametrize("which", [0, 1])
def test_what_reaches_the_llm_model_is_the_folders_rendering(folders, which):
    from fastapi.testclient import TestClient

    from openai_frontend.app import create_app
    from openai_frontend.triton_client import Chunk

    sent = []

    class FakeLLM:
        async def generate(self, prompt, sampling, stream, logprobs):
            sent.append(prompt)
            yield Chunk(["fine"], ["stop"], 3, [1], None, final=True)

        async def close(self):
            pass

    tokenizer = load_tokenizer(folders[which])
    app = create_app("127.0.0.1:1", "llm", "served", tokenizer)
    with TestClient(app) as client:
        real, app.state.llm = app.state.llm, FakeLLM()
        try:
            body = client.post("/v1/chat/completions",
                               json={"model": "served", "messages": MESSAGES}).json()
        finally:
            app.state.llm = real
    assert body["choices"][0]["message"]["content"] == "fine"
    assert sent == [render_chat(tokenizer, MESSAGES)]
