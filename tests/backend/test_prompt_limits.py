"""backend.prompt_limits: the text_input byte limit checked before tokenizing, which must
never refuse a prompt that fits max_model_len."""
from __future__ import annotations

import numpy as np
import pytest

from backend.prompt_limits import check_prompt_size, longest_token_bytes, max_prompt_bytes
from backend.request_parsing import InvalidRequest


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.models.gguf_cache import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


def test_byte_limit_never_refuses_a_prompt_that_fits(tokenizer):
    longest = longest_token_bytes(tokenizer)
    max_model_len = 64
    limit = max_prompt_bytes(max_model_len, longest)
    # The worst case that still fits: every token is the vocabulary's longest text.
    widest = max((tokenizer.decode([i]) for i in tokenizer.get_vocab().values()),
                 key=lambda t: len(t.encode()))
    text = widest * (max_model_len - 1)
    assert len(tokenizer.encode(text)) < max_model_len
    check_prompt_size(np.array([text.encode()], dtype=np.object_), limit, max_model_len)
    with pytest.raises(InvalidRequest, match=r"text_input is \d+ bytes.*max_model_len=64"):
        check_prompt_size(np.array([b"x" * (limit + 1)], dtype=np.object_), limit, max_model_len)


def test_byte_limit_leaves_odd_inputs_to_the_parser():
    check_prompt_size(None, 10, 4)
    check_prompt_size(np.array([b"x" * 100, b"y"], dtype=np.object_), 10, 4)
    with pytest.raises(InvalidRequest):
        check_prompt_size(np.array(["é" * 6], dtype=np.object_), 10, 4)  # 12 bytes as UTF-8
