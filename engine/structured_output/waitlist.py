"""Requests whose grammar is still compiling: vLLM's WAITING_FOR_FSM, held by the engine
beside (not inside) the scheduler, which sees a request only once it can run."""
from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future
from dataclasses import dataclass

from engine.core.request import Request, RequestStatus
from engine.structured_output.grammar import RequestGrammar


@dataclass(slots=True)
class _Compiling:
    future: Future
    sequences: list[Request]  # n > 1: every sequence of the request shares the compile


@dataclass(slots=True)
class CompileFailure:
    request_id: str
    sequences: list[Request]
    error: BaseException


class GrammarWaitlist:
    def __init__(self) -> None:
        self._compiling: dict[str, _Compiling] = {}  # by client request id, oldest first
        self._owner: dict[str, str] = {}  # sequence id -> client request id

    def __len__(self) -> int:
        """Sequences waiting (what counts as waiting in the engine's stats)."""
        return len(self._owner)

    def add(self, request_id: str, future: Future, sequences: list[Request]) -> None:
        for request in sequences:
            request.status = RequestStatus.WAITING_FOR_FSM
            self._owner[request.request_id] = request_id
        self._compiling[request_id] = _Compiling(future, list(sequences))

    def take_done(self) -> tuple[list[Request], list[CompileFailure]]:
        """Sequences whose grammar is ready (each with its RequestGrammar, status WAITING,
        in the order they were added) and the requests whose compile failed; both leave
        the waitlist."""
        ready, failed = [], []
        for request_id, entry in list(self._compiling.items()):
            if not entry.future.done():
                continue
            self._drop(request_id)
            future = entry.future
            error = (RuntimeError("its grammar compile was cancelled (the engine is closing)")
                     if future.cancelled() else future.exception())
            if error is not None:
                failed.append(CompileFailure(request_id, entry.sequences, error))
                continue
            compiled = future.result()
            for request in entry.sequences:
                request.grammar = RequestGrammar.start(compiled)
                request.status = RequestStatus.WAITING
                ready.append(request)
        return ready, failed

    def abort(self, sequence_ids: list[str]) -> list[Request]:
        """Takes these sequences out, FINISHED_ABORTED. A request left with none has its
        compile cancelled if not started; one already running ends unread."""
        aborted = []
        for sequence_id in sequence_ids:
            request_id = self._owner.pop(sequence_id, None)
            if request_id is None:
                continue
            entry = self._compiling[request_id]
            request = next(r for r in entry.sequences if r.request_id == sequence_id)
            entry.sequences.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            aborted.append(request)
            if not entry.sequences:
                del self._compiling[request_id]
                entry.future.cancel()
        return aborted

    def wait(self, timeout: float) -> None:
        """Until a compile ends or `timeout` seconds pass (so the caller can look for
        new requests and cancellations meanwhile)."""
        futures = [entry.future for entry in self._compiling.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def _drop(self, request_id: str) -> None:
        entry = self._compiling.pop(request_id)
        for request in entry.sequences:
            self._owner.pop(request.request_id, None)
