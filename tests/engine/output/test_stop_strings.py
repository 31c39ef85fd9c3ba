"""Stop strings: the Aho-Corasick matcher against a naive reference on a one-token-per-
character tokenizer, its work bounds, the detokenizer's hold-back, and the stop limits."""
import random
from array import array

import pytest
from hypothesis import given, settings, strategies as st

from engine.output.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.output.stop_strings import StopAutomaton, StopMatcher
from engine.sampling_params import (MAX_STOP_CHARS_TOTAL, MAX_STOP_SEQUENCE_IDS,
                                    MAX_STOP_SEQUENCE_IDS_TOTAL, MAX_STOP_STRINGS,
                                    MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS,
                                    MAX_STOP_TOKEN_SEQUENCES, check_stop_limits)
from tests.engine.output.test_detokenizer import delta_text


class CharTokenizer:
    """One token per character (id = code point): stop-string tests choose every split."""

    clean_up_tokenization_spaces = False

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(map(chr, ids))


def reference_first_stop(text, stops):
    """(start, end, stop) of the stop string that ends first in text, longest at that end."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return end - len(stop), end, stop
    return None


def reference_partial_len(text, stops):
    """Longest tail of text that is a proper prefix of a stop string (the old scan)."""
    return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1)
                if text.endswith(s[:n])), default=0)


def split(data, text):
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(text) - 1, 1)), max_size=len(text))))
    bounds = [0, *[c for c in cuts if c < len(text)], len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


# A small alphabet makes overlapping and nested stop strings (and so failure links) common.
stop_text = st.text(alphabet="ab c", min_size=1, max_size=6)


def text_near(data, stops, max_pieces):
    """Text built from prefixes of the stops and stray characters: partial matches that
    break off and resume are what exercise the failure links."""
    prefixes = sorted({s[:n] for s in stops for n in range(1, len(s) + 1)})
    piece = st.one_of(st.sampled_from(prefixes), st.text(alphabet="ab cd", max_size=2))
    return "".join(data.draw(st.lists(piece, max_size=max_pieces)))


@settings(max_examples=400, deadline=None)
@given(data=st.data(), stops=st.lists(stop_text, min_size=1, max_size=8))
def test_property_matcher_equals_naive_reference(data, stops):
    text = text_near(data, stops, 12)
    matcher, fed = StopMatcher(stops), ""
    for piece in split(data, text):
        match = matcher.feed(fed + piece, len(fed))
        fed += piece
        expected = reference_first_stop(fed, stops)
        if match is not None:
            start, end = match
            assert expected == (start, end, fed[start:end])
            assert end > len(fed) - len(piece)  # it ends in the new piece: nothing was missed
            return
        assert expected is None
        assert matcher.partial_len == reference_partial_len(fed, stops)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), stops=st.lists(stop_text, min_size=1, max_size=6), include=st.booleans())
def test_property_stream_holds_back_exactly_the_partial_stop(data, stops, include):
    text = text_near(data, stops, 8)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(CharTokenizer(), [], params)
    expected = reference_first_stop(text, stops)
    final = text if expected is None else text[:expected[1] if include else expected[0]]
    streamed, fed, stop = "", "", None
    for piece in split(data, text):
        for char in piece:  # one token per update, as the engine feeds them
            stop = detok.update([ord(char)])
            fed += char
            if stop is not None:
                break
        streamed += delta_text(detok, len(fed), finished=stop is not None)
        if stop is not None:
            break
        # Everything but the tail that could still begin a stop string is out, no more.
        assert streamed == fed[:len(fed) - reference_partial_len(fed, stops)]
    if stop is None:
        streamed += delta_text(detok, len(fed), finished=True)
    assert stop == (expected and expected[2])
    assert streamed == detok.output_text == final


@pytest.mark.parametrize("stops, text", [
    (["aab"], "aaab"),  # a partial match breaks off and a shorter one carries on
    (["a a", "  "], "a  "),  # the failure link crosses to another stop string
    # Building "ababc" needs two failure links ("ab", then "b") to reach the node "bc".
    (["ababca", "bc"], "ababc"),
    (["ababca", "bcd"], "ababcd"),  # the same link, then a further edge from it
])
def test_matcher_follows_failure_chains(stops, text):
    for pieces in ([text], list(text)):
        matcher, fed, match = StopMatcher(stops), "", None
        for piece in pieces:
            fed += piece
            match = match or matcher.feed(fed, len(fed) - len(piece))
        assert match == reference_first_stop(text, stops)[:2]


def test_stop_ending_first_wins_however_the_text_is_split():
    stops = ["Human:", "man"]
    for pieces in (["Human:"], ["Hu", "man", ":"], list("Human:")):
        detok = IncrementalDetokenizer(CharTokenizer(), [], SamplingParams(stop=stops))
        got = [detok.update([ord(c) for c in p]) for p in pieces]
        assert "man" in got and detok.output_text == "Hu"


def test_longest_of_stops_ending_together_is_reported():
    params = SamplingParams(stop=["n:", "Human:"], include_stop_str_in_output=False)
    detok = IncrementalDetokenizer(CharTokenizer(), [], params)
    assert detok.update([ord(c) for c in "Hi Human: x"]) == "Human:"
    assert detok.output_text == "Hi "


class CountingArray(array):
    """An automaton array that counts reads: the matcher's work, without a clock."""

    reads = 0

    def __getitem__(self, index):
        type(self).reads += 1
        return super().__getitem__(index)


def test_matcher_work_is_bounded_by_new_text_not_by_the_stops():
    rng = random.Random(0)
    # The case: 200 stops of 1,000 characters, 4,000 characters of output.
    stops = ["".join(rng.choice("abc ") for _ in range(1000)) for _ in range(200)]
    automaton = StopAutomaton(stops)
    automaton.fail = CountingArray("i", automaton.fail)
    CountingArray.reads = 0
    matcher = StopMatcher(["unused"])  # cheap to build; its automaton is swapped for ours
    matcher.automaton = automaton
    # Output that keeps entering long partial matches and leaving them: the costly case.
    text = ""
    while len(text) < 4000:
        text += rng.choice(stops)[:rng.randint(1, 300)] + "d"
    text = text[:4000]
    fed, fail_reads_before = 0, 0
    while fed < len(text):
        depth_before, new = matcher.partial_len, rng.randint(1, 8)
        assert matcher.feed(text[:fed + new], fed) is None
        fed = min(fed + new, len(text))
        # Each failure link lowers the depth, each character raises it by at most one.
        assert CountingArray.reads - fail_reads_before <= depth_before + new
        fail_reads_before = CountingArray.reads
    assert matcher.partial_len == reference_partial_len(text, stops)
    # Over the stream: amortized O(1) per character (and the text did take failure links).
    assert 0 < CountingArray.reads <= len(text)


class RecordingMatcher:
    """A StopMatcher that records the span of text each feed was asked to cover."""

    def __init__(self, inner):
        self.inner, self.spans = inner, []

    @property
    def partial_len(self):
        return self.inner.partial_len

    def feed(self, text, start):
        self.spans.append((start, len(text)))
        return self.inner.feed(text, start)


def test_detokenizer_feeds_each_character_to_the_matcher_once():
    detok = IncrementalDetokenizer(CharTokenizer(), [], SamplingParams(stop=["xyz", "zzz"]))
    detok._stop_matcher = recorder = RecordingMatcher(detok._stop_matcher)
    for word in ["hello", " ", "wor", "ld", " ", "xy", "z!"]:
        if detok.update([ord(c) for c in word]) is not None:
            break
    assert detok.stop_str == "xyz"
    starts = [start for start, _ in recorder.spans]
    ends = [end for _, end in recorder.spans]
    assert starts == [0] + ends[:-1]  # each feed begins where the last one ended: no rescans


def test_stop_limits_accept_the_maximum_and_reject_beyond_it():
    check_stop_limits(["x" * 64] * MAX_STOP_STRINGS, list(range(MAX_STOP_TOKEN_IDS)))
    longest_fitting = MAX_STOP_CHARS_TOTAL // MAX_STOP_STRING_CHARS
    check_stop_limits(["x" * MAX_STOP_STRING_CHARS] * longest_fitting, [])
    too_many = ["x"] * (MAX_STOP_STRINGS + 1)
    too_long = ["x" * (MAX_STOP_STRING_CHARS + 1)]
    too_much = ["x" * MAX_STOP_STRING_CHARS] * (longest_fitting + 1)
    for stop, ids, field in [(too_many, [], "stop"), (too_long, [], "stop"), (too_much, [], "stop"),
                             ([], list(range(MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids")]:
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field} .*at most"):
            check_stop_limits(stop, ids)


def test_stop_token_sequence_limits():
    check_stop_limits([], [], [[1] * MAX_STOP_SEQUENCE_IDS] * (MAX_STOP_SEQUENCE_IDS_TOTAL
                                                             // MAX_STOP_SEQUENCE_IDS))
    for sequences in ([[1]] * (MAX_STOP_TOKEN_SEQUENCES + 1), [[1] * (MAX_STOP_SEQUENCE_IDS + 1)],
                      [[1] * MAX_STOP_SEQUENCE_IDS] * (MAX_STOP_SEQUENCE_IDS_TOTAL
                                                      // MAX_STOP_SEQUENCE_IDS + 1)):
        with pytest.raises(ValueError, match=r"SamplingParams\.stop_token_sequences"):
            SamplingParams(stop_token_sequences=sequences)
