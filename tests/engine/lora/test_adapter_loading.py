"""Loading PEFT folders: what cannot run on the model fails naming the adapter and the
reason, and leaves the engine serving; the registry's LRU past max_cpu_loras."""
import json
import shutil

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.registry import LoRARegistry
from testing.lora_adapter import make_lora_adapter_dir
from testing.tiny_model import make_tiny_model_dir

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-load")
    base = make_tiny_model_dir(root / "base", arch="llama", seed=3)
    good = make_lora_adapter_dir(base, root / "good", seed=1, r=8)
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, max_model_len=128,
              enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    return dict(root=root, base=base, good=good, llm=llm)


def refused(env, path, match, name="bad"):
    llm = env["llm"]
    with pytest.raises(ValueError, match=match) as info:
        llm.generate(["hello"], GREEDY, use_tqdm=False, lora_request=LoRARequest(name, 99, str(path)))
    assert repr(name) in str(info.value)
    # Nothing half-added: the engine serves the next request.
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["hello"], GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("good", 1, str(env["good"])))
    assert len(out[0].outputs[0].token_ids) == 4


def test_missing_folder(env):
    refused(env, env["root"] / "nowhere", "folder does not exist")


def test_missing_files(env):
    folder = env["root"] / "no-weights"
    folder.mkdir()
    shutil.copy(env["good"] / "adapter_config.json", folder)
    refused(env, folder, "no adapter_model.safetensors", name="no-weights")
    empty = env["root"] / "empty"
    empty.mkdir()
    refused(env, empty, "no adapter_config.json", name="empty")


def test_rank_above_max_lora_rank(env):
    big = make_lora_adapter_dir(env["base"], env["root"] / "r16", seed=2, r=16)
    refused(env, big, "rank 16 .* greater than max_lora_rank 8", name="r16")


def test_target_module_the_model_lacks(env):
    head = make_lora_adapter_dir(env["base"], env["root"] / "head", seed=2, r=8,
                                 target_modules=("q_proj", "lm_head"))
    refused(env, head, "target module 'lm_head' is not in the model", name="head")
    deeper = make_tiny_model_dir(env["root"] / "deeper-base", arch="llama", seed=3,
                                 num_hidden_layers=3)
    adapter = make_lora_adapter_dir(deeper, env["root"] / "deeper", seed=2, r=8)
    refused(env, adapter, r"target module 'model.layers.2.\w+.\w+_proj' is not in the model "
            r"\(LoRA runs on q/k/v/o/gate/up/down_proj of its 2 layers\)", name="deeper")


def test_adapter_for_another_base_model(env):
    other = make_tiny_model_dir(env["root"] / "other-base", arch="llama", seed=3,
                                intermediate_size=96)
    adapter = make_lora_adapter_dir(other, env["root"] / "other", seed=2, r=8)
    refused(env, adapter, "adapter for another base model", name="other")


def test_unsupported_peft_features(env):
    for key, value, match in (("use_dora", True, "DoRA"), ("bias", "all", "bias"),
                              ("modules_to_save", ["lm_head"], "modules_to_save")):
        folder = env["root"] / f"feature-{key}"
        shutil.copytree(env["good"], folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        config[key] = value
        (folder / "adapter_config.json").write_text(json.dumps(config))
        refused(env, folder, match, name=f"feature-{key}")


def test_lora_request_without_enable_lora(env):
    llm = LLM(str(env["base"]), dtype="float32", num_kv_blocks=64, max_model_len=128)
    with pytest.raises(ValueError, match="'good' requested, but the engine was started without"):
        llm.generate(["hi"], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("good", 1, str(env["good"])))


def test_one_lora_request_per_prompt_must_match_the_prompts(env):
    with pytest.raises(ValueError, match="2 lora_request entries for 1 prompts"):
        env["llm"].generate(["hi"], GREEDY, use_tqdm=False, lora_request=[None, None])


def test_lora_request_fields_are_checked():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("x", 1)


def test_engine_args_are_checked():
    from engine.config import EngineConfig
    config = EngineConfig.from_dict({"enable_lora": "true", "max_loras": "3",
                                     "max_lora_rank": "32"})
    assert (config.lora.enable_lora, config.lora.max_loras, config.lora.max_lora_rank,
            config.lora.max_cpu_loras) == (True, 3, 32, 3)
    with pytest.raises(ValueError, match="max_lora_rank must be one of"):
        EngineConfig.from_dict({"max_lora_rank": 12})
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        EngineConfig.from_dict({"max_loras": 2, "max_cpu_loras": 1})


class _Loaded:
    def __init__(self, request):
        self.request = request


def test_registry_drops_the_least_recently_used_and_reloads_on_demand():
    loads = []

    def load(request, files):
        loads.append(request.lora_name)
        return _Loaded(request)

    registry = LoRARegistry(load, capacity=2)
    a, b, c = (LoRARequest(n, i + 1, f"/{n}") for i, n in enumerate("abc"))
    registry.get(a), registry.get(b), registry.get(a)  # a is now the most recent
    registry.get(c)
    assert registry.loaded_ids() == [1, 3]  # b was dropped
    registry.get(b)
    assert loads == ["a", "b", "c", "b"]
    assert registry.loaded_ids() == [3, 2]
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'a'"):
        registry.get(LoRARequest("z", 1, "/z"))


def test_staged_files_are_built_without_reading_the_folder_again(env):
    """stage() (the backend calls it on Triton's thread) reads the files; the engine
    thread's load then builds from them: here the folder is gone by then."""
    folder = env["root"] / "staged"
    shutil.copytree(env["good"], folder)
    request = LoRARequest("staged", 7, str(folder))
    llm = env["llm"]
    want = llm.generate(["hello"], GREEDY, use_tqdm=False,
                        lora_request=LoRARequest("good", 1, str(env["good"])))
    llm.llm_engine.lora.stage(request)
    shutil.rmtree(folder)
    got = llm.generate(["hello"], GREEDY, use_tqdm=False, lora_request=request)
    # The same weights as "good" under another id: the same tokens.
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    # A folder that cannot be read stages nothing; the load then reports it.
    missing = LoRARequest("missing", 8, str(env["root"] / "absent"))
    llm.llm_engine.lora.stage(missing)
    with pytest.raises(ValueError, match="'missing'.*folder does not exist"):
        llm.generate(["hello"], GREEDY, use_tqdm=False, lora_request=missing)


def test_registry_keeps_at_most_capacity_staged_reads():
    reads = []

    def read(request):
        reads.append(request.lora_name)
        return request.lora_name

    built = []
    registry = LoRARegistry(lambda request, files: built.append(files) or _Loaded(request),
                            capacity=1, read=read)
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    registry.stage(a), registry.stage(a), registry.stage(b)  # b pushes a out
    assert reads == ["a", "b"]
    registry.get(b), registry.get(a)
    assert built == ["b", None]  # a was no longer staged: get() read it itself
