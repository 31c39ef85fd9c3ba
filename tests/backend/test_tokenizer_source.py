"""backend.tokenizer_source: preprocessing/postprocessing take the engine model's
tokenizer from its config.pbtxt, and an explicit tokenizer that disagrees fails the load."""
from __future__ import annotations

import pytest

from backend.repository_layout import copy_repository
from backend.tokenizer_source import TokenizerSource, read_config_parameters, tokenizer_source
from backend.triton_server import REPO_ROOT


def repository(tmp_path, engine=None, tokenizer_models=None):
    """A copy of the project's repository with overrides: engine -> tensorrt_llm,
    tokenizer_models -> preprocessing."""
    return copy_repository(REPO_ROOT / "model_repository", tmp_path / "repo",
                           models=["tensorrt_llm", "preprocessing"],
                           params={"tensorrt_llm": engine or {},
                                   "preprocessing": tokenizer_models or {}})


def source_of(repo, name="preprocessing"):
    return tokenizer_source(name, read_config_parameters(repo / name / "config.pbtxt"), repo / name)


def test_the_shipped_repository_uses_the_engine_default(tmp_path):
    assert source_of(repository(tmp_path)) == TokenizerSource(model=None, tokenizer=None)


def test_an_empty_tokenizer_follows_the_engine_model_and_its_tokenizer(tmp_path):
    repo = repository(tmp_path, engine={"model": "/models/a"})
    assert source_of(repo) == TokenizerSource(model="/models/a", tokenizer=None)
    repo = repository(tmp_path / "2", engine={"model": "/models/a", "tokenizer": "/tok/b"})
    assert source_of(repo) == TokenizerSource(model="/models/a", tokenizer="/tok/b")


def test_an_explicit_tokenizer_naming_the_same_folder_loads(tmp_path):
    (tmp_path / "m").mkdir()
    repo = repository(tmp_path, engine={"model": str(tmp_path / "m")},
                      tokenizer_models={"tokenizer": f"{tmp_path}/./m/"})
    assert source_of(repo).model == str(tmp_path / "m")


@pytest.mark.parametrize("engine,explicit,shown", [
    ({"model": "/models/a"}, "/models/b", "/models/a"),
    ({"model": "/models/a", "tokenizer": "/tok/a"}, "/models/a", "/tok/a"),
    ({}, "/models/b", "the embedded default model"),
])
def test_an_explicit_tokenizer_that_disagrees_fails_naming_both(tmp_path, engine, explicit, shown):
    repo = repository(tmp_path, engine=engine, tokenizer_models={"tokenizer": explicit})
    with pytest.raises(ValueError) as failure:
        source_of(repo)
    message = str(failure.value)
    assert message.startswith("preprocessing: tokenizer") and explicit in message and shown in message
    assert "'tensorrt_llm'" in message


def test_a_missing_engine_model_needs_an_explicit_tokenizer(tmp_path):
    repo = repository(tmp_path, tokenizer_models={"engine_model": "no_such_model"})
    with pytest.raises(ValueError, match="no engine model config at .*no_such_model"):
        source_of(repo)
    repo = repository(tmp_path / "2", tokenizer_models={"engine_model": "no_such_model",
                                                        "tokenizer": "/tok/c"})
    assert source_of(repo) == TokenizerSource(model=None, tokenizer="/tok/c")


def test_unknown_parameter_is_refused(tmp_path):
    repo = repository(tmp_path, tokenizer_models={"tokenzier": "/tok"})
    with pytest.raises(ValueError, match="tokenzier"):
        source_of(repo)


def test_the_engine_and_the_tokenizer_models_load_the_same_tokenizer(tmp_path):
    # The one function both sides call; a tiny model folder has its own tokenizer files.
    from engine.models import load_tokenizer, tokenizer_dir
    from testing.tiny_model import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "tiny")
    repo = repository(tmp_path, engine={"model": str(model)})
    source = source_of(repo)
    assert tokenizer_dir(source.model, source.tokenizer) == model
    assert load_tokenizer(source.model, source.tokenizer).encode("hello world")
