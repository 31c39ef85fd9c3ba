#!/usr/bin/env bash
# Creates .venv-lmeval: EleutherAI's lm-evaluation-harness at the version
# tests/e2e/test_lm_eval.py pins, in a venv of its own so that its dependency pins
# (datasets, evaluate, transformers, ...) never move .venv's. The test runs lm-eval's own
# `local-completions` model against our OpenAI route and its own `hf` model on the same
# weights. Safe to re-run: a .venv-lmeval whose stamp names the pinned versions is kept
# at once; pip reuses its download cache otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
LMEVAL_VERSION=0.4.13
TORCH_VERSION=2.13.0
VENV=.venv-lmeval
STAMP="$VENV/.tle-setup"
WANT="lm-eval==$LMEVAL_VERSION torch==$TORCH_VERSION"
# The stamp is written last, so a half-made venv (an install that failed or was
# interrupted) never passes for a finished one.
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
    exit 0
fi
base=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
rm -rf "$VENV"
"$base" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, as in setup.sh: lm-eval's `hf` extra would otherwise pull a CUDA build
# of several GB; pip takes the CPU wheel of this version where one lies on disk or on a
# configured index.
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
# `api`: what local-completions needs (aiohttp, tenacity, requests); `hf`: transformers,
# accelerate and peft for the `hf` reference model. torch is named again so that no
# dependency can move it.
"$VENV/bin/python" -m pip install -q "lm-eval[api,hf]==$LMEVAL_VERSION" "torch==$TORCH_VERSION"
echo "$WANT" > "$STAMP"
