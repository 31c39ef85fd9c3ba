"""Where a served model writes its workload trace, and where the next one goes.

The model's `trace_path` parameter (config.pbtxt, read through Triton's model-config API)
names the file on the server's machine. `--trace PATH` reads it at another path (a shared
volume mounted elsewhere); the folder is the same one either way. Each load with new
settings writes a new file beside the old one, `<stem>.tuned-<UTC time><suffix>`: two
instances run side by side during a reload, and a reused path would be truncated."""
from __future__ import annotations

import re
import time
from pathlib import Path, PurePath
from typing import Any

from tuning.apply import parameters
from tuning.trace_file import Trace

_TUNED = re.compile(r"\.tuned-\d{8}T\d{6}$")


def trace_path_of(config: dict[str, Any], model: str) -> str:
    path = parameters(config).get("trace_path", "")
    if not path:
        raise ValueError(f"model {model!r} records no trace: set its trace_path parameter "
                         "(config.pbtxt) and load it again")
    return path


def next_trace_path(path: str, stamp: str | None = None) -> str:
    """`path` with a new `.tuned-<UTC time>` tag before its suffix (replacing an old tag)."""
    stamp = stamp or time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    pure = PurePath(path)
    stem = _TUNED.sub("", pure.stem)
    return str(pure.with_name(f"{stem}.tuned-{stamp}{pure.suffix}"))


def local_path(server_path: str, local_trace: str | None) -> Path:
    """The file `server_path` names, read here: in --trace's folder when one is given."""
    if local_trace is None:
        return Path(server_path)
    return Path(local_trace).with_name(PurePath(server_path).name)


def wait_drained(path: Path, quiet_s: float = 3.0, timeout_s: float = 900.0) -> float:
    """The wall time the trace at `path` last grew, once it has not grown for `quiet_s`:
    after a reload, the old instance has then finished the requests it still held (a busy
    engine writes a record every step). Until then both instances share the CPUs."""
    deadline = time.monotonic() + timeout_s
    size, changed = -1, time.monotonic()
    while time.monotonic() < deadline:
        stat = path.stat()
        if stat.st_size != size:
            size, changed = stat.st_size, time.monotonic()
        elif time.monotonic() - changed >= quiet_s:
            return stat.st_mtime
        time.sleep(0.25)
    raise TimeoutError(f"{path} still grows {timeout_s:.0f} s after the reload")


def recent(trace: Trace, seconds: float | None) -> Trace:
    """The last `seconds` of the trace (all of it for None): requests that arrived and
    steps that started in that span."""
    if seconds is None or not trace.steps:
        return trace
    since = trace.steps[-1]["start"] - seconds
    return Trace(trace.header, [r for r in trace.requests if r["arrival"] >= since],
                 [s for s in trace.steps if s["start"] >= since])
