"""backend.log_relay: repeated lines fold into periodic counts; everything else passes."""
import io
import os

from backend.log_relay import LogRelay

FLOOD = b"E1207 13:30:%02d.%06d 4242 http_server.cc:4660] Error from accept(): Too many open files\n"


def relay(lines: list[bytes], interval_s: float) -> tuple[list[str], LogRelay]:
    read_end, write_end = os.pipe()
    sink = io.BytesIO()
    with open(read_end, "rb") as source:
        r = LogRelay(source, sink, interval_s=interval_s)
        with open(write_end, "wb") as out:
            out.writelines(lines)
        r.join(10)
    return sink.getvalue().decode().splitlines(), r


def test_a_flood_of_one_line_is_written_once_then_counted():
    lines = [b"I1207 server started\n", *(FLOOD % (i % 60, i) for i in range(50_000)),
             b"I1207 13:31:00.000000 4242 server.cc:1] health ok\n"]
    out, r = relay(lines, interval_s=3600)
    assert out[0] == "I1207 server started"
    assert out[1].endswith("Error from accept(): Too many open files")
    assert out[2] == "serve: the line above repeated 49999 more times"
    assert out[3].endswith("health ok")
    assert len(out) == 4 and r.folded == 49_999


def test_a_long_flood_reports_once_per_interval_and_distinct_lines_all_pass():
    out, _ = relay([FLOOD % (0, i) for i in range(2000)], interval_s=0.0)
    assert out[0].endswith("Too many open files")
    assert all(line.startswith("serve: the line above repeated") for line in out[1:])
    distinct = [b"line %d\n" % i for i in range(100)]
    out, r = relay(distinct, interval_s=3600)
    assert out == [f"line {i}" for i in range(100)] and r.folded == 0
