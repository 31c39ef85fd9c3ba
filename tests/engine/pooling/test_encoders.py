"""BERT-family embedders on the pooling runner against transformers' own forward, pooled
by hand: CLS and mean pooling, XLM-R's offset positions, batches of mixed lengths and
batches past the token budget, truncation, Matryoshka dimensions, and what is refused."""
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, LLMEngine, PoolingParams, SamplingParams
from tests.engine.pooling.conftest import assert_close_vectors, hf_hidden, pool
from testing.encoder_folders import set_config, write_sentence_transformers

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello", "paris is the capital of france",
         "what a query about cats and dogs ?", "embedding model test 42", "a b c d e f g h i j"]


def embed_and_reference(model_dir, mode, texts=TEXTS, **engine_args):
    llm = LLM(str(model_dir), runner="pooling", dtype="float32", **engine_args)
    tok = llm.get_tokenizer()
    encodings = [dict(tok(t)) for t in texts]
    outs = llm.embed(texts)
    return llm, outs, encodings, [pool(h, mode) for h in hf_hidden(model_dir, encodings)]


@pytest.mark.parametrize("folder, mode", [("bert_dir", "cls"), ("bert_mean_dir", "mean"),
                                          ("xlmr_dir", "mean")])
def test_embeddings_match_transformers(folder, mode, request):
    model_dir = request.getfixturevalue(folder)
    llm, outs, encodings, refs = embed_and_reference(model_dir, mode)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    for out, enc, ref in zip(outs, encodings, refs):
        assert out.finished and out.prompt_token_ids == enc["input_ids"]
        assert out.outputs.hidden_size == 32
        assert_close_vectors(out.outputs.embedding, ref)
    # Token ids give the same vectors as the text they came from.
    again = llm.embed([enc["input_ids"] for enc in encodings])
    for a, b in zip(again, outs):
        assert_close_vectors(a.outputs.embedding, torch.tensor(b.outputs.embedding))


def test_a_batch_past_the_token_budget_runs_whole_prompts_within_it(bert_mean_dir):
    budget = 24
    texts = TEXTS * 3
    engine = LLMEngine(model=str(bert_mean_dir), runner="pooling", dtype="float32",
                       max_model_len=24, max_num_batched_tokens=budget)
    lengths = {}
    for i, text in enumerate(texts):
        engine.add_request(str(i), text)
        lengths[str(i)] = len(engine.tokenizer.encode(text))
    results, steps = {}, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        # Every request that ran this step ran whole and finished in it.
        assert engine.last_step_num_tokens == sum(lengths[o.request_id] for o in outs)
        assert 0 < engine.last_step_num_tokens <= budget
        results.update((o.request_id, o.outputs.data) for o in outs)
    assert steps > 3 and len(results) == len(texts)
    assert engine.scheduler.kv_cache_manager.num_free_blocks == \
        engine.config.cache.num_kv_blocks
    tok = engine.tokenizer
    refs = [pool(h, "mean") for h in hf_hidden(bert_mean_dir, [dict(tok(t)) for t in texts])]
    for i, ref in enumerate(refs):
        assert_close_vectors(results[str(i)], ref)


def test_xlmr_positions_reach_the_last_one(xlmr_dir):
    """max_position_embeddings 66 with padding_idx 1 leaves 64 usable positions."""
    llm = LLM(str(xlmr_dir), runner="pooling", dtype="float32")
    assert llm.llm_engine.config.scheduler.max_model_len == 64
    tok = llm.get_tokenizer()
    ids = tok("hello world " * 40, truncation=True, max_length=64)["input_ids"]
    assert len(ids) == 64
    (out,) = llm.embed([ids])
    (ref,) = hf_hidden(xlmr_dir, [{"input_ids": ids}])
    assert_close_vectors(out.outputs.embedding, pool(ref, "mean"))
    with pytest.raises(ValueError, match=r"prompt 1: prompt has 65 tokens, more than "
                                         r"max_model_len=64"):
        llm.embed([ids, ids + [5]])
    assert not llm.llm_engine.has_unfinished_requests()


def test_truncate_prompt_tokens(bert_dir):
    llm = LLM(str(bert_dir), runner="pooling", dtype="float32")
    tok = llm.get_tokenizer()
    text = "the quick brown fox jumps over the lazy dog " * 10  # past max_model_len (64)
    with pytest.raises(ValueError, match="prompt 0: .*more than max_model_len=64"):
        llm.embed([text])
    (cut,) = llm.embed([text], PoolingParams(truncate_prompt_tokens=7))
    want = tok(text, truncation=True, max_length=7)
    assert cut.prompt_token_ids == want["input_ids"]
    assert cut.prompt_token_ids[0] == tok.cls_token_id and cut.prompt_token_ids[-1] == tok.sep_token_id
    assert_close_vectors(cut.outputs.embedding, pool(hf_hidden(bert_dir, [dict(want)])[0], "cls"))
    (full,) = llm.embed([text], tokenization_kwargs={"truncate_prompt_tokens": -1})
    assert len(full.prompt_token_ids) == 64
    # Token ids are cut on the tokenizer's side (right for BERT: the first k stay).
    (ids,) = llm.embed([list(range(5, 25))], PoolingParams(truncate_prompt_tokens=6))
    assert ids.prompt_token_ids == list(range(5, 11))
    with pytest.raises(ValueError, match="truncate_prompt_tokens=65 is greater than"):
        llm.embed(["hello"], PoolingParams(truncate_prompt_tokens=65))


def test_activation_off_and_sentence_transformers_without_normalize(bert_dir, tmp_path):
    llm = LLM(str(bert_dir), runner="pooling", dtype="float32")
    tok = llm.get_tokenizer()
    (hidden,) = hf_hidden(bert_dir, [dict(tok("hello world"))])
    (raw,) = llm.embed(["hello world"], PoolingParams(use_activation=False))
    assert_close_vectors(raw.outputs.embedding, hidden[0])
    plain = shutil.copytree(bert_dir, tmp_path / "plain")
    write_sentence_transformers(plain, "cls", normalize=False)
    (out,) = LLM(str(plain), runner="pooling", dtype="float32").embed(["hello world"])
    assert_close_vectors(out.outputs.embedding, hidden[0])


def test_dimensions_need_matryoshka(bert_dir, tmp_path):
    llm = LLM(str(bert_dir), runner="pooling", dtype="float32")
    with pytest.raises(ValueError, match="dimensions=8: the model does not support Matryoshka"):
        llm.embed(["hello"], PoolingParams(dimensions=8))
    listed = shutil.copytree(bert_dir, tmp_path / "listed")
    set_config(listed, matryoshka_dimensions=[8, 16, 32])
    llm = LLM(str(listed), runner="pooling", dtype="float32")
    (hidden,) = hf_hidden(bert_dir, [dict(llm.get_tokenizer()("hello world"))])
    (out,) = llm.embed(["hello world"], PoolingParams(dimensions=16))
    # vLLM's order: cut the raw vector, then normalise.
    assert_close_vectors(out.outputs.embedding, F.normalize(hidden[0][:16], dim=-1))
    with pytest.raises(ValueError, match=r"dimensions=12: the model supports Matryoshka "
                                         r"dimensions \[8, 16, 32\]"):
        llm.embed(["hello"], PoolingParams(dimensions=12))
    flagged = shutil.copytree(bert_dir, tmp_path / "flagged")
    set_config(flagged, is_matryoshka=True)
    llm = LLM(str(flagged), runner="pooling", dtype="float32")
    (out,) = llm.embed(["hello world"], PoolingParams(dimensions=12))
    assert_close_vectors(out.outputs.embedding, F.normalize(hidden[0][:12], dim=-1))
    with pytest.raises(ValueError, match="dimensions=33: the model's embeddings have 32"):
        llm.embed(["hello"], PoolingParams(dimensions=33))


def test_refused_inputs(bert_dir):
    llm = LLM(str(bert_dir), runner="pooling", dtype="float32")
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.embed(["hello", []])
    with pytest.raises(ValueError, match=r"out of vocabulary"):
        llm.embed([[5, 100000]])
    with pytest.raises(ValueError, match="takes PoolingParams, got SamplingParams"):
        llm.embed(["hello"], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"tokenization_kwargs \['padding'\]"):
        llm.embed(["hello"], tokenization_kwargs={"padding": True})
    with pytest.raises(ValueError, match="text pairs are a cross-encoder's input"):
        llm.llm_engine.add_request("x", ("a", "b"))
    assert not llm.llm_engine.has_unfinished_requests()


def test_encoder_settings_that_cannot_apply_are_refused(bert_dir, tmp_path):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) is smaller than "
                                         r"max_model_len \(64\)"):
        LLM(str(bert_dir), runner="pooling", max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="long_prefill_token_threshold: an encoder"):
        LLM(str(bert_dir), runner="pooling", long_prefill_token_threshold=8)
    with pytest.raises(ValueError, match="enable_lora: not supported with runner='pooling'"):
        LLM(str(bert_dir), runner="pooling", enable_lora=True)
    dense = shutil.copytree(bert_dir, tmp_path / "dense")
    write_sentence_transformers(dense, "cls", normalize=True, extra_modules=["Dense"])
    with pytest.raises(ValueError, match=r"modules \['Dense'\]"):
        LLM(str(dense), runner="pooling")
    maxed = shutil.copytree(bert_dir, tmp_path / "max")
    write_sentence_transformers(maxed, "max", normalize=True)
    with pytest.raises(ValueError, match="pooling mode 'max_tokens' is not supported"):
        LLM(str(maxed), runner="pooling")


def test_a_failed_step_aborts_its_requests_and_the_engine_carries_on(bert_dir):
    from engine.faults import FaultPlan
    from engine.llm_engine import EngineStepError
    llm = LLM(str(bert_dir), runner="pooling", dtype="float32", faults=FaultPlan(model_step=1))
    with pytest.raises(EngineStepError, match="injected model failure") as failure:
        llm.embed(["hello", "hello world"])
    assert sorted(failure.value.failed_request_ids) == ["0", "1"]
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.pooling._pending == {}
    (out,) = llm.embed(["hello"])
    assert out.finished and len(out.outputs.embedding) == 32
    # Aborting a queued request hands back a finished output without a vector.
    engine.add_request("queued", "hello")
    (aborted,) = engine.abort_request("queued")
    assert aborted.finished and aborted.outputs is None
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_incomplete_or_foreign_checkpoints_are_refused(bert_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    state = load_file(bert_dir / "model.safetensors")
    partial = shutil.copytree(bert_dir, tmp_path / "partial")
    save_file({k: v for k, v in state.items() if k != "encoder.layer.1.attention.self.key.bias"},
              partial / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.1\.qkv_proj\.bias \(key\)"):
        LLM(str(partial), runner="pooling")
    # A BertForPreTraining export: "bert." prefixes and a head the embedder ignores.
    prefixed = shutil.copytree(bert_dir, tmp_path / "prefixed")
    save_file({**{"bert." + k: v for k, v in state.items()},
               "cls.predictions.bias": torch.zeros(3)}, prefixed / "model.safetensors")
    llm = LLM(str(prefixed), runner="pooling", dtype="float32")
    (hidden,) = hf_hidden(bert_dir, [dict(llm.get_tokenizer()("hello"))])
    assert_close_vectors(llm.embed(["hello"])[0].outputs.embedding, pool(hidden, "cls"))
    save_file({**state, "encoder.layer.0.extra.weight": torch.zeros(2)},
              partial / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor 'encoder.layer.0.extra.weight'"):
        LLM(str(partial), runner="pooling")
