"""Notices a python backend stub of tritonserver that died while its model stays loaded.

Seen with tritonserver 2.51: after a SIGKILL (or an OOM kill) of a stub, Triton keeps
the model READY and the requests that stub held never get a final response, so their
clients hang; only the next request finds the stub unhealthy. The requests are lost
inside Triton, and only the end of the tritonserver process ends their streams, so
scripts/serve.py asks this watch every second and restarts (or stops) the server.

Pure stdlib (serve.py runs it before the engine's heavy imports); Linux /proc."""
from __future__ import annotations

import json
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

    def alive(self) -> bool:
        stat = _stat(self.pid)
        return stat is not None and stat[19] == self.started and stat[0] != "Z"


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


class StubDied(Exception):
    """A backend stub died under a loaded model (raised once tritonserver was killed)."""

    def __init__(self, stubs: list[Stub]) -> None:
        super().__init__(", ".join(f"{s.instance} (model {s.model}, pid {s.pid})" for s in stubs))
        self.stubs = stubs


@dataclass(slots=True)
class StubWatch:
    """Call `died()` now and then; it returns the stubs gone since the last call whose
    model Triton still counts as loaded (a stub leaving with its unloaded model is fine).
    A death seen while the server does not answer (busy past the timeout) is asked about
    again at the next call, not forgotten: forgotten, its requests would hang for good."""
    pgid: int
    http_url: str
    headers: dict[str, str] | None = None  # for the repository API (restricted_api)
    known: dict[int, Stub] = field(default_factory=dict)
    unanswered: list[Stub] = field(default_factory=list)  # gone; model state not known yet

    def died(self) -> list[Stub]:
        gone = self.unanswered + [stub for stub in self.known.values() if not stub.alive()]
        self.known = {stub.pid: stub for stub in stubs_of(self.pgid)}
        dead, self.unanswered = [], []
        for stub in gone:
            state = model_state(self.http_url, stub.model, headers=self.headers)
            if state is None:
                self.unanswered.append(stub)
            elif state == "READY":
                dead.append(stub)
        return dead
