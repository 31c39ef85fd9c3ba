"""Notices a python backend stub of tritonserver that died while its model stays loaded.

Seen with tritonserver 2.51: after a SIGKILL (or an OOM kill) of a stub, Triton keeps
the model READY and the requests that stub held never get a final response, so their
clients hang; only the next request finds the stub unhealthy. The requests are lost
inside Triton, and only the end of the tritonserver process ends their streams, so
scripts/serve.py asks this watch every second and restarts (or stops) the server.

Two kinds of stub run under the python backend (python_be.cc's StubLauncher): one per
model instance, named after the instance (`llm_0_0`: instance group and index), and,
while a model loads, a short-lived auto-complete stub named after the model itself
(`add_sub`), which exits by design once the config is filled in. Only instance stubs are
watched: the auto-complete one of a model that loads in under a second (a plain Python
model loaded at run time in explicit model-control mode) is gone by the next look while
the model is READY, and is no death.

A stub's exit status is its parent's (tritonserver's) to read, but until tritonserver reaps
it, a dead stub is a zombie whose /proc stat still holds it: a stub killed while its model
stays loaded stays one (nothing reaps it), so the watch names the signal.

Pure stdlib (serve.py runs it before the engine's heavy imports); Linux /proc."""
from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

STUB_NAME = b"triton_python_backend_stub"


@dataclass(frozen=True, slots=True)
class Stub:
    pid: int
    started: str  # /proc starttime: a recycled pid does not pass for this stub
    model: str  # the model whose model.py it runs
    instance: str  # Triton's instance name, e.g. llm_0_0

    @property
    def autocomplete(self) -> bool:
        """The model's auto-complete stub: it is named after the model, an instance stub
        after the instance (the group's name, which Triton suffixes with the index)."""
        return self.instance == self.model

    def alive(self) -> bool:
        stat = _stat(self.pid)
        return stat is not None and stat[19] == self.started and stat[0] != "Z"

    def exit_status(self) -> int | None:
        """Its wait status while it is a zombie not yet reaped (/proc stat's exit_code,
        Linux 3.5+); None once reaped (or recycled, or still running)."""
        stat = _stat(self.pid)
        if stat is None or stat[19] != self.started or stat[0] != "Z" or len(stat) < 50:
            return None
        return int(stat[49])


def describe_status(status: int | None) -> str:
    """A wait status in words: 'killed by SIGKILL', 'exit status 1'."""
    if status is None:
        return "exit status unknown (already reaped)"
    if status & 0x7F:
        number = status & 0x7F
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"killed by {name}"
    return f"exit status {(status >> 8) & 0xFF}"


def crashed(status: int | None) -> bool:
    """Died of a signal (a status serve learnt; an unknown one is not counted)."""
    return status is not None and bool(status & 0x7F)


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # [state, ppid, pgrp, ..., starttime at 19]


def stubs_of(pgid: int) -> list[Stub]:
    """The stubs in tritonserver's process group (they join it: backend/triton_server)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is None or stat[0] == "Z" or int(stat[2]) != pgid:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(STUB_NAME) or len(argv) < 9:
            continue
        # argv: stub, <repo>/<model>/<version>/model.py, shm region, sizes, parent pid,
        # backend dir, ipc key, instance name, ... (python_be.cc's stub launcher)
        model = Path(argv[1].decode(errors="replace")).parent.parent.name
        found.append(Stub(int(entry.name), stat[19], model, argv[8].decode(errors="replace")))
    return found


def model_state(http_url: str, model: str, timeout: float = 5.0,
                headers: dict[str, str] | None = None) -> str | None:
    """The model's state in Triton's repository index (READY, UNLOADING, ...); None if the
    server did not answer. `headers`: the admin key's, where serve.py --restrict-api
    put the repository API behind one."""
    request = urllib.request.Request(f"http://{http_url}/v2/repository/index", data=b"{}",
                                     method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            index = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return next((m.get("state") for m in index if m.get("name") == model), None)


def describe(stub: Stub, status: int | None = None) -> str:
    text = f"{stub.instance} (model {stub.model}, pid {stub.pid}"
    return text + (f", {describe_status(status)})" if status is not None else ")")


class StubDied(Exception):
    """A backend stub died under a loaded model (raised once tritonserver was killed)."""

    def __init__(self, stubs: list[Stub], statuses: dict[int, int | None] | None = None) -> None:
        statuses = statuses or {}
        super().__init__(", ".join(describe(s, statuses.get(s.pid)) for s in stubs))
        self.stubs = stubs


@dataclass(slots=True)
class StubWatch:
    """Call `died()` now and then; it returns the stubs gone since the last call whose
    model Triton still counts as loaded (a stub leaving with its unloaded model is fine, and
    so is one that left cleanly for a new stub of the same instance: a reload).
    A death seen while the server does not answer (busy past the timeout) is asked about
    again at the next call, not forgotten: forgotten, its requests would hang for good."""
    pgid: int
    http_url: str
    headers: dict[str, str] | None = None  # for the repository API (restricted_api)
    known: dict[int, Stub] = field(default_factory=dict)
    unanswered: list[Stub] = field(default_factory=list)  # gone; model state not known yet
    # pid -> wait status of the stubs seen gone (None: reaped before the watch looked).
    statuses: dict[int, int | None] = field(default_factory=dict)

    def _gone(self) -> list[Stub]:
        """Instance stubs gone since the last look (their statuses noted), then a new look."""
        gone = []
        for stub in self.known.values():
            if not stub.alive():
                self.statuses[stub.pid] = stub.exit_status()
                gone.append(stub)
        self.known = {stub.pid: stub for stub in stubs_of(self.pgid) if not stub.autocomplete}
        return gone

    def died(self) -> list[Stub]:
        gone = self.unanswered + self._gone()
        dead, self.unanswered = [], []
        running = {(stub.model, stub.instance) for stub in self.known.values()}
        for stub in gone:
            if (stub.model, stub.instance) in running and not crashed(self.statuses.get(stub.pid)):
                # Reaped (or exited) and a stub of the same instance runs now: the model was
                # unloaded and loaded again between two looks (a plain Python model does
                # that within a second), or Triton restarted an unhealthy stub and failed
                # its requests itself. A killed stub under a loaded model is never reaped,
                # so it still reads as a zombie killed by its signal.
                continue
            state = model_state(self.http_url, stub.model, headers=self.headers)
            if state is None:
                self.unanswered.append(stub)
            elif state == "READY":
                dead.append(stub)
        return dead

    def crashed_while_stopping(self) -> list[tuple[Stub, int | None]]:
        """For a graceful stop, when stubs leave with their models: the stubs gone since
        the last call that died of a signal, with their statuses. The model state is not
        asked (the server is unloading everything); a stub that exited normally, or that
        tritonserver reaped before the watch looked, is not reported."""
        return [(stub, self.statuses[stub.pid]) for stub in self._gone()
                if crashed(self.statuses[stub.pid])]
