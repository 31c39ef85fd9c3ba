# The `tle` Python-based Triton backend. Triton loads this file for every model whose
# config.pbtxt says `backend: "tle"` once it lies at <backend-directory>/tle/model.py:
# backend/triton_server.py (serve, tests, benches) and the Dockerfile put it there.
# The code lives in the `backend` package, which must be importable by the stub's Python.
import os
import sys

# The stub's embedded Python leaves PYTHONPATH out of sys.path, so a checkout that
# backend/triton_server.py names there would lose to an editable install's .pth (another
# checkout's code serving this one's tests); put its entries first, as Python would.
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and p not in sys.path]

from backend.tle_model import TleModel as TritonPythonModel  # noqa: E402,F401
