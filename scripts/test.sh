#!/usr/bin/env bash
# Fresh machine -> environment -> the whole test suite (slow end-to-end tests included).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` for the quick part.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=1200 --durations=15 tests "$@"
