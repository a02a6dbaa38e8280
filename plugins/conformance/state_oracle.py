"""A state case's inputs and layer parameters, and the reference recurrence of its kind.

Every token's inputs depend only on (seed, request, position), so runs that batch, order
or preempt requests differently see the same inputs. The reference runs each request
token by token in float64 from a zero state, with the definitions of the backend's state
kind (``state_kinds.py``: Mamba2 as ``core/mamba.py``, Gated DeltaNet as ``core/gdn.py``),
and keeps, after every position, each declared state tensor (the conv state: the last
``K - 1`` raw inputs, oldest first; the SSM / recurrent state).
"""

from __future__ import annotations

import types

import torch

from attnplug.plugins.conformance.requirements import torch_dtype
from attnplug.plugins.conformance.state_cases import StateCase
from attnplug.plugins.conformance.state_kinds import Mamba2Kind


def request_plan(case: StateCase) -> tuple[list[int], list[int], list[int]]:
    """``(reach, prompt_lens, starts)`` per request: positions the schedule reaches (drafts
    included), the prompt the harness admits (the whole reach, or up to the first verifying
    step's last real token: a verifying row has exactly one real token left), and the
    tokens a prefix hit starts from (0 without one). A verifying step advances the request
    by ``1 + accepted``."""
    n_req = case.num_requests
    starts = [0] * n_req
    for r, _, h in case.prefix_hits:
        starts[r] = h
    done, reach, prompt = list(starts), list(starts), [0] * n_req
    verify = {(s, r): a for s, r, a in case.verify}
    preempt = set(case.preempt)
    for s, step in enumerate(case.steps):
        for r in range(n_req):
            if (s, r) in preempt:
                done[r] = 0
        for r, n in step:
            reach[r] = max(reach[r], done[r] + n)
            a = verify.get((s, r))
            if a is not None and not prompt[r]:
                prompt[r] = done[r] + 1
            done[r] += n if a is None else 1 + a
    return reach, [p or n for p, n in zip(prompt, reach)], starts


def request_lengths(case: StateCase) -> list[int]:
    """Tokens each request reaches (the furthest position + 1 over the schedule, drafts included)."""
    return request_plan(case)[0]


class StateInputs:
    """Per request ``i`` with ``L_i`` tokens: ``fields[i]``, the kind's per-token inputs
    (``kind.input_widths``: Mamba2 ``xBC`` ``[L_i, conv_dim]`` and ``dt`` ``[L_i, num_heads]``;
    GDN ``mixed_qkv``, ``a``, ``b``) in the case dtype; ``layer``: the parameters an impl
    reads (HF names: ``conv1d.weight`` ``[conv_dim, 1, K]``, ``conv1d.bias``, ``A_log``,
    ``dt_bias``, Mamba2's ``D``), in the case dtype, on ``device``. ``rejected[i]``: other
    inputs of the same shapes, fed at rejected draft positions. A prefix hit's first
    ``tokens`` inputs are its source's.

    Args:
        case: the state case.
        device: where ``layer`` lives.
        kind: the kind model (``state_kinds.KINDS``; default Mamba2).
    """

    def __init__(self, case: StateCase, device: torch.device | str = "cpu", kind=Mamba2Kind):
        self.case, self.kind = case, kind
        dtype = torch_dtype(case.dtype)
        widths = kind.input_widths(case)
        self.conv_dim = widths[0]
        g = torch.Generator().manual_seed(case.seed * 104729 + 17)
        self.params = {k: v.to(dtype) for k, v in kind.params(case, g).items()}
        others = {k: v.to(device) for k, v in self.params.items() if k not in ("weight", "bias")}
        self.layer = types.SimpleNamespace(
            conv1d=types.SimpleNamespace(weight=self.params["weight"].to(device), bias=self.params["bias"].to(device)),
            **others)
        self.fields, self.rejected = [], []
        for i, n in enumerate(request_lengths(case)):
            gi = torch.Generator().manual_seed(case.seed * 7919 + i)
            self.fields.append(self._draw(n, widths, gi, dtype))
            self.rejected.append(self._draw(n, widths, gi, dtype))
        for r, src, h in case.prefix_hits:   # a hit shares the source's first h inputs
            for mine, theirs in zip(self.fields[r], self.fields[src]):
                mine[:h] = theirs[:h]

    @staticmethod
    def _draw(n: int, widths, g: torch.Generator, dtype) -> list[torch.Tensor]:
        """The first input (what the conv reads) ~ N(0, 1); the others (gate inputs) ~ N(0, 0.25)."""
        return [(torch.randn(n, w, generator=g) * (1.0 if j == 0 else 0.5)).to(dtype) for j, w in enumerate(widths)]


class Reference:
    """The float64 recurrence of every request (the kind's ``reference``).

    Attributes:
        y: per request, ``[L_i, *kind.output_shape]`` float64 outputs.
        states: per request, a tuple (declaration order) of ``[L_i + 1, *shape]``: each
            state tensor after ``t`` tokens (row 0: zeros).
    """

    def __init__(self, inputs: StateInputs):
        case, kind = inputs.case, inputs.kind
        params = {k: v.cpu() for k, v in inputs.params.items()}
        self.y, self.states = [], []
        for fields in inputs.fields:
            y, states = kind.reference(case, params, fields)
            self.y.append(y)
            self.states.append(states)
