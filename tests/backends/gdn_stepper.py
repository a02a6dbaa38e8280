"""The GDN test stepper (registered as the module ``gdn_stepper`` by ``tests/backends/conftest.py``):
a layer with the parameters a GDN impl reads, and a runner-like loop of builder + impl steps
over state slots, for the gdn_torch, gdn_triton and gdn_fla tests."""

from __future__ import annotations

import torch
from torch import nn

from attnplug.backends.state.gdn import GDNMetadataBuilder, GDNTorchBackend
from attnplug.core.contracts import BuilderConfig
from attnplug.core.gdn import GDNLayerConfig
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.runner.models.qwen3_next import gdn_state_spec

LCFG = GDNLayerConfig(num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=3, conv_kernel_size=4, chunk_size=4)
SPEC = gdn_state_spec(LCFG, block_size=4)


class Layer(nn.Module):
    """The parameters a GDN impl reads, HF names."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        c = LCFG.conv_dim
        self.conv1d = nn.Conv1d(c, c, LCFG.conv_kernel_size, groups=c, bias=False)
        with torch.no_grad():
            self.conv1d.weight.copy_(torch.randn(c, 1, LCFG.conv_kernel_size, generator=g) * 0.5)
        self.A_log = nn.Parameter(torch.log(torch.tensor([1.0, 3.0])))
        self.dt_bias = nn.Parameter(torch.randn(2, generator=g))


class Stepper:
    def __init__(self, num_slots=8):
        self.impl = GDNTorchBackend.get_impl_cls()(LCFG)
        self.builder = GDNMetadataBuilder(SPEC, ["l"], BuilderConfig(8, 64, 128), "cpu")
        self.state = GDNTorchBackend.allocate_state_cache(SPEC, num_slots, "cpu")
        self.layer = Layer()

    def step(self, rows, pad=0):
        cm = CommonAttentionMetadata.from_lengths([c for _, c, _ in rows], [x[0].shape[0] for _, _, x in rows],
                                                  [[s] for s, _, _ in rows], block_size=1024)
        md = self.builder.build(0, cm)
        qkv, a, b = (torch.cat([x[i] for _, _, x in rows] + [torch.full((pad, x.shape[1]), 9.0)])
                     for i, x in enumerate(rows[0][2]))
        out = torch.full((qkv.shape[0], LCFG.num_v_heads, LCFG.head_v_dim), -7.0)
        self.impl.forward(self.layer, qkv, a, b, self.state, md, out)
        return out, md


def _seq(seed, n):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, LCFG.conv_dim, generator=g), torch.randn(n, LCFG.num_v_heads, generator=g),
            torch.randn(n, LCFG.num_v_heads, generator=g))


def _part(x, lo, hi):
    return tuple(t[lo:hi] for t in x)
