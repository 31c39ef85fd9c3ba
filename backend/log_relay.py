"""Copies tritonserver's output (its log and its stubs') line by line to a sink, folding a
line that repeats: the first copy is written, then one "repeated N more times" line per
interval for as long as the repeats go on. Why: with its descriptors exhausted, Triton's
HTTP server logs a failed accept() on every pass of its event loop (~40 MB/s seen), which
filled disks and drowned every other line; the pipe also slows that loop to the relay's pace."""
from __future__ import annotations

import re
import threading
import time
from typing import BinaryIO

# glog's prefix (severity, date, time, thread id, file:line) differs between repeats.
_PREFIX = re.compile(rb"^[IWEF]\d{4} [\d:.]+\s+\d+ [^\]]*\] ")
SUMMARY_INTERVAL_S = 5.0


def _key(line: bytes) -> bytes:
    return _PREFIX.sub(b"", line, count=1).rstrip()


class LogRelay:
    def __init__(self, source: BinaryIO, sink: BinaryIO,
                 interval_s: float = SUMMARY_INTERVAL_S) -> None:
        self._source, self._sink, self._interval = source, sink, interval_s
        self.folded = 0  # lines not written, in all
        self._thread = threading.Thread(target=self._run, name="tritonserver-log", daemon=True)
        self._thread.start()

    def _summary(self, count: int) -> None:
        self._sink.write(f"serve: the line above repeated {count} more times\n".encode())

    def _run(self) -> None:
        last, repeats, since = None, 0, 0.0
        try:
            for line in iter(self._source.readline, b""):
                key = _key(line)
                if key == last:
                    repeats += 1
                    self.folded += 1
                    if time.monotonic() - since >= self._interval:
                        self._summary(repeats)
                        self._sink.flush()
                        repeats, since = 0, time.monotonic()
                    continue
                if repeats:
                    self._summary(repeats)
                last, repeats, since = key, 0, time.monotonic()
                self._sink.write(line)
                self._sink.flush()
            if repeats:
                self._summary(repeats)
                self._sink.flush()
        except (OSError, ValueError):
            pass  # the sink closed under us (serve exiting): nothing left to tell

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
