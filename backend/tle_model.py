"""The model class of the `tle` backend (backend/triton_backend/model.py): the `llm`
model, plus auto_complete_config (backend/llm_config.py), which fills in vllm_backend's
interface."""
from __future__ import annotations

from backend.llm_config import complete_llm_config
from backend.llm_model import LLMModel


class TleModel(LLMModel):
    auto_complete_config = staticmethod(complete_llm_config)
