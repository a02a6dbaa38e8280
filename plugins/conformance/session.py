"""One pytest session's conformance state: resolved backends and cached case runs.

Each (backend, case) is run once and every check reads the same record; the torch_native
reference run of each case is shared by all backends under test.
"""

from __future__ import annotations

import pytest

from attnplug.core.contracts import AttentionBackend
from attnplug.plugins.conformance.cases import ConformanceCase
from attnplug.plugins.conformance.harness import CaseRun, run_case
from attnplug.plugins.conformance.oracle import quantizes_query
from attnplug.plugins.conformance.requirements import Assessment, assess, resolve_device
from attnplug.plugins.discovery import get_registry, resolve_backend_spec

REFERENCE = "torch_native"


def resolve_backend(spec: str) -> type[AttentionBackend]:
    """A registered backend name, ``"package.module:Class"`` for a backend class that is
    not (yet) installed as a plugin (it is validated as the registry would), or
    ``"vllm:NAME"`` for vLLM's backend ``NAME`` (``attnplug.plugins.vllm.reverse``).

    Raises:
        UnknownBackendError: an unregistered name (the message lists the known ones).
        PluginValidationError: a ``module:Class`` that is not a valid backend.
        ImportError, AttributeError: a ``module:Class`` that cannot be imported (or
            ``vllm:`` without vLLM).
        ValueError: a ``vllm:NAME`` the bridge cannot run.
    """
    if spec.startswith("vllm:"):  # a vLLM backend through the reverse bridge (docs/vllm.md)
        from attnplug.plugins.vllm.reverse import vllm_backend

        return vllm_backend(spec.removeprefix("vllm:"))
    return resolve_backend_spec(spec)


class ConformanceSession:
    """Backends named by ``--attnplug-backend``, the device option, and cached runs."""

    def __init__(self, specs: list[str], device: str):
        self.backends = {spec: resolve_backend(spec) for spec in specs}
        self.device_option = device
        self._runs: dict[tuple, CaseRun] = {}

    def device(self, backend: type[AttentionBackend]) -> str:
        return resolve_device(backend, self.device_option)

    def assessment(self, backend: type[AttentionBackend], case: ConformanceCase) -> Assessment:
        return assess(backend, case, self.device(backend))

    def prepare(self, spec: str, case: ConformanceCase) -> tuple[type[AttentionBackend], Assessment]:
        """The backend and the assessment of ``case``; skips or fails the test as declared."""
        backend = self.backends[spec]
        a = self.assessment(backend, case)
        if a.skip_reasons:
            pytest.skip(f"case {case.name!r}: " + "; ".join(a.skip_reasons))
        if a.claim_mismatch:
            pytest.fail(a.claim_mismatch, pytrace=False)
        return backend, a

    def run(self, backend: type[AttentionBackend], case: ConformanceCase, kbs: int, *, repeat: int = 0) -> CaseRun:
        key = (backend, case, self.device(backend), kbs, repeat)
        if key not in self._runs:
            self._runs[key] = run_case(backend, case, self.device(backend), kbs)
        return self._runs[key]

    def state_run(self, spec: str, case):
        """The (cached) run of state case ``case`` on backend ``spec``; skips or fails the
        test as its declarations say (``requirements.assess_state``)."""
        from attnplug.plugins.conformance.requirements import assess_state
        from attnplug.plugins.conformance.state_harness import run_state_case

        backend = self.backends[spec]
        skips, mismatch = assess_state(backend, case, self.device(backend))
        if skips:
            pytest.skip(f"state case {case.name!r}: " + "; ".join(skips))
        if mismatch:
            pytest.fail(mismatch, pytrace=False)
        key = (backend, case, self.device(backend), "state")
        if key not in self._runs:
            self._runs[key] = run_state_case(backend, case, self.device(backend))
        return self._runs[key]

    def reference(self, backend: type[AttentionBackend], case: ConformanceCase) -> CaseRun | None:
        """The torch_native run of ``case`` (``None`` when ``backend`` is torch_native, or
        reads this fp8 case's query in fp8 (``oracle.quantizes_query``): it is then held to the
        dense oracle instead)."""
        ref = get_registry().get(REFERENCE)
        if backend is ref or quantizes_query(backend, case):  # fp8 queries: the dense oracle over them
            return None
        device = self.device(backend)
        kbs = case.kernel_block_size or case.block_size
        key = (ref, case, device, kbs, 0)
        if key not in self._runs:
            self._runs[key] = run_case(ref, case, device, kbs)
        run = self._runs[key]
        if run.error:
            pytest.fail(f"case {case.name!r}: the torch_native reference itself failed ({run.error})", pytrace=False)
        return run
