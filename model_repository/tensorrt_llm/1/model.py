# The model code lives in the backend package (backend/token_model.py).
from backend.token_model import TokenIdModel as TritonPythonModel  # noqa: F401
