"""The conformance tests run the other side's own code: vLLM 0.32's CPU build in a venv of
its own, through the vllm_side fixture (tests/vllm_side.py)."""
from tests.vllm_side import vllm_side  # noqa: F401  (the fixture)
