#!/usr/bin/env bash
# The GPU check in ONE call of the project's device machine (an offline CUDA host whose
# `python3` already holds torch, triton, pytest, hypothesis, pluggy, rich and Cython):
#
#     run(command="bash tests/gpu/device_run.sh", timeout_s=560)            # everything
#     run(command="SECTIONS=bench_attention BUDGET_S=120 bash tests/gpu/device_run.sh",
#         timeout_s=180)     # rerun a part at once, while the machine is warm (30 s)
#     run(command="INSTALL=0 SECTIONS=gpu_tests BUDGET_S=90 bash tests/gpu/device_run.sh",
#         timeout_s=150)     # a fresh machine, a part only: INSTALL=0 skips the install (about
#                            # 2 minutes: the Cython builds) and runs from the source tree
#     run(command="SECTIONS=vllm_e2e BUDGET_S=200 bash tests/gpu/device_run.sh",
#         timeout_s=260)     # vLLM 0.33 LLM.generate through the bridge vs FLASH_ATTN
#                            # (never run yet; needs vLLM 0.33 in that python, see run_all.sh)
#
# A session has 15 minutes of device time in all, the machine's start (1-2 min) included.
#
# 1. installs this checkout into that python without network or build isolation, so the
#    `attnplug` entry points (backend plugins, the pytest11 conformance plugin) exist and
#    the Cython fast path is built; if that install fails, or with INSTALL=0, it runs from
#    the source tree through PYTHONPATH plus PYTEST_PLUGINS (same code, without the compiled
#    step-compiler fast path, which no GPU check needs; the install log says why);
# 2. installs the wheels carried in .whl/ (ignored by git; name it in `carry`), e.g.
#    flashinfer-python and its missing dependency apache-tvm-ffi (see docs/backends.md:
#    no flash-attn wheel exists for the machine's torch), when there are any;
# 3. runs tests/gpu/run_all.sh (SECTIONS, PYTEST_ARGS pass through) into a scratch folder,
#    with a deadline BUDGET_S seconds after the install (default 480: no section runs past
#    it), so that the copy-back below always runs inside the call's timeout
#    and copies back to $OUT at most 8 files (the device tool's limit): summary.md,
#    bench_attention.md/.json, gpu_conformance.log, gpu_tests.log, install.log and every
#    log in one tarball.
# Exit status: run_all.sh's (non-zero if a section failed), 3 if attnplug cannot be imported.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
OUTDIR=${OUT:-gpu_results}
WORK=${WORK:-/tmp/attnplug_gpu}
rm -rf "$WORK" && mkdir -p "$WORK/results" "$OUTDIR"
LOG="$WORK/results/install.log"

{
  echo "# $(date -u +%FT%TZ) $(uname -m), $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 || true
  if compgen -G ".whl/*.whl" > /dev/null; then
    echo "== carried wheels: $(ls .whl)"
    "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
  fi
  if [ "${INSTALL:-1}" = 1 ]; then
    echo "== installing attnplug (editable, offline, no build isolation)"
    "$PY" -m pip install --no-index --no-deps --no-build-isolation -e .
  else
    echo "== INSTALL=0: not installing attnplug"
  fi
} > "$LOG" 2>&1
if [ "${INSTALL:-1}" != 1 ] || ! "$PY" -c "import importlib.metadata as m; m.distribution('attnplug'); import attnplug.runner.commands.cli" >> "$LOG" 2>&1; then
  echo "== not installed (INSTALL=0, or the install above failed): running from the source tree via PYTHONPATH" >> "$LOG"
  mkdir -p "$WORK/site" && ln -sfn "$PWD" "$WORK/site/attnplug"
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  export PYTEST_PLUGINS=attnplug.plugins.conformance.pytest_plugin
fi
"$PY" -c "import attnplug.runner.step.fast as n; print('compiled fast path:', n.NATIVE is not None)" >> "$LOG" 2>&1 \
  || { cat "$LOG"; echo "attnplug cannot be imported"; cp "$LOG" "$OUTDIR/"; exit 3; }
tail -n 4 "$LOG"

PY="$PY" RESULTS="$WORK/results" WHEELS="" DEADLINE=$(( $(date +%s) + ${BUDGET_S:-480} )) \
  bash tests/gpu/run_all.sh
status=$?

for f in summary.md bench_attention.md bench_attention.json gpu_conformance.log gpu_tests.log install.log; do  # + tarball: 7 files (vllm_e2e.log/.json: in the tarball)
  [ -e "$WORK/results/$f" ] && cp "$WORK/results/$f" "$OUTDIR/"
done
tar -czf "$OUTDIR/gpu_results.tar.gz" -C "$WORK" results
exit $status
