# The model code lives in the backend package (backend/llm_model.py).
from backend.llm_model import LLMModel as TritonPythonModel  # noqa: F401
