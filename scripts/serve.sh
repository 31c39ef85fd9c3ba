#!/usr/bin/env bash
# Serve model_repository on localhost (HTTP 8000, gRPC 8001, metrics 8002 by default;
# see scripts/serve.py --help). First run: creates .venv via scripts/setup.sh; later
# runs skip setup until setup.sh or pyproject.toml change. serve.py lays out the server
# folder, the `tle` backend (backend/triton_backend/model.py) included.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.triton/setup.stamp
if [ ! -x .venv/bin/python ] || [ ! -f "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ] \
        || [ pyproject.toml -nt "$stamp" ]; then
    scripts/setup.sh
    mkdir -p .triton
    touch "$stamp"
fi
exec .venv/bin/python scripts/serve.py "$@"
