"""engine/output/output_processor.py without a model: real Requests, the SmolLM2 tokenizer's
detokenizer and the stop checker, stepped by a stand-in scheduler, for every output kind,
stream_interval 1 / 3 / 8 and n = 1 / 3."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig, SchedulerConfig
from engine.core.request import RequestStatus
from engine.output.output_processor import OutputProcessor
from engine.sampling_params import RequestOutputKind, SamplingParams
from testing.output_driver import EOS, Driver, scripted_logprobs

CUMULATIVE, DELTA, FINAL_ONLY = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                                 RequestOutputKind.FINAL_ONLY)
# Split characters (held until whole), clean-up spaces (" 's"), plain words, and an EOS.
TEXTS = [" 日本の首都は東京です。🙂 naïve café, ok", " Hello, world! It's fine, isn't it.",
         " The quick brown fox jumps over the lazy dog again and again"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.models.gguf_cache import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


def scripts_for(tokenizer, n):
    scripts = [tokenizer.encode(TEXTS[i % len(TEXTS)], add_special_tokens=False) for i in range(n)]
    scripts[-1] = scripts[-1] + [EOS]  # ended by EOS: released with the final output
    return scripts


@pytest.mark.parametrize("per_step", [1, 3])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("interval", [1, 3, 8])
@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY])
def test_every_token_text_and_logprob_is_handed_out_once(tokenizer, kind, interval, n, per_step):
    """per_step 3: steps give several tokens at once (accepted speculative drafts)."""
    driver = Driver(tokenizer, interval, tokens_per_step=per_step)
    params = SamplingParams(n=n, logprobs=1, max_tokens=None, output_kind=kind)
    requests = driver.add("r", params, scripts_for(tokenizer, n))
    outs = driver.run()
    assert [out.request_id for _, out in outs] == ["r"] * len(outs)
    assert outs[-1][1].finished and not any(out.finished for _, out in outs[:-1])
    if kind is FINAL_ONLY:
        assert len(outs) == 1
    texts, ids, logprobs = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    for _, out in outs:
        assert [c.index for c in out.outputs] == list(range(n))
        for c in out.outputs:
            texts[c.index] += c.delta_text
            ids[c.index] += c.delta_token_ids
            logprobs[c.index] += c.delta_logprobs
            if kind is not CUMULATIVE:  # DELTA's whole fields are its deltas; FINAL_ONLY's all
                assert (c.text, c.token_ids, c.logprobs) == (
                    c.delta_text, c.delta_token_ids, c.delta_logprobs)
            else:
                assert c.text == texts[c.index] and c.token_ids == ids[c.index]
    final = outs[-1][1]
    for request, c in zip(requests, final.outputs):
        assert ids[c.index] == request.output_token_ids
        assert texts[c.index] == request.detokenizer.output_text
        assert logprobs[c.index] == scripted_logprobs(request.output_token_ids)
        assert c.cumulative_logprob == pytest.approx(-0.001 * sum(request.output_token_ids))
    assert final.outputs[-1].finished_on_stop_token and final.outputs[-1].finish_reason == "stop"
    assert ids[-1][-1] == EOS and "\ufffd" not in "".join(texts)
    if kind is not FINAL_ONLY:
        # After the first, an output goes out only once `interval` tokens are held.
        for _, out in outs[1:-1]:
            assert max(len(c.delta_token_ids) for c in out.outputs) >= interval


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY])
def test_a_stop_string_cuts_what_is_handed_out(tokenizer, kind):
    driver = Driver(tokenizer, stream_interval=3)
    script = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    (request,) = driver.add("r", SamplingParams(max_tokens=None, stop=["lazy dog"],
                                                output_kind=kind), [script])
    outs = [out for _, out in driver.run()]
    assert "".join(o.outputs[0].delta_text for o in outs) == " The quick brown fox jumps over the "
    assert sum((o.outputs[0].delta_token_ids for o in outs), []) == request.output_token_ids
    assert outs[-1].outputs[0].stop_reason == "lazy dog" and len(script) > request.num_output_tokens


def plain_words(tokenizer, count):
    ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)[:count]
    assert len(ids) == count
    return ids


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
@pytest.mark.parametrize("interval, sent_at, sizes", [
    (1, list(range(1, 11)), [1] * 10), (3, [1, 4, 7, 10], [1, 3, 3, 3]),
    (8, [1, 9, 10], [1, 8, 1])])
def test_streams_send_the_first_tokens_at_once_then_every_interval_and_the_end(
        tokenizer, kind, interval, sent_at, sizes):
    # Plain words: each token is released in the step that sampled it.
    driver = Driver(tokenizer, interval)
    driver.add("r", SamplingParams(max_tokens=10, output_kind=kind), [plain_words(tokenizer, 10)])
    outs = driver.run()
    assert [step for step, _ in outs] == sent_at
    assert [len(out.outputs[0].delta_token_ids) for _, out in outs] == sizes
    assert outs[-1][1].outputs[0].finish_reason == "length"


def test_final_only_builds_one_output_per_request_and_nothing_before(tokenizer, monkeypatch):
    built = []
    original = OutputProcessor._output
    monkeypatch.setattr(OutputProcessor, "_output",
                        lambda self, seq: built.append(seq.request.request_id) or original(self, seq))
    driver = Driver(tokenizer)
    scripts = scripts_for(tokenizer, 3)
    requests = driver.add("p", SamplingParams(n=3, max_tokens=None, output_kind=FINAL_ONLY),
                          scripts)
    solo = driver.add("solo", SamplingParams(max_tokens=None, output_kind=FINAL_ONLY), scripts[:1])
    finals = {}
    while driver.running:
        for out in driver.step():
            assert out.finished and out.request_id not in finals
            finals[out.request_id] = out
        # The detokenizer keeps no release points for a request that releases once.
        assert not any(r.detokenizer._aligned for r in requests + solo)
    assert sorted(built) == sorted(r.request_id for r in requests + solo)  # once each, at its end
    parent = finals["p"]
    assert [c.text for c in parent.outputs] == [r.detokenizer.output_text for r in requests]
    assert [c.token_ids for c in parent.outputs] == [r.output_token_ids for r in requests]
    assert finals["solo"].outputs[0].text == parent.outputs[0].text


def test_delta_siblings_without_news_are_empty_and_cumulative_ones_whole(tokenizer):
    for kind in (DELTA, CUMULATIVE):
        driver = Driver(tokenizer)
        short, long = plain_words(tokenizer, 2), plain_words(tokenizer, 6)
        driver.add("p", SamplingParams(n=2, max_tokens=None, logprobs=0, output_kind=kind),
                   [short, long])
        outs = [out for _, out in driver.run()]
        after = outs[3].outputs[0]  # sequence 0 finished at step 2
        assert after.finish_reason == "length" and after.delta_token_ids == []
        whole = tokenizer.decode(short)
        assert (after.text, after.token_ids, after.logprobs) == (
            ("", [], []) if kind is DELTA else (whole, short, scripted_logprobs(short)))


def test_an_abort_hands_out_what_was_held(tokenizer):
    driver = Driver(tokenizer, stream_interval=8)
    (request,) = driver.add("r", SamplingParams(max_tokens=10, logprobs=0, output_kind=DELTA),
                            [plain_words(tokenizer, 10)])
    first = driver.step()
    assert len(first) == 1 and driver.step() == [] and driver.step() == []
    driver.running.clear()
    request.status = RequestStatus.FINISHED_ABORTED
    (last,) = driver.processor.abort([request])
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert first[0].outputs[0].token_ids + last.outputs[0].token_ids == request.output_token_ids
    assert len(last.outputs[0].logprobs) == 2
    assert driver.processor.abort([request]) == []


@pytest.mark.parametrize("kind, interval", [(FINAL_ONLY, 1), (DELTA, 3), (CUMULATIVE, 8)])
def test_token_timing_is_stamped_at_every_step_whatever_goes_out(tokenizer, kind, interval):
    driver = Driver(tokenizer, interval)
    driver.add("p", SamplingParams(n=2, max_tokens=7, output_kind=kind),
               [plain_words(tokenizer, 7)] * 2)
    outs = [out for _, out in driver.run()]
    gaps = [g for out in outs for g in out.metrics.inter_token_latencies]
    assert len(gaps) == 6 and all(g >= 0 for g in gaps)  # one per later step, not per sibling
    assert len({out.metrics.first_token_time for out in outs}) == 1
    assert outs[0].metrics.first_token_time is not None


def test_forget_drops_a_failed_request_without_output(tokenizer):
    driver = Driver(tokenizer)
    driver.add("p", SamplingParams(n=2, max_tokens=4), [plain_words(tokenizer, 4)] * 2)
    driver.step()
    driver.processor.forget(["0_p", "1_p"])
    assert "p" not in driver.processor and "0_p" not in driver.processor
    assert not driver.processor._clients and not driver.processor._sequences


def test_output_kind_and_stream_interval_are_validated():
    assert SamplingParams().output_kind is CUMULATIVE
    assert [k.value for k in (CUMULATIVE, DELTA, FINAL_ONLY)] == [0, 1, 2]
    for bad in (1, "DELTA", None):
        with pytest.raises(ValueError, match="SamplingParams.output_kind"):
            SamplingParams(output_kind=bad)
    assert SchedulerConfig().stream_interval == 1
    assert EngineConfig.from_dict({"stream_interval": "3"}).scheduler.stream_interval == 3
    for bad in ("0", "-2", "x", "1.5"):
        with pytest.raises(ValueError, match="stream_interval"):
            EngineConfig.from_dict({"stream_interval": bad})
