"""scripts/serve.py's command line: engine overrides are KEY=VALUE, anything else is a
clear usage error before a server starts."""
import importlib.util

import pytest

from backend.triton_server import REPO_ROOT

_spec = importlib.util.spec_from_file_location("serve", REPO_ROOT / "scripts" / "serve.py")
serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve)


def test_params_split_at_the_first_equals_sign():
    args = serve.parse_args(["--param", "max_num_seqs=8", "--param", "model=/m/a=b"])
    assert args.param == [("max_num_seqs", "8"), ("model", "/m/a=b")]


@pytest.mark.parametrize("bad", ["max_num_seqs", "=8"])
def test_param_without_key_and_value_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.parse_args(["--param", bad])
    assert exit_info.value.code == 2
    assert f"expected KEY=VALUE, got {bad!r}" in capsys.readouterr().err


def test_model_is_written_once_and_the_tokenizer_models_follow_it(tmp_path):
    from backend.tokenizer_source import read_config_parameters, tokenizer_source

    model = tmp_path / "my-model"
    args = serve.parse_args(["--model", str(model), "--param", "max_num_seqs=8"])
    repo = serve.repository_for(args, target=tmp_path / "repo")
    for name in serve.ENGINE_MODELS:
        params = read_config_parameters(repo / name / "config.pbtxt")
        assert params["model"] == str(model) and params["max_num_seqs"] == "8"
    for name in ("preprocessing", "postprocessing"):
        params = read_config_parameters(repo / name / "config.pbtxt")
        assert params["tokenizer"] == ""
        assert tokenizer_source(name, params, repo / name).model == str(model)


def test_without_overrides_the_repository_is_served_as_is(tmp_path):
    args = serve.parse_args([])
    assert serve.repository_for(args, target=tmp_path / "repo") == REPO_ROOT / "model_repository"
    assert not (tmp_path / "repo").exists()


def test_lora_modules_turn_on_enable_lora_with_absolute_folders(tmp_path, monkeypatch):
    from backend.tokenizer_source import read_config_parameters

    monkeypatch.chdir(tmp_path)
    args = serve.parse_args(["--lora-modules", "sql=loras/sql", "chat=/abs/chat"])
    repo = serve.repository_for(args, target=tmp_path / "repo")
    for name in serve.ENGINE_MODELS:
        params = read_config_parameters(repo / name / "config.pbtxt")
        assert params["enable_lora"] == "true"
        assert params["lora_modules"] == f"sql={tmp_path / 'loras/sql'} chat=/abs/chat"


KEY = "0123456789abcdef0123"


def test_restrict_api_key_from_the_flag_a_file_or_the_env_var(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_ADMIN_KEY", raising=False)
    assert serve.parse_args([]).admin_key is None
    assert serve.parse_args(["--restrict-api", KEY]).admin_key == KEY
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\n")  # as `echo KEY > file` and a mounted Secret leave it
    assert serve.parse_args(["--restrict-api-file", str(key_file)]).admin_key == KEY
    monkeypatch.setenv("TRITON_ADMIN_KEY", KEY[::-1])
    assert serve.parse_args([]).admin_key == KEY[::-1]
    assert serve.parse_args(["--restrict-api", KEY]).admin_key == KEY


@pytest.mark.parametrize("argv,fragment", [
    (["--restrict-api", "short"], "at least 16 characters"),
    (["--restrict-api", KEY + ":x=y"], "only letters, digits"),
    (["--restrict-api", KEY + " x"], "only letters, digits"),
    (["--restrict-api-file", "/nonexistent/key"], "cannot read it"),
    (["--restrict-api", KEY, "--restrict-api-file", "/k"], "not both"),
])
def test_a_bad_restrict_api_key_is_a_usage_error_naming_the_flag(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "--restrict-api" in err


def test_restrict_api_flags_use_tritonservers_syntax():
    from backend.restricted_api import tritonserver_flags

    apis = "model-repository,model-config,shared-memory,trace,logging"
    assert tritonserver_flags(KEY) == [f"--http-restricted-api={apis}:admin-key={KEY}",
                                       f"--grpc-restricted-protocol={apis}:admin-key={KEY}"]
