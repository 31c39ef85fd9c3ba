"""LLM.score: cross-encoders (BERT's and XLM-R's *ForSequenceClassification) against
their transformers forward on the tokenizer's pair encoding, and an embedder scoring by
cosine (vLLM's bi-encoder path)."""
import shutil

import pytest
import torch

from engine import LLM, PoolingParams
from testing.encoder_folders import make_encoder_dir, set_config

QUERY = "what is the capital of france ?"
DOCS = ["paris is the capital of france", "the lazy dog", "hello world", "a b c"]


@pytest.fixture(scope="module", params=["BertForSequenceClassification",
                                        "XLMRobertaForSequenceClassification"])
def reranker(request, tmp_path_factory):
    return make_encoder_dir(tmp_path_factory.mktemp("reranker"), request.param, seed=7,
                            num_labels=1)


def hf_logits(model_dir, pairs):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [model(**tok(a, b, return_tensors="pt")).logits[0, 0].item() for a, b in pairs]


def test_cross_encoder_scores_match_transformers(reranker):
    llm = LLM(str(reranker), runner="pooling", dtype="float32")
    logits = hf_logits(reranker, [(QUERY, d) for d in DOCS])
    assert len(set(round(x, 3) for x in logits)) == len(DOCS)  # the pairs do differ
    # vLLM 0.32's default for one label: sigmoid of the logit.
    scores = llm.score(QUERY, DOCS)
    tok = llm.get_tokenizer()
    for out, doc, logit in zip(scores, DOCS, logits):
        assert out.outputs.score == pytest.approx(torch.sigmoid(torch.tensor(logit)).item(),
                                                  abs=1e-4)
        assert out.prompt_token_ids == tok(QUERY, doc)["input_ids"]
    raw = llm.score([QUERY] * len(DOCS), DOCS, pooling_params=PoolingParams(use_activation=False))
    assert [o.outputs.score for o in raw] == pytest.approx(logits, abs=1e-4)
    # The engine API the server routes call: a (text, text_pair) prompt.
    engine = llm.llm_engine
    engine.add_request("pair", (QUERY, DOCS[0]), PoolingParams(use_activation=False))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["pair"]
    assert outs[0].outputs.data == pytest.approx([logits[0]], abs=1e-4)


def test_second_segment_token_types_count(tmp_path):
    """BERT pairs: token type 1 on the second text; scoring the concatenation as one
    text (types all 0) gives another logit."""
    model_dir = make_encoder_dir(tmp_path / "r", "BertForSequenceClassification", seed=8,
                                 num_labels=1)
    llm = LLM(str(model_dir), runner="pooling", dtype="float32")
    tok = llm.get_tokenizer()
    (pair,) = llm.score(QUERY, DOCS[0], pooling_params=PoolingParams(use_activation=False))
    ids = tok(QUERY, DOCS[0])["input_ids"]
    engine = llm.llm_engine
    engine.add_request("flat", ids, PoolingParams(use_activation=False))
    (flat,) = engine.step()
    assert pair.outputs.score == pytest.approx(hf_logits(model_dir, [(QUERY, DOCS[0])])[0],
                                               abs=1e-4)
    assert abs(flat.outputs.data[0] - pair.outputs.score) > 1e-3


def test_identity_activation_from_the_config(reranker, tmp_path):
    plain = shutil.copytree(reranker, tmp_path / "identity")
    set_config(plain, sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    (out,) = LLM(str(plain), runner="pooling", dtype="float32").score(QUERY, DOCS[0])
    assert out.outputs.score == pytest.approx(hf_logits(reranker, [(QUERY, DOCS[0])])[0],
                                              abs=1e-4)


def test_refusals(reranker, tmp_path):
    llm = LLM(str(reranker), runner="pooling", dtype="float32")
    with pytest.raises(ValueError, match="task is 'classify'"):
        llm.embed(["hello"])
    with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 3"):
        llm.score(["a", "b"], ["c", "d", "e"])
    with pytest.raises(ValueError, match="dimensions applies to embeddings"):
        llm.score("a", "b", pooling_params=PoolingParams(dimensions=4))
    two = make_encoder_dir(tmp_path / "two", "BertForSequenceClassification", num_labels=2)
    with pytest.raises(ValueError, match="num_labels=2"):
        LLM(str(two), runner="pooling").score("a", "b")
    with pytest.raises(ValueError, match="runner='generate': .* is an encoder"):
        LLM(str(reranker), runner="generate")
    with pytest.raises(ValueError, match="convert='embed'"):
        LLM(str(reranker), runner="pooling", convert="embed")


def test_an_embedder_scores_by_cosine(bert_dir):
    llm = LLM(str(bert_dir), runner="pooling", dtype="float32")
    scores = llm.score(QUERY, DOCS)
    query = torch.tensor(llm.embed([QUERY])[0].outputs.embedding)
    for out, doc in zip(scores, DOCS):
        emb = torch.tensor(llm.embed([doc])[0].outputs.embedding)
        assert out.outputs.score == pytest.approx(
            torch.nn.functional.cosine_similarity(query, emb, dim=0).item(), abs=1e-5)
