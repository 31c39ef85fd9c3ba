# The `tle` Python-based Triton backend. Triton loads this file for every model whose
# config.pbtxt says `backend: "tle"` once it lies at <backend-directory>/tle/model.py:
# backend/triton_server.py (serve, tests, benches) and the Dockerfile put it there.
# The code lives in the `backend` package, which must be importable by the stub's Python.
import os
import sys

# The python backend stub's interpreter (tritonserver 2.51) leaves PYTHONPATH off
# sys.path, so a checkout named there lost to an installed copy of the package (an
# editable install of another checkout): its entries go first, as Python would put them.
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and p not in sys.path]

from backend.tle_model import TleModel as TritonPythonModel  # noqa: E402,F401
