# The `tle` Python-based Triton backend. Triton loads this file for every model whose
# config.pbtxt says `backend: "tle"` once it lies at <backend-directory>/tle/model.py:
# backend/triton_server.py (serve, tests, benches) and the Dockerfile put it there.
# The code lives in the `backend` package, which must be importable by the stub's Python.
from backend.tle_model import TleModel as TritonPythonModel  # noqa: F401
