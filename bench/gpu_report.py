"""Running the GPU check's cases one by one and reporting them as one short table.

Each case gets its own try and a device synchronize inside it, so an asynchronous kernel
fault is charged to the case that launched it. A fault that leaves the CUDA context
unusable (an illegal address) fails every later in-process case as "not run" instead of
letting them fail with confusing errors; cases run in child processes are unaffected.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

STATUSES = ("PASS", "FAIL", "SKIP", "OK")  # OK: a measurement that ran; no verdict


@dataclass(frozen=True, slots=True)
class Outcome:
    status: str
    detail: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status: expected one of {STATUSES}, got {self.status!r}")


@dataclass(frozen=True, slots=True)
class CaseResult:
    name: str
    status: str
    detail: str
    seconds: float


@dataclass(frozen=True, slots=True)
class Case:
    """One in-process check: `run` returns its Outcome or raises (then it FAILs)."""
    name: str
    run: Callable[[], Outcome]


@dataclass(frozen=True, slots=True)
class ChildJob:
    """Cases run together in a fresh process (`job` names them for --child)."""
    job: str
    names: tuple[str, ...]
    timeout_s: float


def first_line(error: BaseException, limit: int = 110) -> str:
    text = f"{type(error).__name__}: {str(error).strip()}"
    return text.splitlines()[0][:limit] if text else type(error).__name__


class CaseRunner:
    def __init__(self, device: str, on_result: Callable[[CaseResult], None] | None = None,
                 origin: float | None = None, prefix: str = "") -> None:
        self.device = device
        self.results: list[CaseResult] = []
        self._on_result = on_result
        # wall-clock origin, shared with child processes so their timestamps continue ours
        self.origin = origin if origin is not None else time.time()
        self._prefix = prefix
        self._lost_in: str | None = None

    def log(self, text: str) -> None:
        print(f"[{time.time() - self.origin:6.1f}s] {self._prefix}{text}", flush=True)

    def record(self, name: str, outcome: Outcome, seconds: float, echo: bool = True) -> None:
        result = CaseResult(name, outcome.status, outcome.detail, seconds)
        self.results.append(result)
        if echo:
            self.log(f"{result.status:4s} {name}: {result.detail} ({seconds:.1f}s)")
        if self._on_result is not None:
            self._on_result(result)

    def run_case(self, case: Case) -> None:
        if self._lost_in is not None:
            self.record(case.name, Outcome("FAIL", f"not run: CUDA context lost in "
                                                   f"{self._lost_in!r}"), 0.0)
            return
        self.log(f"---- {case.name}")
        started = time.perf_counter()
        try:
            outcome = case.run()
            self._synchronize()
        except Exception as error:  # every failure is this case's, whatever raised it
            traceback.print_exc()
            outcome = Outcome("FAIL", first_line(error))
            if not self._device_usable():
                self._lost_in = case.name
        self.record(case.name, outcome, time.perf_counter() - started)

    def run_child(self, job: ChildJob, command: Sequence[str], out_path: Path,
                  env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        """Run `command`, which writes {name: {status, detail, seconds}} to out_path as its
        cases finish; expected names it never reported FAIL with the child's exit."""
        self.log(f"---- child {job.job}: {', '.join(job.names)}")
        out_path.unlink(missing_ok=True)
        stderr_path = out_path.with_suffix(".stderr")
        started = time.perf_counter()
        with open(stderr_path, "w") as stderr:
            try:
                proc = subprocess.run(list(command), env=env, cwd=cwd, stdout=None,
                                      stderr=stderr, timeout=job.timeout_s)
                ended = f"exit {proc.returncode}"
            except subprocess.TimeoutExpired:
                ended = f"timed out after {job.timeout_s:.0f}s"
        reported = json.loads(out_path.read_text()) if out_path.is_file() else {}
        tail = _tail(stderr_path)
        if reported.keys() != set(job.names) and tail:
            print(f"child {job.job} stderr (last lines):\n{tail}", flush=True)
        last_error = tail.strip().splitlines()[-1][:80] if tail.strip() else "no stderr"
        for name in job.names:
            if name in reported:
                entry = reported[name]  # the child has logged it already
                self.record(name, Outcome(entry["status"], entry["detail"]), entry["seconds"],
                            echo=False)
            else:
                self.record(name, Outcome("FAIL", f"child {ended} before reporting: {last_error}"),
                            time.perf_counter() - started)

    def exit_code(self) -> int:
        return 1 if any(r.status == "FAIL" for r in self.results) else 0

    def summary(self) -> str:
        width = max([len(r.name) for r in self.results] + [4])
        rows = [f"{'case':{width}s}  {'status':6s}  detail"]
        rows += [f"{r.name:{width}s}  {r.status:6s}  {r.detail}" for r in self.results]
        counts = ", ".join(f"{sum(r.status == s for r in self.results)} {s}" for s in STATUSES)
        rows.append(f"{counts}; {time.time() - self.origin:.0f}s in all; "
                    f"exit {self.exit_code()}")
        return "\n".join(rows)

    def _synchronize(self) -> None:
        if self.device.startswith("cuda"):
            import torch
            torch.cuda.synchronize()

    def _device_usable(self) -> bool:
        if not self.device.startswith("cuda"):
            return True
        import torch
        try:
            torch.cuda.synchronize()
            return torch.ones(1, device=self.device).sum().item() == 1.0
        except Exception:
            return False


def json_recorder(path: Path) -> Callable[[CaseResult], None]:
    """on_result callback for a child: rewrite every result so far after each case, so a
    crash later in the child keeps what it had reported."""
    done: dict[str, dict] = {}

    def write(result: CaseResult) -> None:
        entry = asdict(result)
        done[entry.pop("name")] = entry
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(done))
        os.replace(tmp, path)
    return write


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
