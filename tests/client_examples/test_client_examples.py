"""Pure-logic tests for client_examples/ (no server): stats, token counting, workload, SSE, ChatML."""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # client_examples is not an installed package

from client_examples.bench_serving import parse_levels, parse_range  # noqa: E402
from client_examples.bench_stats import (  # noqa: E402
    TOKENS_FROM_SERVER, TOKENS_FROM_WORDS, LatencySummary, format_table, percentile, request_metrics,
    summarize_level,
)
from client_examples.bench_workload import WORDS, WorkloadSpec, make_requests, poisson_arrival_times  # noqa: E402
from client_examples.common import (  # noqa: E402
    ChatMessage, GenerationRecord, StreamChunk, chunk_from_arrays, clean_assistant_reply, format_chatml,
    generate_request_body, iter_sse_data, sampling_parameters,
)
from client_examples.grpc_chat import ChatSession  # noqa: E402


def record(send, chunks, end=None, error=None):
    chunks = [StreamChunk(*c) if isinstance(c, tuple) else c for c in chunks]
    if end is None and error is None:
        end = chunks[-1].t
    return GenerationRecord(send_time=send, chunks=chunks, end_time=end, error=error)


# --- percentile -------------------------------------------------------------------------

@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    values = list(np.random.default_rng(1).exponential(size=37))
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_small_cases():
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0  # unsorted input
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_latency_summary_converts_to_ms():
    s = LatencySummary.of_seconds([0.010, 0.020, 0.030])
    assert (s.count, s.p50, s.mean) == (3, pytest.approx(20.0), pytest.approx(20.0))
    assert math.isnan(LatencySummary.of_seconds([]).p50)


# --- per-request metrics ----------------------------------------------------------------

def test_metrics_with_server_token_counts():
    # t=0 send; first text at 0.10 (1 token); 0.15 brings 1 token; 0.25 brings 2 (gap 0.1 -> 0.05 each);
    # then an empty final response at 0.26. Counts are per response, as the server streams them.
    r = record(0.0, [(0.10, "a", 1), (0.15, " b", 1), (0.25, " c d", 2), (0.26, "", 0, None, True)])
    m = request_metrics(r)
    assert m.token_source == TOKENS_FROM_SERVER
    assert m.ttft == pytest.approx(0.10)
    assert m.itl == pytest.approx([0.05, 0.05, 0.05])
    assert m.e2e == pytest.approx(0.26)
    assert m.output_tokens == 4


def test_ttft_skips_empty_leading_responses():
    r = record(1.0, [(1.05, "", 0), (1.20, "hi", 1), (1.30, " there", 1, "length", True)])
    m = request_metrics(r)
    assert m.ttft == pytest.approx(0.20)
    assert m.itl == pytest.approx([0.10])


def test_word_fallback_counts_words_of_accumulated_text():
    # "hel" + "lo" is one word split over two responses; its gap rolls into " world".
    r = record(0.0, [(0.1, "hel"), (0.2, "lo"), (0.3, " world"), (0.4, " big wide", None, None, True)])
    m = request_metrics(r)
    assert m.token_source == TOKENS_FROM_WORDS
    assert m.output_tokens == 4
    assert m.itl == pytest.approx([0.2, 0.05, 0.05])


def test_metrics_reject_failed_request():
    with pytest.raises(ValueError):
        request_metrics(record(0.0, [(0.1, "a", 1)], error="boom"))


def test_summarize_level_throughput_and_failures():
    ok1 = record(0.0, [(0.1, "a", 1), (0.2, " b", 1, "length", True)])
    ok2 = record(0.5, [(0.7, "x", 1), (0.8, " y", 1), (0.9, " z", 1, "length", True)])
    bad = record(0.0, [], error="Request was cancelled")
    lv = summarize_level("concurrency", 2, [ok1, ok2, bad], [2, 2, 2], duration_s=2.0)
    assert (lv.completed, lv.failed, lv.output_tokens) == (2, 1, 5)
    assert lv.output_tokens_per_s == pytest.approx(2.5)
    assert lv.requests_per_s == pytest.approx(1.0)
    assert lv.length_mismatches == 1  # ok2 produced 3 tokens for max_tokens 2
    assert lv.ttft_ms.p50 == pytest.approx(150.0)
    assert lv.itl_ms.count == 3
    assert lv.tpot_ms.p50 == pytest.approx(100.0)
    assert lv.errors == ["Request was cancelled"]
    assert lv.label == "conc 2"
    table = format_table([lv, summarize_level("rate", math.inf, [ok1], [2], 1.0)])
    assert "conc 2" in table and "rate inf" in table and "2/1" in table


# --- workload -----------------------------------------------------------------------------

def test_workload_is_seeded_and_in_range():
    spec = WorkloadSpec(200, (3, 7), (10, 12), seed=42)
    a, b = make_requests(spec), make_requests(spec)
    assert a == b
    assert make_requests(WorkloadSpec(200, (3, 7), (10, 12), seed=43)) != a
    lengths = {len(r.prompt.split()) for r in a}
    assert lengths == set(range(3, 8))  # 200 draws cover the whole range
    assert {r.output_tokens for r in a} == {10, 11, 12}
    assert all(w in WORDS for r in a for w in r.prompt.split())


def test_sampling_makes_lengths_exact():
    r = make_requests(WorkloadSpec(1, (1, 1), (9, 9)))[0]
    assert r.sampling() == {"max_tokens": 9, "min_tokens": 9, "ignore_eos": True, "temperature": 0.0}


def test_workload_rejects_bad_ranges():
    with pytest.raises(ValueError):
        make_requests(WorkloadSpec(1, (5, 2), (1, 1)))


def test_poisson_arrivals_have_requested_rate():
    times = poisson_arrival_times(4000, rate=8.0, seed=0)
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 8.0, rel=0.1)  # exponential: std == mean
    assert poisson_arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    assert poisson_arrival_times(50, 2.0, 7) == poisson_arrival_times(50, 2.0, 7)


def test_level_and_range_parsing():
    assert parse_levels("1, 4,16") == [1.0, 4.0, 16.0]
    assert parse_levels("2,inf")[1] == math.inf
    assert parse_levels("") == []
    assert parse_range("32") == (32, 32) and parse_range("16:64") == (16, 64)
    with pytest.raises(Exception):
        parse_range("9:3")


# --- protocol helpers ---------------------------------------------------------------------

def test_sse_parsing():
    lines = [b'data: {"text_output":"Hel"}', b"", b": keep-alive", b"", "data: {\"text_output\":\"lo\"}\r", "",
             b'data: {"error":"bad"}']  # last event without a trailing blank line
    assert list(iter_sse_data(lines)) == [{"text_output": "Hel"}, {"text_output": "lo"}, {"error": "bad"}]
    multi = ['data: {"a":', "data: 1}", ""]
    assert list(iter_sse_data(multi)) == [{"a": 1}]


def test_chunk_from_arrays():
    c = chunk_from_arrays(1.0, np.array([b"hi ", b"there"], dtype=object), np.array([3], dtype=np.uint32),
                          np.array([b"stop"], dtype=object), True)
    assert (c.text, c.num_output_tokens, c.finish_reason, c.final) == ("hi there", 3, "stop", True)
    empty = chunk_from_arrays(2.0, None, None, np.array([b""], dtype=object), True)
    assert (empty.text, empty.num_output_tokens, empty.finish_reason) == ("", None, None)


def test_generate_request_body_and_sampling():
    s = sampling_parameters(32, 0, top_p=None, seed=3)
    assert s == {"max_tokens": 32, "temperature": 0.0, "seed": 3}
    body = generate_request_body("hi", s, stream=True)
    assert body["text_input"] == "hi" and body["stream"] is True and body["exclude_input_in_output"] is True
    assert body["parameters"] == s and body["return_num_output_tokens"] is True
    json.dumps(body)


def test_chatml_format():
    text = format_chatml([ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert clean_assistant_reply(" Hello!<|im_end|>\n junk") == "Hello!"


class FakeStream:
    """Stands in for GrpcStreamSession: replies with fixed text and remembers prompts."""

    def __init__(self, replies, fail_on=None):
        self.replies, self.prompts, self.fail_on = list(replies), [], fail_on

    def generate(self, prompt, sampling, on_chunk=None, timeout_s=600.0):
        self.prompts.append(prompt)
        if self.fail_on == len(self.prompts):
            return GenerationRecord(0.0, [], None, "server said no")
        chunks = [StreamChunk(0.1, w) for w in self.replies.pop(0)] + [StreamChunk(0.2, "", final=True)]
        for c in chunks:
            if on_chunk and c.text:
                on_chunk(c)
        return GenerationRecord(0.0, chunks, 0.2)


def test_chat_session_keeps_history_and_streams(capsys):
    fake = FakeStream([["Hel", "lo!"], ["Fine", "."]], fail_on=3)
    chat = ChatSession(fake, "sys", {"max_tokens": 8})
    assert chat.ask("Hi") == "Hello!"
    assert chat.ask("How are you?") == "Fine."
    assert capsys.readouterr().out == "Hello!\nFine.\n"
    assert fake.prompts[1] == format_chatml([ChatMessage("system", "sys"), ChatMessage("user", "Hi"),
                                             ChatMessage("assistant", "Hello!"),
                                             ChatMessage("user", "How are you?")])
    with pytest.raises(RuntimeError, match="server said no"):
        chat.ask("third")
    assert len(chat.history) == 4  # the failed turn was not kept
    chat.reset()
    assert chat.history == []
