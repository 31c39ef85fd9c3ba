"""The general path (engine/models/transformers_backend.py): transformers' own modeling code
over our paged KV cache, for architectures we have no native implementation of. Logits
against HF's eager float32 forward through mixed prefill / chunked / decode batches;
greedy generation through the engine against HF generate, also under chunked prefill,
prefix-cache hits and preemption; a Llama folder on both paths; the refusals."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models import load_model
from engine.models.registry import NATIVE_MODELS, model_class_for
from engine.models.transformers_backend import TransformersForCausalLM
from testing.hf_reference import hf_causal_lm, hf_greedy_ids
from testing.model_batch import (PagedBatchBuilder, check_bf16_tracks_hf,
                                  check_mixed_batches_match_hf, hf_logits, run_chunks)
from testing.tiny_hf_model import make_tiny_hf_dir
from testing.tiny_model import make_tiny_model_dir

pytestmark = pytest.mark.timeout(600)

# Each switches on what sets it apart from Llama (testing/tiny_hf_model.py): OLMo 2's
# q/k norms, Granite's multipliers and logits_scaling, GPT-NeoX's partial rotary,
# parallel residual and own head name, Phi's LayerNorm and biases, Cohere's tied head
# and logit_scale, Gemma 2's alternating sliding window and soft-capping.
ARCHS = {"olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM",
         "gpt_neox": "GPTNeoXForCausalLM", "phi": "PhiForCausalLM",
         "cohere": "CohereForCausalLM", "gemma2": "Gemma2ForCausalLM"}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    path = make_tiny_hf_dir(tmp_path_factory.mktemp(request.param), request.param)
    hf = hf_causal_lm(path, torch.float32, attn_implementation="eager")
    return load_model(path, torch.float32, model_impl="transformers"), hf


def test_architecture_runs_on_the_general_path(tiny):
    loaded, hf = tiny
    assert isinstance(loaded.model, TransformersForCausalLM)
    assert type(loaded.model.hf).__name__ == loaded.hf_config.architectures[0]
    # The loader's config keeps the checkpoint's attention setting; ours routes to the cache.
    assert loaded.model.config._attn_implementation == "engine_paged"
    assert loaded.hf_config._attn_implementation != "engine_paged"


def test_mixed_batch_matches_hf(tiny):
    check_mixed_batches_match_hf(*tiny)


def test_bf16_tracks_hf_bf16(tiny):
    _, hf_fp32 = tiny
    path = hf_fp32.name_or_path
    loaded = load_model(path, torch.bfloat16, model_impl="transformers")
    hf = hf_causal_lm(path, torch.bfloat16, attn_implementation="eager")
    check_bf16_tracks_hf(loaded, hf, list(range(1000, 1012)), atol=0.1)


def test_per_layer_metadata_and_windows_off(tmp_path):
    """A list of per-layer metadata (the runner's KV-cache groups) reads as one; with
    disable_sliding_window Gemma 2's windowed layers attend to everything, as HF does
    with a window longer than the sequence."""
    path = make_tiny_hf_dir(tmp_path / "gemma2", "gemma2")
    toks = list(range(300, 315))  # past the window of 6
    outs = []
    for disable in (False, True):
        loaded = load_model(path, torch.float32, model_impl="transformers",
                            disable_sliding_window=disable)
        builder = PagedBatchBuilder(block_size=4, num_blocks=8)
        kv = builder.new_kv_caches(loaded, torch.float32)
        ids, positions, meta = builder.build([("S", toks, 0)])
        with torch.inference_mode():
            hidden = loaded.model(ids, positions, kv, [meta] * loaded.num_layers)
            outs.append(loaded.model.compute_logits(hidden))
    windowed, full = outs
    hf_full = hf_causal_lm(path, torch.float32, sliding_window=4096, attn_implementation="eager")
    torch.testing.assert_close(full, hf_logits(hf_full, toks), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(windowed[-1], full[-1], atol=1e-3)


# --- through the engine -------------------------------------------------------------

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived a",
           "1, 2, 3, 4,", "Paris is the capital of", "def main():\n    print(", "A" * 3]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def generate_ids(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=["olmo2", "gpt_neox", "gemma2"])
def tiny_dir(request, tmp_path_factory):
    return str(make_tiny_hf_dir(tmp_path_factory.mktemp(f"gen-{request.param}"),
                                request.param, seed=3))


def _stress_blocks(model_dir: str) -> int:
    # Gemma 2's windowed layers are a second KV-cache group, whose blocks come out of the
    # same pool: a request of 150 tokens needs 47 blocks of 4 there, 38 elsewhere.
    return 52 if "gemma2" in model_dir else 40


def test_greedy_matches_hf_generate_in_one_batch(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=256, block_size=16,
              model_impl="transformers")
    assert isinstance(llm.llm_engine.loaded.model, TransformersForCausalLM)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    assert generate_ids(llm, ids) == hf_greedy_ids(tiny_dir, ids, GREEDY.max_tokens)


def test_chunking_prefix_hits_and_preemption_keep_greedy_output(tiny_dir):
    system = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [system + p for p in PROMPTS] + PROMPTS
    plain = generate_ids(LLM(tiny_dir, dtype="float32", num_kv_blocks=512,
                             enable_prefix_caching=False, model_impl="transformers"), prompts)
    stressed_llm = LLM(tiny_dir, dtype="float32", block_size=4,
                       num_kv_blocks=_stress_blocks(tiny_dir),
                       max_model_len=150, max_num_batched_tokens=24,
                       long_prefill_token_threshold=7, max_num_seqs=8, model_impl="transformers")
    stressed = generate_ids(stressed_llm, prompts)
    stats = stressed_llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits > 0
    assert stressed == plain
    assert stats.kv_cache_usage == 0.0


def test_streaming_sampling_and_structured_output_run_unchanged(tiny_dir):
    from engine.sampling_params import RequestOutputKind

    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=128, max_model_len=512,
              model_impl="transformers")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True,
                            logprobs=2)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0]
    others = SamplingParams(temperature=1.3, max_tokens=8, ignore_eos=True)
    batch = llm.generate([PROMPTS[1], PROMPTS[0]], [others, seeded], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone.token_ids
    assert len(alone.logprobs) == 12
    # Streamed deltas add up to the whole greedy output.
    whole = generate_ids(llm, [PROMPTS[3]])[0]
    engine = llm.llm_engine
    engine.add_request("stream", PROMPTS[3], SamplingParams(
        temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True,
        output_kind=RequestOutputKind.DELTA))
    streamed, deltas = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].token_ids
            deltas += 1
    assert streamed == whole and deltas > 1
    # A grammar holds the output to its choices.
    choices = ["sunny", "cloudy"]
    text = llm.generate([PROMPTS[2]], SamplingParams(
        temperature=0, max_tokens=10, structured_outputs={"choice": choices}),
        use_tqdm=False)[0].outputs[0].text
    assert text in choices


def test_llama_folder_gives_native_tokens(tmp_path):
    path = str(make_tiny_model_dir(tmp_path / "llama", arch="llama", seed=3))
    prompts = PROMPTS[:4]
    native = LLM(path, dtype="float32", num_kv_blocks=128, model_impl="native")
    general = LLM(path, dtype="float32", num_kv_blocks=128, model_impl="transformers")
    assert generate_ids(general, prompts) == generate_ids(native, prompts)
    # And the logits themselves, through one mixed batch.
    loaded = {impl: load_model(path, torch.float32, model_impl=impl)
              for impl in ("native", "transformers")}
    assert isinstance(loaded["transformers"].model, TransformersForCausalLM)
    assert not isinstance(loaded["native"].model, TransformersForCausalLM)
    results = {}
    for impl, model in loaded.items():
        builder = PagedBatchBuilder(block_size=4, num_blocks=16)
        kv = builder.new_kv_caches(model, torch.float32)
        run_chunks(model, kv, builder, [("A", list(range(100, 109)), 0), ("B", list(range(7, 12)), 0)])
        results[impl] = run_chunks(model, kv, builder, [("A", [5], 9), ("B", list(range(12, 15)), 5)])
    torch.testing.assert_close(results["transformers"], results["native"], atol=1e-4, rtol=1e-4)


# --- selection and refusals ----------------------------------------------------------

def _config_only_dir(path, config) -> str:
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    return str(path)


def test_model_impl_selects_the_path(tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(make_tiny_hf_dir(tmp_path / "olmo2", "olmo2"))
    if "Olmo2ForCausalLM" in NATIVE_MODELS:
        pytest.skip("OLMo 2 became native; the refusal below needs an architecture that is not")
    assert model_class_for(config, "auto") is TransformersForCausalLM
    assert model_class_for(config, "transformers") is TransformersForCausalLM
    with pytest.raises(ValueError, match=r"Olmo2ForCausalLM.*model_impl='native'"):
        model_class_for(config, "native")
    with pytest.raises(ValueError, match="Olmo2ForCausalLM"):
        load_model(tmp_path / "olmo2", torch.float32, model_impl="native")
    llama = AutoConfig.from_pretrained(make_tiny_model_dir(tmp_path / "llama", arch="llama"))
    assert model_class_for(llama, "auto") is not TransformersForCausalLM
    assert model_class_for(llama, "transformers") is TransformersForCausalLM


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_architectures_no_path_runs_are_refused_naming_them(tmp_path, impl):
    from transformers import BertConfig, StableLmConfig, T5Config

    t5 = T5Config(vocab_size=128, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    t5.architectures = ["T5ForConditionalGeneration"]
    bert = BertConfig(vocab_size=128, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32)
    bert.architectures = ["BertForMaskedLM"]
    # A causal LM whose attention does not go through transformers' interface.
    stablelm = StableLmConfig(vocab_size=128, hidden_size=16, num_hidden_layers=1,
                              num_attention_heads=2, intermediate_size=32)
    stablelm.architectures = ["StableLmForCausalLM"]
    remote = StableLmConfig(vocab_size=128, hidden_size=16, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=32)
    remote.architectures = ["SomeRemoteCodeForCausalLM"]
    cases = {"t5": (t5, "encoder-decoder"), "bert": (bert, "not a causal LM"),
             "stablelm": (stablelm, "_supports_attention_backend"),
             "remote": (remote, "no class SomeRemoteCodeForCausalLM")}
    for name, (config, why) in cases.items():
        arch = config.architectures[0]
        with pytest.raises(ValueError, match=rf"{arch}.*{why}"):
            model_class_for(config, impl)
        if name == "t5":
            continue  # load_model reads max_position_embeddings first, which T5 lacks
        folder = _config_only_dir(tmp_path / name, config)
        with pytest.raises(ValueError, match=rf"{arch}.*{why}"):
            load_model(folder, torch.float32, model_impl=impl)


def test_batch_dependent_rope_and_hybrid_layers_are_refused(tmp_path):
    from transformers import AutoConfig

    path = make_tiny_hf_dir(tmp_path / "olmo2", "olmo2")
    config = AutoConfig.from_pretrained(path)
    config.rope_scaling = {"rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="Olmo2ForCausalLM.*'dynamic'"):
        model_class_for(config, "transformers")
    config = AutoConfig.from_pretrained(path)
    config.layer_types = ["full_attention", "conv"]
    with pytest.raises(ValueError, match=r"Olmo2ForCausalLM.*\['conv'\]"):
        model_class_for(config, "auto")


def test_what_the_general_path_refuses_at_load(tmp_path):
    path = make_tiny_hf_dir(tmp_path / "granite", "granite")
    with pytest.raises(ValueError, match="batch_invariant.*general path"):
        load_model(path, torch.float32, model_impl="transformers", batch_invariant=True)
    loaded = load_model(path, torch.float32, model_impl="transformers")
    model = loaded.model
    with pytest.raises(ValueError, match="gguf.*general path"):
        model.quantize({})
    # What engine start-up checks before applying LoRA or tensor parallelism.
    assert model.supports_lora is False and model.supports_tensor_parallel is False
    assert model.supports_quantization is False


@pytest.mark.parametrize("args, message", [
    (dict(enable_lora=True), "enable_lora: GraniteForCausalLM runs as TransformersForCausalLM"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size=2: GraniteForCausalLM runs as "
                                    "TransformersForCausalLM, which has no tensor parallelism")])
def test_engine_start_refuses_what_the_general_path_lacks(tmp_path, args, message):
    from engine import LLM

    path = make_tiny_hf_dir(tmp_path / "granite", "granite")
    with pytest.raises(ValueError, match=message):
        LLM(str(path), dtype="float32", num_kv_blocks=64, **args)


def test_prepack_runs_our_kernels_once(tmp_path):
    from torch import nn

    from kernels import dispatch
    from testing.model_batch import last_logits

    path = make_tiny_hf_dir(tmp_path / "olmo2", "olmo2")
    loaded = load_model(path, torch.bfloat16, model_impl="transformers")
    linears = [m for m in loaded.model.hf.modules() if type(m) is nn.Linear]
    assert linears and all("forward" in m.__dict__ for m in linears)  # our kernels' forward
    toks = list(range(40, 52))
    before = last_logits(loaded, toks)
    loaded.model.prepack()  # again: a no-op, never a pack of the placeholders
    torch.testing.assert_close(last_logits(loaded, toks), before, atol=0, rtol=0)
    for m in linears:
        assert m.weight.shape == (m.out_features, m.in_features)
        assert m.weight.dtype == torch.bfloat16
        if dispatch.bf16_panels_preferred():  # the panels are the only copy
            assert m.weight.stride() == (0, 0) and torch.isnan(m.weight[0, 0])


def test_checkpoint_mismatches_are_reported(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = make_tiny_hf_dir(tmp_path / "phi", "phi")
    state = load_file(path / "model.safetensors")
    config = AutoConfig.from_pretrained(path)
    model = TransformersForCausalLM(config, torch.float32)
    partial = {k: v for k, v in state.items() if "layers.1.mlp.fc2" not in k}
    with pytest.raises(ValueError, match=r"lacks 2 tensors.*layers\.1\.mlp\.fc2"):
        model.load_weights(partial.items())
    with pytest.raises(ValueError, match="unexpected tensor 'model.extra.weight'"):
        model.load_weights([*state.items(), ("model.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("lm_head.weight", torch.zeros(3, 3))])
    # A base-model checkpoint (no "model." prefix) loads into the CausalLM, and HF's
    # computed buffers saved by older exports are skipped.
    renamed = {k.removeprefix("model."): v for k, v in state.items()}
    renamed["layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    model.load_weights(renamed.items())


def test_prepack_runs_norms_rope_and_sibling_linears_natively(tmp_path):
    """What prepack swaps in besides the linears, each only where it computes what HF's
    code does: OLMo 2's RMSNorms and rotate-half RoPE go to the native kernels and its
    q/k/v (and gate/up) run as one stacked matmul; Cohere's mean-subtracting LayerNorm and
    interleaved RoPE stay HF's. The outputs themselves are checked against HF above."""
    import functools

    from torch import nn

    from engine.models import transformers_kernels as tk

    olmo2 = make_tiny_hf_dir(tmp_path / "olmo2", "olmo2")
    model = load_model(olmo2, torch.float32, model_impl="transformers").model
    layer = model.hf.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp

    def native_norm(module):
        forward = module.__dict__.get("forward")
        return isinstance(forward, functools.partial) and forward.func is tk._norm_forward

    assert native_norm(layer.post_attention_layernorm) and native_norm(attn.q_norm)
    assert "forward" in attn.__dict__  # the copy whose RoPE is _native_rope
    assert type(attn).forward is not attn.__dict__["forward"].__func__  # the class is untouched
    stacked = {m: m.forward.func.__self__ for m in (attn.q_proj, attn.k_proj, attn.v_proj,
                                                    mlp.gate_proj, mlp.up_proj)}
    assert stacked[attn.q_proj] is stacked[attn.k_proj] is stacked[attn.v_proj]
    assert stacked[mlp.gate_proj] is stacked[mlp.up_proj] is not stacked[attn.q_proj]
    assert isinstance(stacked[attn.q_proj], tk._SharedInputLinears)
    assert attn.o_proj.forward.func is tk._prepared_linear
    # A member called alone, or on its own tensor, still answers its own columns.
    hf_attn = hf_causal_lm(olmo2, torch.float32, attn_implementation="eager").model.layers[0].self_attn
    x, y = torch.randn(3, attn.q_proj.in_features), torch.randn(2, attn.q_proj.in_features)
    with torch.inference_mode():
        got = [attn.k_proj(x), attn.v_proj(y), attn.v_proj(x), attn.v_proj(x)]
    for out, proj, inp in zip(got, ("k_proj", "v_proj", "v_proj", "v_proj"), (x, y, x, x)):
        torch.testing.assert_close(out, nn.functional.linear(inp, getattr(hf_attn, proj).weight),
                                   atol=1e-5, rtol=1e-5)

    cohere = load_model(make_tiny_hf_dir(tmp_path / "cohere", "cohere"), torch.float32,
                        model_impl="transformers").model
    cohere_layer = cohere.hf.model.layers[0]
    assert not native_norm(cohere_layer.input_layernorm)
    assert "forward" not in cohere_layer.self_attn.__dict__
