#!/usr/bin/env bash
# Installs the lowest transformers pyproject.toml allows (and the tokenizers it needs)
# into a folder of its own beside the venv's packages, and prints that folder: with it
# first on PYTHONPATH the venv runs at the floor, e.g.
#   PYTHONPATH=$(bash scripts/transformers_floor.sh) .venv/bin/python -m pytest tests/engine/models
# The model code leans on transformers' internals (configs, the general path's attention
# hook), so the floor is tested, not assumed.
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(.venv/bin/python - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
spec = next(d for d in deps if re.match(r"transformers\b", d))
print(re.search(r">=\s*([0-9.]+)", spec).group(1))
PY
)
dir=.venv/transformers-floor-$floor
if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    .venv/bin/python -m pip install -q --target "$dir" --no-deps "transformers==$floor" >&2
    # The tokenizers range that transformers version declares (the venv's may be newer).
    tokenizers=$(sed -n 's/^Requires-Dist: \(tokenizers[^;]*\)$/\1/p' "$dir"/transformers-*.dist-info/METADATA \
                 | head -1 | tr -d ' ')
    [ -n "$tokenizers" ] || { echo "transformers_floor: no tokenizers requirement found" >&2; exit 1; }
    .venv/bin/python -m pip install -q --target "$dir" --no-deps "$tokenizers" >&2
    touch "$dir/.complete"
fi
echo "$PWD/$dir"
