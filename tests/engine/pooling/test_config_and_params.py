"""The torch-free parts: runner / convert / task resolution, PoolingParams, and what a
model folder's sentence-transformers files and config say about pooling."""
import json
from types import SimpleNamespace

import pytest

from engine import EngineConfig, PoolingParams
from engine.config.runner import RunnerChoice, check_runner_args, resolve_runner
from engine.pooling.settings import classifier_activation, read_settings
from testing.encoder_folders import write_sentence_transformers


def folder(tmp_path, arch):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return tmp_path


@pytest.mark.parametrize("args, expected", [
    (dict(), ("auto", "auto")),
    (dict(task="embed"), ("pooling", "embed")),
    (dict(task="classify"), ("pooling", "classify")),
    (dict(task="score"), ("pooling", "none")),
    (dict(task="generate"), ("generate", "auto")),
    (dict(runner="pooling", task="embed"), ("pooling", "embed")),
])
def test_task_folds_into_runner_and_convert(args, expected):
    config = EngineConfig.from_dict(args)
    assert (config.runner, config.convert) == expected


@pytest.mark.parametrize("args, message", [
    (dict(runner="embed"), "runner must be one of"),
    (dict(convert="reward"), "convert must be one of"),
    (dict(task="encode"), "task must be one of"),
    (dict(runner="generate", task="embed"), "task='embed' means runner='pooling'"),
    (dict(convert="none", task="embed"), "task='embed' means convert='embed'"),
])
def test_bad_runner_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_dict(args)


@pytest.mark.parametrize("arch, runner, convert, st, expected", [
    ("LlamaForCausalLM", "auto", "auto", False, RunnerChoice("generate", None)),
    ("LlamaForCausalLM", "auto", "auto", True, RunnerChoice("pooling", "embed")),
    ("LlamaForCausalLM", "auto", "embed", False, RunnerChoice("pooling", "embed")),
    ("LlamaForCausalLM", "generate", "auto", True, RunnerChoice("generate", None)),
    ("Qwen3ForCausalLM", "pooling", "auto", False, RunnerChoice("pooling", "embed")),
    ("BertModel", "auto", "auto", False, RunnerChoice("pooling", "embed", True)),
    ("XLMRobertaModel", "pooling", "embed", False, RunnerChoice("pooling", "embed", True)),
    ("BertForSequenceClassification", "auto", "none", False,
     RunnerChoice("pooling", "classify", True)),
    ("XLMRobertaForSequenceClassification", "pooling", "classify", False,
     RunnerChoice("pooling", "classify", True)),
])
def test_resolve_runner(tmp_path, arch, runner, convert, st, expected):
    path = folder(tmp_path, arch)
    if st:
        write_sentence_transformers(path, "last", normalize=True)
    assert resolve_runner(runner, convert, path) == expected


@pytest.mark.parametrize("arch, runner, convert, message", [
    ("BertModel", "generate", "auto", "BertModel is an encoder"),
    ("LlamaForCausalLM", "generate", "embed", "convert='embed' adapts a model"),
    ("LlamaForCausalLM", "pooling", "none", "convert='none'"),
    ("LlamaForCausalLM", "pooling", "classify", "convert='classify' for"),
    ("BertModel", "pooling", "classify", "BertModel serves the 'embed' task"),
])
def test_resolve_runner_refusals(tmp_path, arch, runner, convert, message):
    with pytest.raises(ValueError, match=message):
        resolve_runner(runner, convert, folder(tmp_path, arch))


def test_pooling_params():
    assert PoolingParams() == PoolingParams(None, None, None)
    parsed = PoolingParams.from_dict({"dimensions": "64", "use_activation": "false",
                                      "truncate_prompt_tokens": -1})
    assert parsed == PoolingParams(64, False, -1)
    with pytest.raises(ValueError, match=r"pooling parameters \['max_tokens', 'temperature'\] "
                                         r"are not accepted"):
        PoolingParams.from_dict({"max_tokens": 4, "temperature": 0})
    for bad in (dict(dimensions=0), dict(dimensions=True), dict(use_activation=1),
                dict(truncate_prompt_tokens=0), dict(truncate_prompt_tokens=-2)):
        with pytest.raises(ValueError, match=f"PoolingParams.{next(iter(bad))}"):
            PoolingParams(**bad)


def hf(**values):
    return SimpleNamespace(**values)


@pytest.mark.parametrize("pooling, normalize, expected", [
    ("cls", True, ("CLS", True)), ("mean", False, ("MEAN", False)),
    ("last", True, ("LAST", True)), (None, True, ("LAST", True)), (None, False, ("LAST", False)),
])
def test_sentence_transformers_settings(tmp_path, pooling, normalize, expected):
    write_sentence_transformers(tmp_path, pooling, normalize)
    settings = read_settings(tmp_path, hf(), "embed", "LAST")
    assert (settings.pooling_type, settings.use_activation) == expected
    assert settings.source == "sentence-transformers"


def test_defaults_without_sentence_transformers(tmp_path):
    settings = read_settings(tmp_path, hf(matryoshka_dimensions=[64, 128]), "embed", "CLS")
    assert (settings.pooling_type, settings.use_activation) == ("CLS", True)
    assert settings.is_matryoshka and settings.matryoshka_dimensions == (64, 128)
    assert not read_settings(tmp_path, hf(), "embed", "CLS").is_matryoshka


def test_refused_pooling_configs(tmp_path):
    write_sentence_transformers(tmp_path, "cls", normalize=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}))
    with pytest.raises(ValueError, match="several pooling modes"):
        read_settings(tmp_path, hf(), "embed", "CLS")
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ValueError, match="'weightedmean_tokens' is not supported"):
        read_settings(tmp_path, hf(), "embed", "CLS")


@pytest.mark.parametrize("config, expected", [
    (dict(num_labels=1), "sigmoid"),
    (dict(num_labels=3), "softmax"),
    (dict(num_labels=1, problem_type="regression"), "identity"),
    (dict(num_labels=3, problem_type="multi_label_classification"), "sigmoid"),
    (dict(num_labels=1, sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"}),
     "identity"),
    (dict(num_labels=1, sbert_ce_default_activation_function="torch.nn.modules.activation.Sigmoid"),
     "sigmoid"),
])
def test_classifier_activation_follows_vllm(config, expected):
    assert classifier_activation(hf(**config)) == expected
    with pytest.raises(ValueError, match="activation 'torch.nn.modules.activation.Tanh'"):
        classifier_activation(hf(num_labels=1, sentence_transformers={
            "activation_fn": "torch.nn.modules.activation.Tanh"}))
