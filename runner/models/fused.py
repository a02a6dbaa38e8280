"""Projections that read the same input, run as one matmul: q/k/v and gate/up.

vLLM stacks these weights at load (its ``QKVParallelLinear`` and
``MergedColumnParallelLinear``); attnplug stacks them at construction and keeps the HF
modules and parameter names: ``self_attn.q_proj.weight`` etc. stay ``nn.Linear``
parameters, but their storage is a row slice of one fused tensor, the owner's
non-persistent buffer ``<name>_weight`` (``[sum of out_features, in_features]``, rows in
the order the parts are listed; ``<name>_bias`` likewise, or ``None``). So everything that
writes the HF parameters in place (``load_hf_state_dict``, ``init_weights``, GGUF and
tensor-parallel loading, ``load_state_dict``) writes the fused tensor, ``state_dict()``
still has the HF keys and no fused key, and the forward runs one ``F.linear`` instead of
three (or two).

``nn.Module.to`` / ``.half()`` / ``.cuda()`` replace each parameter's ``.data``, which
would end the aliasing; :meth:`FusedProjections._apply` re-stacks afterwards. Inference
only: no gradient reaches the HF parameters through the fused tensor.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from attnplug.runner.models.cpu_linear import linear


def stack_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the ``weight`` (and ``bias``) rows of ``linears`` into one new tensor each and
    give every linear new ``Parameter`` objects that are views of its rows.

    Args:
        linears: ``nn.Linear`` modules with one ``in_features``, dtype and device; all with a
            bias or none.

    Returns:
        ``weight`` ``[sum(out_features), in_features]`` and ``bias`` ``[sum(out_features)]``
        or ``None``, contiguous, the linears' dtype and device.

    Raises:
        ValueError: the linears disagree on ``in_features``, dtype, device or having a bias.
    """
    first = linears[0].weight
    has_bias = linears[0].bias is not None
    for lin in linears:
        w = lin.weight
        if (w.shape[1], w.dtype, w.device, lin.bias is not None) != (first.shape[1], first.dtype, first.device,
                                                                       has_bias):
            raise ValueError(f"stack_rows: linears disagree: {[tuple(x.weight.shape) for x in linears]}, "
                             f"{[x.weight.dtype for x in linears]}, biases {[x.bias is not None for x in linears]}")
    sizes = [lin.out_features for lin in linears]
    with torch.no_grad():
        weight = torch.cat([lin.weight.detach() for lin in linears])
        bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    # new Parameters over the views (not ``.data =``): they share the fused tensor's version
    # counter, so an in-place write through them shows on the fused tensor (cpu_linear's
    # packed copy is keyed on it)
    for lin, w in zip(linears, weight.split(sizes)):
        lin.weight = nn.Parameter(w, requires_grad=lin.weight.requires_grad)
    if bias is not None:
        for lin, b in zip(linears, bias.split(sizes)):
            lin.bias = nn.Parameter(b, requires_grad=lin.bias.requires_grad)
    return weight, bias


class FusedProjections:
    """Mixin for an ``nn.Module`` whose :attr:`fused_parts` name groups of its ``nn.Linear``
    children that share an input: ``{"qkv": ("q_proj", "k_proj", "v_proj")}``.

    Call :meth:`fuse_projections` at the end of ``__init__`` (and again after replacing one
    of the parts); :meth:`project` runs a group as one matmul.
    """

    fused_parts: ClassVar[dict[str, tuple[str, ...]]] = {}

    def fuse_projections(self) -> None:
        """(Re)build every group's fused ``<name>_weight`` / ``<name>_bias`` buffers from its
        parts' current parameters and alias the parts to them (:func:`stack_rows`)."""
        sizes = {}
        for name, parts in self.fused_parts.items():
            linears = [getattr(self, p) for p in parts]
            weight, bias = stack_rows(linears)
            self.register_buffer(f"{name}_weight", weight, persistent=False)
            self.register_buffer(f"{name}_bias", bias, persistent=False)
            sizes[name] = [lin.out_features for lin in linears]
        self.__dict__["fused_sizes"] = sizes

    def project(self, name: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Group ``name`` applied to ``x`` ``[num_tokens, in_features]``: one
        ``[num_tokens, out_features]`` output per part, in :attr:`fused_parts` order (column
        views of :meth:`project_joined`'s result, row stride ``sum(out_features)``)."""
        return self.project_joined(name, x).split(self.fused_sizes[name], dim=-1)

    def project_joined(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Group ``name``'s one matmul: ``x`` ``[num_tokens, in_features]`` ->
        ``[num_tokens, sum(out_features)]``, the parts' columns side by side in
        :attr:`fused_parts` order (on the CPU through ``cpu_linear.linear``, the fused weight
        prepacked)."""
        buffers = self._buffers
        return linear(x, buffers[f"{name}_weight"], buffers[f"{name}_bias"], self, name)  # prepacked on the CPU

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (``to``, ``half``, ``cuda``...), then re-stack: the conversion
        gave every parameter and buffer new storage."""
        out = super()._apply(fn, recurse)
        if recurse:
            self.fuse_projections()
        return out


def fusion_intact(module: nn.Module) -> bool:
    """Whether every :class:`FusedProjections` in ``module`` still has each part's parameters
    stored in its fused buffers (what a test or a caller that replaced ``.data`` can check)."""
    for m in module.modules():
        if not isinstance(m, FusedProjections):
            continue
        for name, parts in m.fused_parts.items():
            for suffix in ("weight", "bias"):
                fused = m._buffers[f"{name}_{suffix}"]
                tensors = [getattr(getattr(m, p), suffix) for p in parts]
                if fused is None:
                    if any(t is not None for t in tensors):
                        return False
                    continue
                base = fused.untyped_storage().data_ptr()
                offset = 0
                for t in tensors:
                    if (t.untyped_storage().data_ptr() != base
                            or t.storage_offset() != fused.storage_offset() + offset):
                        return False
                    offset += t.numel()
    return True


__all__ = ["FusedProjections", "fusion_intact", "stack_rows"]
