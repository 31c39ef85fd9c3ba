"""vLLM's generation_config / override_generation_config engine arguments
(engine/config/generation.py): which generation_config.json values become the sampling
defaults, vLLM 0.32's rules, and LLM.generate without SamplingParams using them."""
from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig
from engine.config.generation import SamplingDefaults, load_sampling_defaults
from engine.sampling_params import SamplingParams

# What Qwen3's generation_config.json holds, beside keys that are no sampling defaults.
QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
         "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
         "transformers_version": "4.51.0"}


def folder(tmp_path, name, generation=None, config=None):
    path = tmp_path / name
    path.mkdir()
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_auto_takes_the_models_sampling_values_only(tmp_path):
    model = folder(tmp_path, "m", QWEN3)
    defaults = load_sampling_defaults("auto", None, model)
    assert dict(defaults.values) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert defaults.max_tokens_cap is None
    # HF's default-valued keys count too (vLLM 0.32 takes every value the file sets).
    defaults = load_sampling_defaults("auto", None, folder(tmp_path, "n", {
        "top_k": 50, "repetition_penalty": 1.05, "presence_penalty": 0.5, "frequency_penalty": 0.1,
        "min_p": 0.0, "max_new_tokens": 300, "temperature": None}))
    assert dict(defaults.values) == {"top_k": 50, "repetition_penalty": 1.05,
                                     "presence_penalty": 0.5, "frequency_penalty": 0.1,
                                     "min_p": 0.0, "max_tokens": 300}


def test_vllm_ignores_the_file_and_the_override_alone_counts(tmp_path):
    model = folder(tmp_path, "m", QWEN3)
    assert load_sampling_defaults("vllm", None, model) == SamplingDefaults()
    defaults = load_sampling_defaults("vllm", {"temperature": 0.3, "do_sample": False}, model)
    assert dict(defaults.values) == {"temperature": 0.3}


def test_override_is_merged_over_the_file(tmp_path):
    defaults = load_sampling_defaults("auto", {"temperature": 0.1, "min_p": 0.05},
                                      folder(tmp_path, "m", QWEN3))
    assert dict(defaults.values) == {"temperature": 0.1, "top_k": 20, "top_p": 0.95, "min_p": 0.05}


def test_a_folder_path_is_read_instead_of_the_models(tmp_path):
    model = folder(tmp_path, "m", QWEN3)
    other = folder(tmp_path, "other", {"temperature": 0.9, "max_new_tokens": 40})
    defaults = load_sampling_defaults(str(other), None, model)
    assert dict(defaults.values) == {"temperature": 0.9, "max_tokens": 40}
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        load_sampling_defaults(str(folder(tmp_path, "empty")), None, model)


def test_config_json_stands_in_for_a_missing_generation_config(tmp_path):
    # transformers' from_model_config, vLLM's fallback: old checkpoints kept these there.
    model = folder(tmp_path, "m", config={"model_type": "llama", "temperature": 0.7})
    defaults = load_sampling_defaults("auto", None, model)
    assert dict(defaults.values) == {"temperature": 0.7}
    assert defaults.source == str(model / "config.json")
    assert load_sampling_defaults("auto", None, folder(tmp_path, "bare")) == \
        SamplingDefaults(source=str(tmp_path / "bare" / "generation_config.json"))


def test_max_new_tokens_is_a_ceiling_only_from_a_named_folder_or_the_override(tmp_path):
    model = folder(tmp_path, "m", {"max_new_tokens": 64})
    auto = load_sampling_defaults("auto", None, model)
    assert auto.max_tokens_cap is None
    # A default only: the request's own value wins, up or down.
    assert auto.apply({}) == {"max_tokens": 64}
    assert auto.apply({"max_tokens": 500}) == {"max_tokens": 500}
    named = load_sampling_defaults(str(model), None, model)
    assert named.max_tokens_cap == 64 and named.apply({"max_tokens": 500}) == {"max_tokens": 64}
    assert named.apply({"max_tokens": 5}) == {"max_tokens": 5}
    overridden = load_sampling_defaults("auto", {"max_new_tokens": 32}, model)
    assert overridden.max_tokens_cap == 32
    assert overridden.apply({"max_tokens": None}) == {"max_tokens": 32}


def test_given_keys_win_and_a_null_max_tokens_takes_the_default():
    defaults = SamplingDefaults({"temperature": 0.6, "top_k": 20, "max_tokens": 100})
    assert defaults.apply({"temperature": 0.0, "n": 2}) == \
        {"temperature": 0.0, "n": 2, "top_k": 20, "max_tokens": 100}
    # The OpenAI route's chat request without a limit: vLLM's "unset".
    assert defaults.apply({"max_tokens": None})["max_tokens"] == 100
    assert SamplingDefaults().apply({"max_tokens": None}) == {"max_tokens": None}
    # A ceiling with nothing asked: SamplingParams' own 16 is what gets capped.
    assert SamplingDefaults(max_tokens_cap=8).apply({}) == {"max_tokens": 8}
    assert SamplingDefaults(max_tokens_cap=80).apply({}) == {"max_tokens": 16}


@pytest.mark.parametrize("generation, fragment", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"temperature": "hot"}, "temperature must be a number"),
])
def test_a_bad_value_fails_the_load_naming_the_file(tmp_path, generation, fragment):
    model = folder(tmp_path, "m", generation)
    with pytest.raises(ValueError, match=fragment) as error:
        load_sampling_defaults("auto", None, model)
    assert "generation_config.json" in str(error.value)


def test_a_file_that_is_no_json_object_is_named(tmp_path):
    model = folder(tmp_path, "m")
    (model / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="generation_config.json must hold a JSON object"):
        load_sampling_defaults("auto", None, model)


def test_engine_arguments_as_config_pbtxt_and_model_json_give_them(tmp_path):
    config = EngineConfig.from_dict({"generation_config": "vllm",
                                     "override_generation_config": '{"temperature": 0.5}'})
    assert config.generation_config == "vllm"
    assert config.override_generation_config == {"temperature": 0.5}
    assert EngineConfig().generation_config == "auto"  # vLLM's default
    none = EngineConfig.from_dict({"override_generation_config": ""})
    assert none.override_generation_config is None
    folder_arg = EngineConfig.from_dict({"generation_config": str(tmp_path)})
    assert folder_arg.generation_config == str(tmp_path)
    with pytest.raises(ValueError, match="neither 'auto', 'vllm' nor a folder"):
        EngineConfig.from_dict({"generation_config": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="override_generation_config.*JSON object"):
        EngineConfig.from_dict({"override_generation_config": "{temperature"})
    with pytest.raises(ValueError, match="override_generation_config' must be an object"):
        EngineConfig.from_dict({"override_generation_config": "[1]"})


def test_the_embedded_model_has_no_sampling_defaults():
    """So deployments of the default model sample as before under "auto"."""
    from engine.models import default_model_dir

    assert load_sampling_defaults("auto", None, default_model_dir()).values == {}


@pytest.fixture(scope="module")
def tiny_with_defaults(tmp_path_factory):
    from testing.tiny_model import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path_factory.mktemp("gen") / "m", arch="llama", seed=3)
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen.update({"temperature": 0.0, "max_new_tokens": 5, "repetition_penalty": 1.3})
    gen_path.write_text(json.dumps(gen))
    return str(path)


def test_llm_generate_without_params_uses_the_models_defaults(tiny_with_defaults):
    from engine import LLM

    llm = LLM(tiny_with_defaults, dtype="float32", num_kv_blocks=256)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.repetition_penalty) == (0.0, 5, 1.3)
    assert defaults.top_p == 1.0 and defaults.top_k == 0  # not in the file: vLLM's own
    ids = [5, 9, 13, 2, 7]
    implicit = llm.generate([ids], use_tqdm=False)[0].outputs[0].token_ids
    explicit = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=5,
                                                  repetition_penalty=1.3),
                            use_tqdm=False)[0].outputs[0].token_ids
    assert len(implicit) <= 5 and implicit == explicit
    # A SamplingParams the caller builds starts from vLLM's defaults, as in vLLM.
    assert SamplingParams().max_tokens == 16
    # LLMEngine.add_request without params samples with the same defaults.
    engine = llm.llm_engine
    engine.add_request("no-params", ids)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert finals[0].outputs[0].token_ids == explicit


def test_llm_with_generation_config_vllm_keeps_vllms_defaults(tiny_with_defaults):
    from engine import LLM

    llm = LLM(tiny_with_defaults, dtype="float32", num_kv_blocks=256, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    llm = LLM(tiny_with_defaults, dtype="float32", num_kv_blocks=256, generation_config="vllm",
              override_generation_config={"top_k": 3})
    assert llm.get_default_sampling_params() == SamplingParams(top_k=3)
