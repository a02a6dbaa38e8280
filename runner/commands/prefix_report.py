"""What ``attnplug run`` reports about prefix caching and cascade attention.

``prefix_caching_summary(engine)`` is merged into the ``--json`` summary
(``assemble.EngineSetup.summary``); ``prefix_caching_rows(summary)`` are the rows the run
table prints. Keys:

* ``prefix_caching``: ``enabled``; ``disabled_reason`` (why a model gets no hits, e.g. a
  Mamba group, or ``null``); ``lookups`` (admissions that looked the cache up),
  ``query_tokens`` (their tokens), ``hit_tokens`` (= tokens saved: prompt tokens not
  computed because their K/V was cached), ``hit_requests``, ``hit_rate``
  (``hit_tokens / query_tokens``), ``cached_blocks_per_group`` and
  ``evictions_per_group`` at the end of the run.
* ``cascade``: ``enabled``, ``steps`` (steps in which some group ran cascade attention),
  ``planned_steps``, and ``reasons`` (``{why not: groups x steps}``).
"""

from __future__ import annotations

from typing import Any


def prefix_caching_summary(engine) -> dict[str, Any]:
    """The two summary entries of a finished run (see the module docstring)."""
    kv = engine.scheduler.kv_cache_manager
    stats = getattr(kv, "stats", None)
    enabled = bool(engine.scheduler.config.enable_prefix_caching)
    pc: dict[str, Any] = {"enabled": enabled, "disabled_reason": getattr(kv, "disabled_reason", None)}
    if stats is not None:
        pc.update(lookups=stats.requests, query_tokens=stats.queries, hit_tokens=stats.hits,
                  hit_requests=stats.hit_requests, hit_rate=round(stats.hit_rate, 4),
                  cached_blocks_per_group=kv.num_cached_blocks_per_group,
                  evictions_per_group=kv.num_evictions_per_group)
    plan = engine.runner.cascade
    cascade = {"enabled": plan.cfg.enabled, "steps": plan.num_cascade_steps, "planned_steps": plan.num_steps,
               "min_prefix_len": plan.cfg.min_prefix_len, "min_num_reqs": plan.cfg.min_num_reqs,
               "reasons": dict(sorted(plan.reason_counts.items(), key=lambda kv_: -kv_[1]))}
    return {"prefix_caching": pc, "cascade": cascade}


def prefix_caching_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """``(metric, value)`` rows for the run table (none when prefix caching was off)."""
    pc = summary.get("prefix_caching") or {}
    if not pc.get("enabled"):
        return []
    rows = []
    if pc.get("disabled_reason"):
        rows.append(("prefix caching", f"no hits: {pc['disabled_reason']}"))
    rows.append(("prefix-cache hit rate", f"{pc.get('hit_rate', 0.0):.1%} of {pc.get('query_tokens', 0)} tokens"))
    rows.append(("tokens saved (hits) / requests hit", f"{pc.get('hit_tokens', 0)} / {pc.get('hit_requests', 0)}"))
    c = summary.get("cascade") or {}
    if c:
        state = f"{c['steps']} of {c['planned_steps']}" if c.get("enabled") else "off (--no-cascade)"
        rows.append(("cascade steps", state))
    return rows
