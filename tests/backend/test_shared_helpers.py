"""backend/json_text.py and backend/open_files.py, shared by the Triton backend, serve and
the OpenAI route."""
import json
import resource
import subprocess
import sys

from backend.json_text import dotted, find_lone_surrogate


def test_the_first_lone_surrogate_in_document_order_with_its_path():
    body = {"a": "fine", "b": [{"c": "x\ud800"}, "\udfff"], "\ud801": 1}
    assert find_lone_surrogate(body) == (("b", 0, "c"), False, "\ud800")
    assert find_lone_surrogate({"ok": {"\ud801k": 1}}) == (("ok", "\ud801k"), True, "\ud801")
    # An escaped pair is one character once JSON has parsed it.
    assert find_lone_surrogate(json.loads('["\\ud83d\\ude00", "x"]')) is None
    assert dotted(("messages", 0, "content")) == "messages[0].content"
    assert dotted((2, "x")) == "[2].x" and dotted(()) == ""


def test_nesting_deeper_than_pythons_recursion_limit_is_walked():
    value: object = "\ud800"
    for _ in range(50_000):
        value = [value]
    path, in_key, _ = find_lone_surrogate({"deep": value})
    assert len(path) == 50_001 and path[0] == "deep" and not in_key


CHILD = """
import resource
from backend.open_files import raise_open_file_limit
print(raise_open_file_limit(300), raise_open_file_limit(200), raise_open_file_limit())
print(resource.getrlimit(resource.RLIMIT_NOFILE))
"""


def test_open_file_limit_goes_up_to_what_is_asked_never_down_never_past_the_hard_limit():
    def lower():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))

    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         preexec_fn=lower, check=True).stdout.splitlines()
    assert out[0] == "(256, 300) (300, 300) (300, 512)"
    assert out[1] == "(512, 512)"
