"""Random-weight Llama model folders, built on the spot with the transformers found here.

The GPU machine has neither the embedded SmolLM2 package nor room to carry weights, so
the check builds what it needs: a Llama config of the wanted shape with random weights,
and a word-level tokenizer (token i is the word "w<i>") so the folder loads through the
engine's ordinary loader. Written for transformers 4.57 and 5.x alike: only the model
constructor, `save_pretrained` and `generate` are used, with no dtype arguments (renamed
between the two).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 as in SmolLM2 and Llama 2


@dataclass(frozen=True, slots=True)
class LlamaShape:
    label: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# SmolLM2-135M's published config (rope_theta aside: the default keeps transformers 4 and 5,
# which moved it into rope_parameters, building the same model).
SMOLLM2_135M = LlamaShape("SmolLM2-135M shape", 49152, 576, 1536, 30, 9, 3)
# Llama-3.2-1B's shape: 1.24B parameters, 2.5 GB in bf16.
LLAMA_1B = LlamaShape("Llama-3.2-1B shape", 128256, 2048, 8192, 16, 32, 8)
# Rehearsal stand-ins: same GQA layout in miniature, quick on two CPU cores.
TINY_SMOLLM2 = LlamaShape("tiny SmolLM2-like", 512, 96, 192, 2, 3, 1)
TINY_1B = LlamaShape("tiny 1B-like", 512, 128, 256, 2, 4, 2)


def build_llama(shape: LlamaShape, device: str, dtype: torch.dtype, seed: int = 0,
                init_std: float = 0.02):
    """HF LlamaForCausalLM with random weights, on `device` in `dtype`, in eval mode.

    Built directly on the device: initialising 1B parameters on the host takes longer
    than the whole GPU run should."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings, rms_norm_eps=1e-5,
        tie_word_embeddings=shape.tie_word_embeddings, initializer_range=init_std,
        bos_token_id=1, eos_token_id=2, pad_token_id=2)
    rng_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(rng_state)
    model = model.to(dtype).eval()
    # Random weights emit EOS now and then; every measurement wants its full length.
    model.generation_config.eos_token_id = None
    return model


def save_model_folder(model, out: Path) -> Path:
    """The HF model's weights and config plus a word-level tokenizer, loadable by LLM(out)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_word_tokenizer(out, model.config.vocab_size, model.config.max_position_embeddings)
    return out


def write_word_tokenizer(out: Path, vocab_size: int, max_length: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update((f"w{i}", i) for i in range(len(SPECIAL_TOKENS), vocab_size))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
              "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>",
              "model_max_length": max_length}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def random_prompts(count: int, lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    """Token-id prompts avoiding the special ids, lengths cycled from `lengths`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(len(SPECIAL_TOKENS), vocab_size, (lengths[i % len(lengths)],),
                          generator=gen).tolist() for i in range(count)]


def weight_bytes(model) -> int:
    """Bytes of parameters a decode step reads (a tied embedding counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
