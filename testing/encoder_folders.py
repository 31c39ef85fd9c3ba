"""Tiny random-weight encoder folders for the pooling tests (the engine's and the Triton
backend's): BERT / XLM-R encoders and cross-encoders (transformers' own classes, a
WordPiece tokenizer built with `tokenizers`), and sentence-transformers files written by
hand next to any model."""
from __future__ import annotations

import json
import string
from pathlib import Path

import torch

WORDS = ("the quick brown fox jumps over lazy dog paris is capital of france what a "
         "query document about cats and dogs hello world embedding model test").split()


def _vocab(specials: list[str]) -> dict[str, int]:
    pieces = specials + WORDS + list(string.ascii_lowercase + string.digits + ".,?!'")
    pieces += ["##" + c for c in string.ascii_lowercase + string.digits]
    return {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}


def _wordpiece(vocab: dict[str, int], single: str, pair: str, specials: list[str]):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    tok = Tokenizer(models.WordPiece(vocab, unk_token=specials[1]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(s, vocab[s]) for s in specials])
    return tok


def bert_tokenizer():
    from transformers import BertTokenizerFast
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = _vocab(specials)
    tok = _wordpiece(vocab, "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1",
                     ["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    return BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                             pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")


def xlmr_tokenizer():
    from transformers import XLMRobertaTokenizerFast
    # XLM-R's ids: <s> 0, <pad> 1 (its padding_idx), </s> 2, <unk> 3.
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    vocab = _vocab(specials)
    tok = _wordpiece(vocab, "<s> $A </s>", "<s> $A </s> </s> $B </s>",
                     ["<s>", "<unk>", "</s>"])
    tok.model.unk_token = "<unk>"
    return XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                                   pad_token="<pad>", mask_token="<mask>")


def make_encoder_dir(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """`arch`: BertModel, BertForSequenceClassification, XLMRobertaModel or
    XLMRobertaForSequenceClassification. Random weights (LayerNorms and biases
    perturbed so a loader that drops them shows), saved with its tokenizer."""
    import transformers as tf
    xlmr = arch.startswith("XLMRoberta")
    tokenizer = xlmr_tokenizer() if xlmr else bert_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, initializer_range=0.2)
    if xlmr:
        config = tf.XLMRobertaConfig(**{**common, "max_position_embeddings": 66,
                                        "pad_token_id": 1, "bos_token_id": 0,
                                        "eos_token_id": 2, "type_vocab_size": 1,
                                        **overrides})
    else:
        config = tf.BertConfig(**{**common, "max_position_embeddings": 64,
                                  "pad_token_id": 0, **overrides})
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(tf, arch)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "LayerNorm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    out = Path(path)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def write_sentence_transformers(path: Path, pooling: str | None, normalize: bool,
                                extra_modules: list[str] = ()) -> None:
    """modules.json (+ 1_Pooling/config.json with `pooling`'s pooling_mode_* key set, when
    given), as sentence-transformers saves a model."""
    path = Path(path)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling",
                        "type": "sentence_transformers.models.Pooling"})
        keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
                "last": "pooling_mode_lasttoken", "max": "pooling_mode_max_tokens"}
        config = {"word_embedding_dimension": 0, **{k: False for k in keys.values()},
                  keys[pooling]: True}
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    if normalize:
        modules.append({"idx": len(modules), "name": str(len(modules)),
                        "path": f"{len(modules)}_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    for kind in extra_modules:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": "x",
                        "type": f"sentence_transformers.models.{kind}"})
    (path / "modules.json").write_text(json.dumps(modules))


def set_config(path: Path, **values) -> None:
    """Add keys to a saved config.json (matryoshka_dimensions, problem_type, ...)."""
    config_path = Path(path) / "config.json"
    config = json.loads(config_path.read_text())
    config.update(values)
    config_path.write_text(json.dumps(config))
