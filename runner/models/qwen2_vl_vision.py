"""The Qwen2-VL vision tower: pixel patches of one image -> its language-model embeddings.

Module tree and parameter names match HF ``Qwen2VLForConditionalGeneration``'s
``model.visual`` so that its state dict loads key for key::

    patch_embed.proj.weight      [embed_dim, C, temporal_patch, patch, patch] (HF's Conv3d,
                                 stride = kernel: one matrix product per patch here)
    blocks.N.norm1 / norm2       LayerNorm(embed_dim, eps 1e-6)
    blocks.N.attn.qkv / proj     Linear (bias)
    blocks.N.mlp.fc1 / fc2       Linear (bias), quick_gelu between
    merger.ln_q                  LayerNorm(embed_dim, eps 1e-6)
    merger.mlp.0 / mlp.2         Linear(embed_dim * m^2, embed_dim * m^2), GELU, Linear(..., hidden_size)

Conventions (transformers' ``modeling_qwen2_vl.py`` and ``vision_utils.py``; facts, not code):

* ``pixel_values`` of an image with patch grid ``(t, H, W)`` are ``[t * H * W, patch_dim]``, the
  patches ordered block-major over ``m x m`` merge blocks (the image processor's order);
* 2-D rotary: head size ``d``; inverse frequencies ``theta ** (-arange(0, d/2, 2) / (d/2))``;
  a patch at grid row ``y``, column ``x`` has angles ``[y * f, x * f]`` over the first half of
  the head, paired rotate-half style with the second half;
* attention is bidirectional within each temporal frame (``H * W`` patches), never across;
* the merger folds each run of ``m^2`` consecutive patches (one merge block) into one token.
"""

from __future__ import annotations

import torch
from torch import nn

from attnplug.runner.models.qwen2_vl_config import Qwen2VLVisionConfig
from attnplug.runner.models.rope import rotate


def vision_patch_positions(grid_thw: tuple[int, int, int], merge: int, device) -> torch.Tensor:
    """``[t * H * W, 2]`` int64 ``(row, column)`` of each patch, block-major over
    ``merge x merge`` blocks, repeated for each of the ``t`` frames."""
    t, h, w = grid_thw
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    ys, xs = ys.reshape(shape).transpose(1, 2).flatten(), xs.reshape(shape).transpose(1, 2).flatten()
    return torch.stack([ys, xs], dim=-1).repeat(t, 1)


class PatchEmbed(nn.Module):
    """HF's stride-equals-kernel ``Conv3d`` (no bias) as a matrix product per patch."""

    def __init__(self, cfg: Qwen2VLVisionConfig, dtype, device):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(cfg.embed_dim, cfg.in_channels, cfg.temporal_patch_size,
                                                    cfg.patch_size, cfg.patch_size, dtype=dtype, device=device))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, patch_dim]`` -> ``[N, embed_dim]``."""
        w = self.proj.weight
        return pixel_values.to(w.dtype) @ w.reshape(w.shape[0], -1).t()


class VisionAttention(nn.Module):
    def __init__(self, cfg: Qwen2VLVisionConfig, dtype, device):
        super().__init__()
        self.num_heads, self.head_size = cfg.num_heads, cfg.embed_dim // cfg.num_heads
        self.qkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim, dtype=dtype, device=device)
        self.proj = nn.Linear(cfg.embed_dim, cfg.embed_dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame_len: int) -> torch.Tensor:
        """``x`` ``[N, embed_dim]``; attention within each run of ``frame_len`` patches."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_size).unbind(1)
        q = rotate(q.float(), cos, sin).to(x.dtype)
        k = rotate(k.float(), cos, sin).to(x.dtype)
        frames = n // frame_len  # [frames, heads, frame_len, head_size]
        q, k, v = (t.view(frames, frame_len, self.num_heads, self.head_size).transpose(1, 2) for t in (q, k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, scale=self.head_size ** -0.5)
        return self.proj(out.transpose(1, 2).reshape(n, -1))


class VisionMlp(nn.Module):
    def __init__(self, cfg: Qwen2VLVisionConfig, dtype, device):
        super().__init__()
        width = int(cfg.embed_dim * cfg.mlp_ratio)
        self.fc1 = nn.Linear(cfg.embed_dim, width, dtype=dtype, device=device)
        self.fc2 = nn.Linear(width, cfg.embed_dim, dtype=dtype, device=device)
        self.quick = cfg.hidden_act == "quick_gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = h * torch.sigmoid(1.702 * h) if self.quick else nn.functional.gelu(h)
        return self.fc2(h)


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen2VLVisionConfig, dtype, device):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.embed_dim, eps=1e-6, dtype=dtype, device=device)
        self.norm2 = nn.LayerNorm(cfg.embed_dim, eps=1e-6, dtype=dtype, device=device)
        self.attn = VisionAttention(cfg, dtype, device)
        self.mlp = VisionMlp(cfg, dtype, device)

    def forward(self, x, cos, sin, frame_len):
        x = x + self.attn(self.norm1(x), cos, sin, frame_len)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: Qwen2VLVisionConfig, dtype, device):
        super().__init__()
        self.width = cfg.embed_dim * cfg.spatial_merge_size ** 2
        self.ln_q = nn.LayerNorm(cfg.embed_dim, eps=1e-6, dtype=dtype, device=device)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width, dtype=dtype, device=device), nn.GELU(),
                                 nn.Linear(self.width, cfg.hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTower(nn.Module):
    """HF's ``Qwen2VisionTransformerPretrainedModel`` for one image at a time.

    Args:
        cfg: the vision config; ``dtype``, ``device``: of parameters and activations.
    """

    def __init__(self, cfg: Qwen2VLVisionConfig, dtype: torch.dtype, device):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, dtype, device)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype, device) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, dtype, device)
        half = cfg.embed_dim // cfg.num_heads // 2
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32,
                                                                                device=device) / half),
                             persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's ``pixel_values`` ``[t * H * W, patch_dim]`` with patch grid ``grid_thw``
        ``(t, H, W)`` (``H``, ``W`` multiples of ``spatial_merge_size``) -> ``[t * H * W / m^2,
        hidden_size]`` in the model dtype: the embeddings of its placeholder tokens, in order."""
        t, h, w = (int(g) for g in grid_thw)
        pos = vision_patch_positions((t, h, w), self.cfg.spatial_merge_size, pixel_values.device)
        angles = (pos.unsqueeze(-1).float() * self.inv_freq).flatten(1)  # [N, d/2]: rows then columns
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        x = self.patch_embed(pixel_values)
        for blk in self.blocks:
            x = blk(x, cos, sin, h * w)
        return self.merger(x)
