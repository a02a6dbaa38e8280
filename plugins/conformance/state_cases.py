"""State-backend conformance cases: small, JSON-serializable state-layer workloads.

A state case describes one state layer in Mamba2 terms (heads, head size, state size, B/C
groups, conv kernel, scan chunk size, dtype; ``state_kinds.py`` maps them onto the layer of
the backend's ``state_kind``: for GDN, value heads, value head dim, key head dim and key
heads) and a schedule: per step, which requests compute how
many of their next tokens. The harness (``state_harness.py``) turns it into scheduler
outputs on the real runner path. A request scheduled for one token after earlier
tokens is a decode row; anything else a prefill chunk. ``preempt`` lists ``(step,
request)``: before that step the request is preempted (its state slot is freed and
poisoned), and the next time it is scheduled it resumes from position 0 in a new slot
(``resumed_from_preemption``), recomputing its tokens.

Hybrid-state cases (docs/conformance.md, "The hybrid-state family") add two things:

* ``verify`` lists ``(step, request, accepted)``: in that step the request's ``n``
  scheduled tokens are its last real token and ``n - 1`` drafts (speculative decoding);
  ``accepted`` of the drafts are accepted, the rest carry other inputs (rejected). The
  request holds ``1 + max drafts`` state slots; after the runner's commit
  (``runner/execute/spec_decode/state_commit.py``) its own slot must hold the state of
  the accepted prefix, and the rejected drafts must leave no trace.
* ``prefix_hits`` lists ``(request, source, tokens)``: the request's first ``tokens``
  inputs are the source's; it is admitted with ``num_computed_tokens = tokens`` and its
  slot restored (the runner's ``copy_state_slots``) from the checkpoint copied out of the
  source's slot when the source had computed exactly ``tokens``.

Cases are plain data: ``--attnplug-cases FILE.json`` takes them next to attention cases
(an object with ``"kind": "state"``; see :meth:`StateCase.from_dict`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from attnplug.plugins.conformance.cases import DTYPES, read_case_list


@dataclass(frozen=True)
class StateCase:
    """One Mamba2 workload (lengths in tokens).

    Attributes:
        name: unique id.
        steps: per step, ``(request index, tokens scheduled)`` pairs (tokens >= 1; each
            request at most once per step).
        num_heads, head_size, state_size, n_groups: the SSM (``num_heads % n_groups == 0``).
        conv_kernel_size: taps of the causal conv1d (>= 2).
        chunk_size: the scan's chunk length (``MambaSpec.chunk_size``).
        dtype: activations and conv state (``"float32"``, ``"float16"``, ``"bfloat16"``);
            the SSM state is float32.
        preempt: ``(step, request)``: the request is preempted before that step.
        num_pad_tokens: padded tokens appended to every step.
        spare_slots: extra slots no request owns (the last slot of the pool is one).
        seed: seeds inputs, layer parameters and slot ids.
        tags: what the case covers.
        verify: ``(step, request, accepted drafts)``: a verifying row (see the module docstring).
        prefix_hits: ``(request, source, tokens)``: a prefix-cache hit (see the module docstring).
    """

    name: str
    steps: tuple[tuple[tuple[int, int], ...], ...]
    num_heads: int = 4
    head_size: int = 4
    state_size: int = 6
    n_groups: int = 2
    conv_kernel_size: int = 4
    chunk_size: int = 4
    dtype: str = "float32"
    preempt: tuple[tuple[int, int], ...] = ()
    num_pad_tokens: int = 0
    spare_slots: int = 2
    seed: int = 0
    tags: tuple[str, ...] = field(default_factory=tuple)
    verify: tuple[tuple[int, int, int], ...] = ()
    prefix_hits: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self):
        problems = []
        if not self.steps or any(not st for st in self.steps):
            problems.append("steps must be non-empty lists of (request, tokens)")
        for s, st in enumerate(self.steps):
            reqs = [p[0] for p in st]
            if len(set(reqs)) != len(reqs) or any(len(p) != 2 or p[0] < 0 or p[1] < 1 for p in st):
                problems.append(f"steps[{s}]={st!r}: need distinct requests >= 0 with tokens >= 1")
        if self.n_groups <= 0 or self.num_heads % self.n_groups:
            problems.append(f"num_heads {self.num_heads} is not a multiple of n_groups {self.n_groups}")
        if self.conv_kernel_size < 2 or self.chunk_size < 1:
            problems.append("conv_kernel_size must be >= 2 and chunk_size >= 1")
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} not in {DTYPES}")
        if self.spare_slots < 1:
            problems.append("spare_slots must be >= 1 (the pool's last slot stays unowned)")
        problems += self._hybrid_problems()
        if problems:
            raise ValueError(f"state case {self.name!r}: " + "; ".join(problems))

    def _hybrid_problems(self) -> list[str]:
        problems = []
        for v in self.verify:
            s, r, a = v if len(v) == 3 else (-1, -1, -1)
            n = dict(self.steps[s]).get(r, 0) if 0 <= s < len(self.steps) else 0
            if n < 2 or not 0 <= a <= n - 1:
                problems.append(f"verify {v!r}: need (step, request, accepted) with the request scheduled "
                                f"1 + d >= 2 tokens in that step and 0 <= accepted <= d")
        first = {}
        for s, st in enumerate(self.steps):
            for r, _ in st:
                first.setdefault(r, s)
        for h in self.prefix_hits:
            r, src, n = h if len(h) == 3 else (-1, -1, -1)
            if r == src or n < 1 or r not in first or src not in first or first[src] >= first[r]:
                problems.append(f"prefix_hits {h!r}: need (request, source, tokens >= 1), the source scheduled "
                                "before the request's first step")
        return problems

    @property
    def num_requests(self) -> int:
        return 1 + max(r for st in self.steps for r, _ in st)

    def describe(self) -> str:
        """The case as one line of JSON (what failure messages show)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps"] = [[list(p) for p in st] for st in self.steps]
        d["preempt"] = [list(p) for p in self.preempt]
        d["tags"] = list(self.tags)
        d["verify"] = [list(v) for v in self.verify]
        d["prefix_hits"] = [list(h) for h in self.prefix_hits]
        return {"kind": "state", **d}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StateCase":
        """Build a case from a JSON object (``"kind": "state"`` optional; unknown keys are an error).

        Raises:
            ValueError: unknown keys or invalid values.
        """
        data = {k: v for k, v in data.items() if k != "kind"}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"state case {data.get('name')!r}: unknown keys {unknown}; known: {sorted(known)}")
        data["steps"] = tuple(tuple(tuple(int(x) for x in p) for p in st) for st in data.get("steps", ()))
        data["preempt"] = tuple(tuple(int(x) for x in p) for p in data.get("preempt", ()))
        data["tags"] = tuple(data.get("tags", ()))
        for key in ("verify", "prefix_hits"):
            data[key] = tuple(tuple(int(x) for x in p) for p in data.get(key, ()))
        return cls(**data)


def load_state_cases(path: str) -> list[StateCase]:
    """The state cases (objects with ``"kind": "state"``) of the JSON list in ``path``."""
    return [StateCase.from_dict(d) for d in read_case_list(path) if d.get("kind") == "state"]


def _s(name: str, steps, *tags: str, **kw) -> StateCase:
    return StateCase(name=name, steps=tuple(tuple(tuple(p) for p in st) for st in steps), tags=tags, **kw)


STATE_CASES: tuple[StateCase, ...] = (
    # chunked prefill: boundaries mid-chunk, the state carried across three steps
    _s("state_prefill_chunks", [[(0, 7), (1, 5)], [(0, 6)], [(0, 7), (1, 3)]], "prefill", "chunked"),
    # decodes after a prefill; request 1 is unscheduled in the last step (its slot must not change)
    _s("state_decode", [[(0, 6), (1, 3), (2, 1)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)],
                        [(0, 1), (2, 1)]], "decode"),
    # decode and prefill rows in one step, padded tokens
    _s("state_mixed_padded", [[(0, 5), (1, 9)], [(0, 1), (2, 6), (1, 1)], [(2, 1), (0, 3)]], "mixed", "padding",
       num_pad_tokens=3),
    # new requests into stale slots: a one-token prompt among decodes, a fresh prefill
    _s("state_fresh_slot", [[(0, 4)], [(0, 1), (1, 1)], [(0, 1), (1, 1), (2, 5)]], "fresh"),
    # preempt request 1 after two steps; it resumes later in a new slot and recomputes
    _s("state_preempt_resume", [[(0, 5), (1, 4)], [(0, 1), (1, 1)], [(0, 1)], [(1, 7), (0, 1)], [(1, 1)]],
       "preempt", preempt=((2, 1),)),
    # one B/C group, longer conv, larger heads
    _s("state_one_group", [[(0, 9), (1, 2)], [(0, 1), (1, 4)]], "groups", num_heads=2, head_size=8, n_groups=1,
       conv_kernel_size=3, chunk_size=8),
    _s("state_mixed_fp16", [[(0, 5), (1, 9)], [(0, 1), (1, 4)]], "dtype", dtype="float16", num_pad_tokens=2),
    _s("state_mixed_bf16", [[(0, 5), (1, 9)], [(0, 1), (1, 4)]], "dtype", dtype="bfloat16"),
    # --- the hybrid-state family (docs/conformance.md) ---
    # chunk boundaries at every offset: two requests whose chunks start at each position mod 4
    _s("state_chunk_offsets", [[(0, 1), (1, 3)], [(0, 2), (1, 5)], [(0, 3), (1, 2)], [(0, 5), (1, 7)],
                               [(0, 6), (1, 1)], [(0, 7), (1, 6)]], "chunked", "offsets"),
    # verifying rows: partial (1 of 3, 2 of 2, 1 of 1), none (0 of 2) and full (3 of 3) acceptance,
    # beside a prefill and padded tokens
    _s("state_spec_partial_acceptance", [[(0, 6), (1, 5)], [(0, 1), (1, 1)], [(0, 4), (1, 3)],
                                         [(0, 3), (1, 4), (2, 5)], [(0, 1), (1, 2), (2, 1)]], "spec",
       verify=((2, 0, 1), (2, 1, 0), (3, 0, 2), (3, 1, 3), (4, 1, 1)), num_pad_tokens=2),
    # a verifying request preempted: it resumes in new slots, recomputes, then verifies again
    _s("state_spec_preempt_resume", [[(0, 5), (1, 2)], [(0, 3), (1, 1)], [(0, 8), (1, 1)], [(0, 3), (1, 1)]],
       "spec", "preempt", verify=((1, 0, 1), (3, 0, 2)), preempt=((2, 0),)),
    # prefix-cache hits at 6 tokens (mid-chunk): one continues as a prefill, one as a decode
    _s("state_prefix_hit", [[(0, 3)], [(0, 3)], [(1, 7), (2, 1), (0, 1)], [(1, 1), (2, 1), (0, 1)]],
       "prefix", prefix_hits=((1, 0, 6), (2, 0, 6))),
)
"""The built-in state catalog: each case is a few dozen tokens."""
