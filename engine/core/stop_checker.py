"""The one place that decides whether a request stops after a new token.

The scheduler calls `check_stop` for each token it appends and applies the answer (it is
the only writer of a request's status); nothing else finishes a request except an abort.
The rules, in vLLM's order:
0. A structured-output request's grammar accepts the token first (the only place it
   advances, so it follows the appended output exactly). Its completion, the EOS it then
   alone allows, ends the request whatever min_tokens says; a token it refuses (the
   sampler's mask makes that impossible) aborts the request rather than emit text that
   breaks the promised format.
1. From min_tokens on, an id of the request's stop set (its EOS ids unless ignore_eos,
   plus stop_token_ids) ends it; so does the output ending with a stop_token_sequences
   entry (the token path's stop words, matched as ids).
2. The token's text is fed to the request's detokenizer, which cuts the text at a stop
   string; a stop string wins over rule 1. As in vLLM, the text of a stop id is left out
   unless include_stop_str_in_output.
3. Otherwise max_tokens or max_model_len ends it (finish reason "length").
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.request import Request, RequestStatus


@dataclass(slots=True, frozen=True)
class Stop:
    status: RequestStatus
    stop_reason: int | str | list[int] | None = None
    on_stop_token: bool = False  # ended by an EOS / stop_token_ids id (the last token)


_LENGTH = Stop(RequestStatus.FINISHED_LENGTH_CAPPED)
_EOS = Stop(RequestStatus.FINISHED_STOPPED, None, True)
_GRAMMAR_REFUSED = Stop(RequestStatus.FINISHED_ABORTED)


def check_stop(request: Request, token_id: int, max_model_len: int) -> Stop | None:
    """`token_id` was just appended to `request`; returns how it ends, or None."""
    params = request.sampling_params
    num_output = len(request.all_token_ids) - request.num_prompt_tokens
    grammar = request.grammar
    if grammar is not None and not grammar.accept(token_id):
        return _GRAMMAR_REFUSED
    stop = None
    if num_output >= params.min_tokens:
        if token_id in request.stop_token_ids:
            stop = (_EOS if not params.ignore_eos and token_id in request.eos_token_ids
                    else Stop(RequestStatus.FINISHED_STOPPED, token_id, True))
        elif request.stop_sequences_by_last is not None:
            sequence = _ended_sequence(request, token_id, num_output)
            if sequence is not None:
                stop = Stop(RequestStatus.FINISHED_STOPPED, list(sequence))
    if stop is None and grammar is not None and grammar.is_terminated:
        stop = _EOS  # the grammar's stop tokens are the model's EOS ids
    detokenizer = request.detokenizer
    if detokenizer is not None and not (stop is not None and stop.on_stop_token
                                        and not params.include_stop_str_in_output):
        stop_str = detokenizer.update([token_id])
        if stop_str is not None:
            return Stop(RequestStatus.FINISHED_STOPPED, stop_str)
    if stop is None and (len(request.all_token_ids) >= max_model_len or (
            request.max_tokens is not None and num_output >= request.max_tokens)):
        return _LENGTH
    return stop


def _ended_sequence(request: Request, token_id: int, num_output: int) -> tuple[int, ...] | None:
    candidates = request.stop_sequences_by_last.get(token_id)
    if candidates is None:
        return None
    ids = request.all_token_ids
    for sequence in candidates:
        n = len(sequence)
        # Output ids only: a stop word in the prompt's tail must not end the request.
        if n <= num_output and tuple(ids[-n:]) == sequence:
            return sequence
    return None
