"""engine.core.stop_checker: check_stop's rules in their order (grammar, stop ids and id
sequences from min_tokens on, stop strings through the detokenizer, then length), on
its own; then as the scheduler applies them, dropping the tokens after a stop."""
import pytest

from engine.core.request import Request, RequestStatus
from engine.core.stop_checker import Stop, check_stop
from engine.output.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.structured_output.grammar import RequestGrammar
from testing.sched_invariants import check_drained
from tests.engine.core.test_scheduler import make, req
from tests.engine.output.test_stop_strings import CharTokenizer

STOPPED = RequestStatus.FINISHED_STOPPED
EOS = 2


def request(prompt=(5, 6), detokenize=False, **params) -> Request:
    params.setdefault("max_tokens", 16)
    r = Request("r", list(prompt), SamplingParams(**params), eos_token_id=EOS)
    if detokenize:
        r.detokenizer = IncrementalDetokenizer(CharTokenizer(), r.prompt_token_ids,
                                               r.sampling_params)
    return r


def feed(r: Request, *tokens: int, max_model_len: int = 1000) -> Stop | None:
    """Appends the tokens one by one as the scheduler does; check_stop's answer for the last."""
    stop = None
    for token in tokens:
        assert stop is None, "a token after the stop"
        r.all_token_ids.append(token)
        stop = check_stop(r, token, max_model_len)
    return stop


def test_stop_ids_end_from_min_tokens_on_and_eos_has_no_stop_reason():
    assert feed(request(min_tokens=2, stop_token_ids=[9]), EOS, 9) == Stop(STOPPED, 9, True)
    assert feed(request(min_tokens=2, stop_token_ids=[9]), 9, 4, EOS) == Stop(STOPPED, None, True)
    assert feed(request(stop_token_ids=[9]), 9) == Stop(STOPPED, 9, True)


def test_ignore_eos_leaves_eos_to_length_but_not_the_stop_ids():
    assert feed(request(max_tokens=3, ignore_eos=True), EOS, EOS, EOS) == Stop(
        RequestStatus.FINISHED_LENGTH_CAPPED)
    assert feed(request(ignore_eos=True, stop_token_ids=[9]), EOS, 9) == Stop(STOPPED, 9, True)


def test_a_stop_on_the_last_allowed_token_is_a_stop_not_length():
    length = Stop(RequestStatus.FINISHED_LENGTH_CAPPED)
    assert feed(request(max_tokens=2, stop_token_ids=[9]), 4, 9) == Stop(STOPPED, 9, True)
    assert feed(request(max_tokens=2), 4, 4) == length
    # max_model_len counts the prompt: two prompt tokens and two output tokens fill 4.
    assert feed(request(), 4, EOS, max_model_len=4) == Stop(STOPPED, None, True)
    assert feed(request(), 4, 4, max_model_len=4) == length


def test_id_sequences_match_output_ids_only_and_are_not_stop_tokens():
    prompt_tail = request(prompt=(5, 1), stop_token_sequences=[[1, 3]])
    assert feed(prompt_tail, 3) is None  # [1, 3] only across the prompt
    assert feed(prompt_tail, 1, 3) == Stop(STOPPED, [1, 3], False)
    early = request(min_tokens=3, stop_token_sequences=[[7, 8]])
    assert feed(early, 7, 8) is None and feed(early, 7, 8) == Stop(STOPPED, [7, 8], False)


@pytest.mark.parametrize("include", [False, True])
def test_stop_id_text_is_left_out_unless_asked_and_a_stop_string_then_wins(include):
    bang = ord("!")
    r = request(detokenize=True, stop_token_ids=[bang], include_stop_str_in_output=include)
    assert feed(r, *map(ord, "hi!")) == Stop(STOPPED, bang, True)
    assert r.detokenizer.output_text == ("hi!" if include else "hi")
    # With "!" also a stop string, the detokenizer sees the id's text only when included.
    r = request(detokenize=True, stop=["!"], stop_token_ids=[bang],
                include_stop_str_in_output=include)
    expected = Stop(STOPPED, "!") if include else Stop(STOPPED, bang, True)
    assert feed(r, *map(ord, "hi!")) == expected


def test_a_stop_string_ends_the_request_on_an_ordinary_token():
    r = request(detokenize=True, stop=["cd"])
    assert feed(r, *map(ord, "ab")) is None and feed(r, ord("c"), ord("d")) == Stop(STOPPED, "cd")
    assert r.detokenizer.output_text == "ab"


class ScriptedMatcher:
    """Stands in for xgrammar's GrammarMatcher: accepts exactly `script` (which ends with
    the EOS, the grammar's stop token), and is terminated once all of it is in."""

    def __init__(self, script):
        self.script, self.pos = list(script), 0

    def accept_token(self, token_id):
        if self.pos < len(self.script) and self.script[self.pos] == token_id:
            self.pos += 1
            return True
        return False

    def is_terminated(self):
        return self.pos == len(self.script)


def constrained(script, **params) -> Request:
    r = request(**params)
    r.grammar = RequestGrammar(ScriptedMatcher(script))
    return r


def test_the_grammar_accepts_first_and_its_end_overrides_min_tokens_and_ignore_eos():
    done = constrained([4, EOS], min_tokens=10, ignore_eos=True)
    assert feed(done, 4) is None and feed(done, EOS) == Stop(STOPPED, None, True)
    # A token the grammar refuses aborts, even a stop id.
    assert feed(constrained([4, EOS], stop_token_ids=[9]), 9) == Stop(RequestStatus.FINISHED_ABORTED)
    refused = constrained([4, EOS])
    assert feed(refused, 4) is None and refused.grammar.matcher.pos == 1
    assert feed(refused, 4) == Stop(RequestStatus.FINISHED_ABORTED)


def test_stop_rules():
    s = make()
    s.add_request(req("eos", 3, eos=2))
    s.add_request(req("ignore", 3, eos=2, ignore_eos=True, max_tokens=2))
    s.add_request(req("stopid", 3, stop_token_ids=[9]))
    s.add_request(req("min", 3, eos=2, min_tokens=2))
    out = s.schedule()
    got = s.update_from_output(out, {"eos": [2], "ignore": [2], "stopid": [5], "min": [2]})
    assert [r.request_id for r in got] == ["eos", "ignore", "stopid", "min"]
    fin = [r for r in got if r.is_finished]
    assert [r.request_id for r in fin] == ["eos"]
    assert fin[0].finish_reason == "stop" and fin[0].stop_reason is None
    out = s.schedule()
    # Tokens after a stop in the same step are dropped.
    fin = s.update_from_output(out, {"ignore": [2], "stopid": [9, 4, 4], "min": [2]})
    assert all(r.is_finished for r in fin)
    by_id = {r.request_id: r for r in fin}
    assert by_id["ignore"].finish_reason == "length" and by_id["ignore"].output_token_ids == [2, 2]
    assert by_id["stopid"].output_token_ids == [5, 9] and by_id["stopid"].stop_reason == 9
    assert by_id["min"].finish_reason == "stop" and by_id["min"].num_output_tokens == 2
    check_drained(s)


def test_stop_token_sequences_match_output_ids_only():
    s = make()
    prompt = [5, 6, 1, 2]
    s.add_request(req("seq", prompt, stop_token_sequences=[[1, 2, 3], [9]]))
    s.add_request(req("min", prompt, stop_token_sequences=[[9]], min_tokens=2))
    # The prompt ends with 1, 2: the first 3 completes [1, 2, 3] only across the prompt,
    # and min's first 9 comes before min_tokens.
    finished = {}
    for sampled in ({"seq": [3], "min": [9]}, {"seq": [1], "min": [4]},
                    {"seq": [2], "min": [9]}, {"seq": [3]}):
        for r in s.update_from_output(s.schedule(), sampled):
            if r.is_finished:
                finished[r.request_id] = r
    assert finished["min"].stop_reason == [9] and finished["min"].output_token_ids == [9, 4, 9]
    assert finished["seq"].stop_reason == [1, 2, 3]
    assert finished["seq"].output_token_ids == [3, 1, 2, 3]
    assert not finished["seq"].finished_on_stop_token
    check_drained(s)


def test_eos_and_stop_ids_mark_the_request_as_ended_on_a_stop_token():
    s = make()
    s.add_request(req("eos", 3, eos=(2, 4)))
    s.add_request(req("id", 3, stop_token_ids=[9]))
    s.add_request(req("len", 3, max_tokens=1))
    fin = {r.request_id: r for r in s.update_from_output(s.schedule(),
                                                         {"eos": [4], "id": [9], "len": [4]})}
    assert fin["eos"].finished_on_stop_token and fin["eos"].stop_reason is None
    assert fin["id"].finished_on_stop_token and fin["id"].stop_reason == 9
    assert fin["len"].finish_reason == "length" and not fin["len"].finished_on_stop_token
    check_drained(s)
