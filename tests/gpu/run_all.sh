#!/usr/bin/env bash
# GPU checks, on a CUDA machine, from the repository root:  bash tests/gpu/run_all.sh
# Each section appends its results; the script exits non-zero if any command failed.
# Environment: PY (default .venv/bin/python), WHEELS (directory of prebuilt wheels, default ./wheels).
set -uo pipefail
PY=${PY:-.venv/bin/python}
ATTNPLUG=${ATTNPLUG:-$(dirname "$PY")/attnplug}
WHEELS=${WHEELS:-wheels}
status=0
run() { echo "== $*"; "$@" || { echo "!! FAILED: $*"; status=1; }; }

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "no CUDA device: nothing to run"; exit 0; }

# --- flash_attn / flashinfer backends, CUDA-graph padding ---------------------------------------
# The extras are installed from local wheels when present (the machine may be offline).
for pattern in "flash_attn-*.whl" "flash_attn_3-*.whl" "flashinfer_python-*.whl"; do
  for whl in "$WHEELS"/$pattern; do
    [ -e "$whl" ] && run "$PY" -m pip install -q --no-deps "$whl"
  done
done
run "$ATTNPLUG" backends
run "$PY" -m pytest -q -m gpu tests/gpu/test_flash_cudagraph.py tests/gpu/test_flash_runner_cudagraph.py
for backend in flash_attn flashinfer; do
  if "$PY" -c "from attnplug.backends import get_backend as g; import sys; sys.exit(0 if g('$backend').is_available()[0] else 1)"; then
    run "$ATTNPLUG" check "$backend" --device cuda --cases tests/gpu/cases_flash.json
    if "$ATTNPLUG" bench --help 2>/dev/null | grep -q attention; then
      run "$ATTNPLUG" bench attention --backend "$backend"
    else
      echo "-- attnplug bench attention is not available in this checkout: skipped for $backend"
    fi
  else
    echo "-- $backend unavailable: $("$PY" -c "from attnplug.backends import get_backend as g; print(g('$backend').is_available()[1])")"
  fi
done
# (The emulated backends are CPU tools: they synchronise with the host, which the suite forbids on CUDA.)

exit $status
