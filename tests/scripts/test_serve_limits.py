"""scripts/serve.py raises the open-file limit to the hard limit before it starts
tritonserver, which inherits it (each client connection holds a descriptor)."""
import resource
import subprocess
import sys

from backend.triton_server import REPO_ROOT

CHILD = f"""
import importlib.util, resource
spec = importlib.util.spec_from_file_location("serve", {str(REPO_ROOT / "scripts" / "serve.py")!r})
serve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve)
print(serve.raise_open_file_limit())
import subprocess
print(subprocess.run(["sh", "-c", "ulimit -n"], capture_output=True, text=True).stdout.strip())
"""


def test_soft_limit_goes_up_to_the_hard_one_and_children_inherit_it():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = 256 if hard == resource.RLIM_INFINITY else min(256, hard)
    lowered = (soft, 512 if hard == resource.RLIM_INFINITY or hard > 512 else hard)

    def lower():
        resource.setrlimit(resource.RLIMIT_NOFILE, lowered)

    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         preexec_fn=lower, check=True).stdout.split("\n")
    assert out[0] == str(lowered)
    assert out[1] == str(lowered[1])  # a process serve starts gets the raised limit
