# The model code lives in the backend package (backend/tokenizer_models.py).
from backend.tokenizer_models import PostprocessingModel as TritonPythonModel  # noqa: F401
