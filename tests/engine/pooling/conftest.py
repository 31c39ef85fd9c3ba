"""Model folders shared by the pooling tests (built once a session), and the references:
transformers' own forward, pooled by hand."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from testing.tiny_model import make_tiny_model_dir
from testing.encoder_folders import make_encoder_dir, write_sentence_transformers


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory):
    """BertModel, no sentence-transformers files: CLS pooling, normalised (bge's shape
    with its default)."""
    return make_encoder_dir(tmp_path_factory.mktemp("bert"), "BertModel", seed=1)


@pytest.fixture(scope="session")
def bert_mean_dir(tmp_path_factory):
    """BertModel with e5's sentence-transformers files: mean pooling, Normalize."""
    path = make_encoder_dir(tmp_path_factory.mktemp("bert-mean"), "BertModel", seed=2)
    write_sentence_transformers(path, "mean", normalize=True)
    return path


@pytest.fixture(scope="session")
def xlmr_dir(tmp_path_factory):
    path = make_encoder_dir(tmp_path_factory.mktemp("xlmr"), "XLMRobertaModel", seed=3)
    write_sentence_transformers(path, "mean", normalize=True)
    return path


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """A causal LM with Qwen3-Embedding's sentence-transformers files (last token)."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("qwen3"), arch="qwen3", seed=4)
    write_sentence_transformers(path, "last", normalize=True)
    return path


@pytest.fixture(scope="session")
def llama_mean_dir(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("llama-mean"), arch="llama", seed=5)
    write_sentence_transformers(path, "mean", normalize=True)
    return path


def hf_hidden(model_dir, encodings: list[dict]) -> list[torch.Tensor]:
    """Each encoding's last hidden states [L, H] from transformers, one forward per
    sequence (no padding anywhere): the base model of whatever the folder holds."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_dir)
    # Eager: the attention as written (HF's SDPA path drops Gemma 2's soft cap).
    load = dict(dtype=torch.float32, attn_implementation="eager")
    if config.architectures[0].endswith("ForCausalLM"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, **load).model
    else:
        model = AutoModel.from_pretrained(model_dir, **load)
    model.eval()
    out = []
    with torch.no_grad():
        for enc in encodings:
            inputs = {k: torch.tensor([v]) for k, v in enc.items()}
            out.append(model(**inputs).last_hidden_state[0])
    return out


def pool(hidden: torch.Tensor, mode: str, normalize: bool = True) -> torch.Tensor:
    vector = {"cls": hidden[0], "last": hidden[-1], "mean": hidden.mean(dim=0)}[mode]
    return F.normalize(vector, dim=-1) if normalize else vector


def assert_close_vectors(got: list[float], want: torch.Tensor) -> None:
    got = torch.tensor(got)
    assert got.shape == want.shape
    cosine = F.cosine_similarity(got, want, dim=0).item()
    assert cosine >= 0.9999, cosine
    # Normalised or not, the length matches too (a direction alone would pass a wrong scale).
    assert got.norm().item() == pytest.approx(want.norm().item(), rel=1e-4)
