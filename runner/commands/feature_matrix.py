"""The feature matrix: every built-in backend's declared capabilities as one Markdown page.

``attnplug backends --matrix`` prints it; ``docs/feature-matrix.md`` is its output, and
``tests/runner/commands/test_feature_matrix_doc.py`` fails when the page and the declarations
disagree (regenerate with ``attnplug backends --matrix > docs/feature-matrix.md``).
Rows come from :class:`~attnplug.core.capabilities.BackendCapabilities` only, so the page
says exactly what selection checks.
"""

from __future__ import annotations

from attnplug.core.capabilities import FEATURE_DESCRIPTIONS, BackendCapabilities, Feature

HEADER = """# Feature matrix

Generated from the backends' declarations (`core/capabilities.py`, `BackendCapabilities`) by
`attnplug backends --matrix`; do not edit by hand (`tests/runner/commands/test_feature_matrix_doc.py`
fails when this page is stale). A layer that needs a feature a backend does not declare is
refused for it with that reason (`AttentionBackend.validate_configuration`), never silently
served without it. `y` = declared, `.` = not declared.

Two rows depend on the machine, and show the reference machine (no flash-attn installed, no
`TRITON_INTERPRET`): `flash_attn` declares any kernel block size, `ALWAYS` CUDA graphs and the
`fp8_e4m3` KV cache (per-tensor and per-head scales, fp8 queries scaled by `q_scale`: FA3's
`q_descale` / `k_descale` / `v_descale`) when FlashAttention 3 is installed (multiples of 256,
`UNIFORM_BATCH` and no fp8 under FlashAttention 2, the default: its `flash_attn_varlen_func`
takes no descale); `triton` adds the CPU (float16, float32) under `TRITON_INTERPRET=1`.
"""


def _sizes(sizes: tuple[int, ...] | None) -> str:
    if sizes is None:
        return "any"
    if len(sizes) >= 4 and all(b - a == sizes[1] - sizes[0] for a, b in zip(sizes, sizes[1:])):
        return f"{sizes[0]}..{sizes[-1]} step {sizes[1] - sizes[0]}"
    return ", ".join(map(str, sizes))


def feature_matrix_markdown(caps: list[BackendCapabilities]) -> str:
    """The page: one features table (a column per :class:`Feature`) and one table of
    dtypes, KV-cache dtypes, scale granularities, head sizes, kernel block sizes, devices,
    attention types and CUDA-graph level; rows in the given order."""
    feats = list(Feature)
    lines = [HEADER, "## Attention features", "",
             "| backend | kind | " + " | ".join(FEATURE_DESCRIPTIONS[f] for f in feats) + " |",
             "|---|---|" + "---|" * len(feats)]
    for c in caps:
        lines.append(f"| `{c.name}` | {c.kv_cache_kind} | "
                     + " | ".join("y" if f in c.features else "." for f in feats) + " |")
    lines += ["", "## Types, sizes, devices", "",
              "| backend | dtypes | KV-cache dtypes | scale granularity | head sizes | kernel block sizes | "
              "devices | attention types | CUDA graphs |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in caps:
        scales = ", ".join(g.value for g in c.scale_granularities) or "-"
        if c.quant_query:
            scales += " (+ fp8 queries, q_scale)"
        lines.append(f"| `{c.name}` | {', '.join(c.dtypes)} | {', '.join(c.kv_cache_dtypes)} | {scales} | "
                     f"{_sizes(c.head_sizes)} | {_sizes(c.kernel_block_sizes)} | {', '.join(c.devices)} | "
                     f"{', '.join(c.attn_types)} | {c.cudagraph} |")
    lines += ["", "Feature words (`core/capabilities.Feature`):", ""]
    lines += [f"* `{f.value}`: {FEATURE_DESCRIPTIONS[f]}" for f in feats]
    return "\n".join(lines) + "\n"


def builtin_capabilities(registry) -> list[BackendCapabilities]:
    """:class:`BackendCapabilities` of every built-in backend of ``registry``, in
    registration order (third-party plugins are left out: the page documents attnplug)."""
    return [BackendCapabilities.of(e.backend_cls) for e in registry if e.source.builtin]
