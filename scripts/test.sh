#!/usr/bin/env bash
# Fresh machine -> environment -> the whole test suite (slow end-to-end tests included).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` for the quick part.
#
# Then, on a CPU above AVX2 (AVX-512, AMX), the engine, kernel and a few end-to-end tests
# run again with the ISA capped at avx2 (TLE_CPU_ISA, see docs/operations.md), as an AVX2-only host
# runs them, so a better CI host cannot hide an AVX2 regression. TLE_TEST_CAPPED=0 skips it.
#
# Last, the model tests run again at the lowest transformers pyproject.toml allows
# (scripts/transformers_floor.sh): the families and the general path use transformers'
# configs and internals. TLE_TEST_FLOOR=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# vLLM's own code for tests/conformance/; there a missing venv fails, never skips.
bash scripts/setup_vllm.sh
export TLE_REQUIRE_VLLM=1
# lm-eval's own code for tests/e2e/test_lm_eval.py, in a venv of its own; there too a
# missing venv fails, never skips.
bash scripts/setup_lmeval.sh
export TLE_REQUIRE_LMEVAL=1
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider --timeout=1200 --durations=15)
CAPPED_TESTS=(tests/kernels/cpu/test_features.py tests/kernels/cpu/test_linear.py
              tests/kernels/cpu/test_gemm.py tests/kernels/test_linear_dispatch.py
              tests/engine/worker/test_cpu_threads.py
              tests/engine/models/test_loader.py tests/engine/models/test_paged.py
              tests/kernels/cpu/test_native.py tests/engine/sample/test_sampler.py
              tests/engine/test_generate.py tests/e2e/test_llm_text.py)
# What reads transformers' configs or runs its modeling code against HF's own models.
FLOOR_TESTS=(tests/engine/models/test_families.py tests/engine/models/test_transformers_backend.py
             tests/engine/models/test_loader.py tests/engine/models/test_paged.py)
isa=$(.venv/bin/python -c 'from kernels.cpu import features as c; print(c.detect().detected_isa)')
capped=0
if [ "${TLE_TEST_CAPPED:-1}" != 0 ] && [ -z "${TLE_CPU_ISA:-}" ]; then
    case "$isa" in
        avx512*|amx) capped=1 ;;
        *) echo "== CPU: $isa; no capped pass (the host is at or below avx2 already) ==" ;;
    esac
fi
status=0
"${PYTEST[@]}" tests "$@" || status=$?
if [ $capped = 1 ]; then
    echo "== again with the CPU capped at avx2 (this host: $isa) =="
    TLE_CPU_ISA=avx2 "${PYTEST[@]}" "${CAPPED_TESTS[@]}" "$@" || status=$?
fi
if [ "${TLE_TEST_FLOOR:-1}" != 0 ]; then
    floor=$(bash scripts/transformers_floor.sh)
    echo "== again at transformers' floor ($floor) =="
    PYTHONPATH="$floor" "${PYTEST[@]}" "${FLOOR_TESTS[@]}" "$@" || status=$?
fi
exit $status
