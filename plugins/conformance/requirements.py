"""What a case needs from a backend, and what the backend declares it has.

The suite skips a case only for a limitation the backend *declares*: its
``kv_cache_kind``, ``is_available()``, ``supported_devices``, ``supported_dtypes``,
``supported_head_sizes``, ``supported_kernel_block_sizes`` and ``features()`` (a case
needing feature ``f`` runs only when ``features()[f]`` is True). Everything declared is
tested: when the declarations cover a case but ``validate_configuration`` still rejects
it, the case fails (the claims and the behaviour disagree).

New features need no change here: a case lists the ``features()`` names it needs
(``ConformanceCase.features``), and a backend declaring a new name is held to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnplug.core.contracts import AttentionBackend, AttentionLayerConfig
from attnplug.plugins.conformance.cases import ConformanceCase


@dataclass(frozen=True)
class Assessment:
    """Whether a case runs on a backend.

    Attributes:
        skip_reasons: declared limitations that rule the case out (empty: it runs).
        claim_mismatch: set when the declarations cover the case but
            ``validate_configuration`` rejects it: the case must fail with this text.
        kernel_block_size: the kernel block size to run with (when it runs).
        layer_cfg: the layer configuration the case describes.
    """

    skip_reasons: tuple[str, ...]
    claim_mismatch: str | None
    kernel_block_size: int | None
    layer_cfg: AttentionLayerConfig


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def resolve_device(backend_cls: type[AttentionBackend], requested: str) -> str:
    """``"auto"`` -> ``"cuda"`` when torch has CUDA and the backend declares it, else ``"cpu"``."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available() and "cuda" in backend_cls.supported_devices:
        return "cuda"
    return "cpu"


def device_option_problem(requested: str, option: str = "--attnplug-device") -> str | None:
    """Why the device option ``requested`` cannot be used on this machine (``None``: it can).

    ``auto`` always can; otherwise ``requested`` must be a device torch understands, and a
    CUDA device needs ``torch.cuda.is_available()`` (and an index below the device count).
    """
    if requested == "auto":
        return None
    try:
        dev = torch.device(requested)
    except (RuntimeError, TypeError, ValueError) as exc:
        return f"{option} {requested!r} is not a device torch understands ({exc}); use auto, cpu, cuda or cuda:N"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return f"{option} {requested} requested but torch.cuda.is_available() is False"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return (f"{option} {requested} requested but torch.cuda.device_count() is "
                    f"{torch.cuda.device_count()}")
    return None


def untestable_reason(backend_cls: type[AttentionBackend], device: str) -> str | None:
    """Why no case of the suite can run on ``backend_cls`` on ``device`` (a resolved device),
    whatever the case (``None``: the declarations leave cases to run)."""
    if backend_cls.kv_cache_kind not in ("attention", "mamba", "mla", "indexer"):
        return (f"it serves {backend_cls.kv_cache_kind!r} caches; the conformance suite has attention, "
                "mamba (state), mla and indexer (selector) cases only")
    ok, why = backend_cls.is_available()
    if not ok:
        return f"is_available() is False: {why}"
    dev = torch.device(device).type
    if dev not in backend_cls.supported_devices:
        return f"the suite would run on {dev!r}; the backend declares devices {list(backend_cls.supported_devices)}"
    return None


def layer_config(case: ConformanceCase, device: str) -> AttentionLayerConfig:
    """The :class:`AttentionLayerConfig` of ``case`` (``block_size`` is the manager's)."""
    return AttentionLayerConfig(
        num_heads=case.num_heads, num_kv_heads=case.num_kv_heads, head_size=case.head_size,
        dtype=torch_dtype(case.dtype), kv_cache_dtype=_kv_cache_dtype(case), block_size=case.block_size,
        sliding_window=case.sliding_window,
        logits_soft_cap=case.logits_soft_cap, device=device, has_sinks=case.sinks, use_alibi=case.alibi)


def _kv_cache_dtype(case: ConformanceCase) -> torch.dtype | None:
    from attnplug.core.kv_quant import parse_kv_cache_dtype

    return parse_kv_cache_dtype(case.kv_cache_dtype)


def _kv_cache_skips(backend_cls: type[AttentionBackend], case: ConformanceCase) -> list[str]:
    """An fp8 case on a backend that does not declare its cache dtype (``supported_kv_cache_dtypes``)
    or, for per-head scales, ``supports_per_head_kv_scales``."""
    if case.kv_cache_dtype == "auto":
        return []
    declared = tuple(getattr(backend_cls, "supported_kv_cache_dtypes", ("auto",)))
    if case.kv_cache_dtype not in declared:
        return [f"the case needs kv_cache_dtype {case.kv_cache_dtype}; the backend declares "
                f"supported_kv_cache_dtypes {list(declared)}"]
    if case.kv_scales == "per_head" and not getattr(backend_cls, "supports_per_head_kv_scales", False):
        return ["the case passes per-KV-head k_scale / v_scale; the backend declares "
                "supports_per_head_kv_scales = False (per-tensor scales only)"]
    return []


def _kernel_block_size(backend_cls: type[AttentionBackend], case: ConformanceCase) -> tuple[int | None, str | None]:
    sizes = backend_cls.supported_kernel_block_sizes
    if case.kernel_block_size is not None:
        if sizes is None or case.kernel_block_size in sizes:
            return case.kernel_block_size, None
        return None, (f"the case runs kernel block size {case.kernel_block_size} under manager block size "
                      f"{case.block_size}; the backend declares kernel block sizes {list(sizes)}")
    kbs = backend_cls.get_supported_kernel_block_size(case.block_size)
    if kbs is None:
        return None, (f"manager block size {case.block_size} is not a multiple of any declared kernel "
                      f"block size {list(sizes or ())}")
    return kbs, None


def assess(backend_cls: type[AttentionBackend], case: ConformanceCase, device: str) -> Assessment:
    """Decide whether ``case`` runs on ``backend_cls`` (see the module docstring)."""
    cfg = layer_config(case, device)
    skips: list[str] = []
    if backend_cls.kv_cache_kind != "attention":
        skips.append(f"the backend serves {backend_cls.kv_cache_kind!r} caches; this case is an "
                     "attention case")
        return Assessment(tuple(skips), None, None, cfg)
    ok, why = backend_cls.is_available()
    if not ok:
        skips.append(f"the backend is not available on this machine: {why}")
    dev = torch.device(device).type
    if dev not in backend_cls.supported_devices:
        skips.append(f"the case runs on {dev!r}; the backend declares devices {list(backend_cls.supported_devices)}")
    if cfg.dtype not in backend_cls.supported_dtypes:
        skips.append(f"the case needs dtype {case.dtype}; the backend declares "
                     f"{[str(d).replace('torch.', '') for d in backend_cls.supported_dtypes]}")
    sizes = backend_cls.supported_head_sizes
    if sizes is not None and case.head_size not in sizes:
        skips.append(f"the case needs head_size {case.head_size}; the backend declares {list(sizes)}")
    kbs, why_kbs = _kernel_block_size(backend_cls, case)
    if why_kbs:
        skips.append(why_kbs)
    skips += _kv_cache_skips(backend_cls, case)
    declared = backend_cls.features()
    for feat in case.features:
        if not declared.get(feat, False):
            skips.append(f"the case needs {feat!r}; the backend declares features()[{feat!r}] = "
                         f"{declared.get(feat, 'absent')}")
    if skips:
        return Assessment(tuple(skips), None, kbs, cfg)
    reasons = backend_cls.validate_configuration(cfg)
    mismatch = None
    if reasons:
        mismatch = (f"case {case.name!r}: the backend's declarations (dtypes, head sizes, kernel block sizes, "
                    f"devices, features() = {declared}) cover this case, but validate_configuration rejects "
                    f"it: {'; '.join(reasons)}. Make the declarations say what validate_configuration "
                    "enforces, or accept the configuration.")
    return Assessment((), mismatch, kbs, cfg)


def state_layer_config(case, device: str, backend_cls: type[AttentionBackend] | None = None):
    """The layer config of a state case (``state_cases.StateCase``) in ``backend_cls``'s state
    kind (``state_kinds.py``; no backend, or an empty ``state_kind``: Mamba2's
    :class:`~attnplug.core.mamba.MambaLayerConfig`)."""
    from attnplug.plugins.conformance.state_kinds import Mamba2Kind, kind_of

    kind = kind_of(backend_cls) if backend_cls is not None else Mamba2Kind
    return kind.layer_config(case, str(device))


def assess_state(backend_cls: type[AttentionBackend], case, device: str) -> tuple[tuple[str, ...], str | None]:
    """``(skip reasons, claim mismatch)`` of a state case (``state_cases.StateCase``) on a
    backend, by the same rule as :func:`assess`: skips only for declared limitations
    (``kv_cache_kind``, a ``state_kind`` the family has no model of, ``is_available()``,
    ``supported_devices``, ``supported_dtypes``, the state tensors' declared dtypes:
    ``supported_ssm_dtypes`` / ``supported_state_dtypes``); a declared-covered case that
    ``validate_configuration`` rejects is a mismatch (the case fails)."""
    from attnplug.plugins.conformance.state_kinds import KINDS, kind_of

    if backend_cls.kv_cache_kind != "mamba":
        return (f"the backend serves {backend_cls.kv_cache_kind!r} caches; this case is a mamba state case",), None
    if kind_of(backend_cls) is None:
        return (f"no conformance model of state kind {backend_cls.state_kind!r} (known: {sorted(KINDS)}; "
                "plugins/conformance/state_kinds.py)",), None
    skips = []
    ok, why = backend_cls.is_available()
    if not ok:
        skips.append(f"the backend is not available on this machine: {why}")
    dev = torch.device(device).type
    if dev not in backend_cls.supported_devices:
        skips.append(f"the case runs on {dev!r}; the backend declares devices {list(backend_cls.supported_devices)}")
    cfg = state_layer_config(case, device, backend_cls)
    if cfg.dtype not in backend_cls.supported_dtypes:
        skips.append(f"the case needs dtype {case.dtype}; the backend declares "
                     f"{[str(d).replace('torch.', '') for d in backend_cls.supported_dtypes]}")
    ssm_dtype = getattr(cfg, "ssm_dtype", None)
    if ssm_dtype is not None and ssm_dtype not in getattr(backend_cls, "supported_ssm_dtypes", (torch.float32,)):
        skips.append(f"the case needs SSM state dtype float32; the backend declares {backend_cls.supported_ssm_dtypes}")
    state_dtype = getattr(cfg, "state_dtype", None)
    declared = getattr(backend_cls, "supported_state_dtypes", None)
    if state_dtype is not None and declared is not None and state_dtype not in declared:
        skips.append(f"the case needs recurrent state dtype float32; the backend declares {declared}")
    if skips:
        return tuple(skips), None
    reasons = backend_cls.validate_configuration(cfg)
    if reasons:
        return (), (f"state case {case.name!r}: the backend's declarations (dtypes, devices) cover this case, but "
                    f"validate_configuration rejects it: {'; '.join(reasons)}")
    return (), None
