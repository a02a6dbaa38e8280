"""Mamba2Impl over state slots: chunked continuation == one shot, decodes, stale slots, dtypes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from attnplug.backends.mamba2 import Mamba2Backend, Mamba2MetadataBuilder
from attnplug.cache_groups.specs import MambaSpec
from attnplug.core.contracts import BuilderConfig
from attnplug.core.mamba import MambaLayerConfig
from attnplug.core.metadata import CommonAttentionMetadata

LCFG = MambaLayerConfig(num_heads=4, head_size=3, state_size=5, n_groups=2, conv_kernel_size=4, chunk_size=4)
SPEC = MambaSpec(block_size=4, conv_state_shape=LCFG.conv_state_shape, ssm_state_shape=LCFG.ssm_state_shape,
                 chunk_size=LCFG.chunk_size)


class Layer(nn.Module):
    """The parameters a Mamba2Impl reads, HF names."""

    def __init__(self, seed=0, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        c = LCFG.conv_dim
        self.conv1d = nn.Conv1d(c, c, LCFG.conv_kernel_size, groups=c, bias=True, dtype=dtype)
        with torch.no_grad():
            self.conv1d.weight.copy_(torch.randn(c, 1, LCFG.conv_kernel_size, generator=g) * 0.5)
            self.conv1d.bias.copy_(torch.randn(c, generator=g) * 0.1)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, 5, dtype=torch.float32)).to(dtype))
        self.D = nn.Parameter(torch.rand(4, generator=g).to(dtype))
        self.dt_bias = nn.Parameter(torch.randn(4, generator=g).to(dtype))


class Stepper:
    """Runs impl steps for (slot, num_computed, xbc, dt) rows, like the runner would."""

    def __init__(self, dtype=torch.float32, num_slots=8, layer_cfg=LCFG):
        self.impl = Mamba2Backend.get_impl_cls()(layer_cfg)
        self.builder = Mamba2MetadataBuilder(SPEC, ["m"], BuilderConfig(8, 64, 128), "cpu")
        self.state = Mamba2Backend.allocate_state_cache(dataclasses.replace(SPEC, dtype=dtype), num_slots, "cpu")
        self.layer = Layer(dtype=dtype)
        self.dtype = dtype

    def step(self, rows, pad=0):
        cm = CommonAttentionMetadata.from_lengths([c for _, c, _, _ in rows], [x.shape[0] for _, _, x, _ in rows],
                                                  [[s] for s, _, _, _ in rows], block_size=1024)
        md = self.builder.build(0, cm)
        xbc = torch.cat([x for _, _, x, _ in rows] + [torch.full((pad, LCFG.conv_dim), 9.0)]).to(self.dtype)
        dt = torch.cat([d for _, _, _, d in rows] + [torch.full((pad, LCFG.num_heads), 9.0)]).to(self.dtype)
        out = torch.full((xbc.shape[0], LCFG.intermediate_size), -7.0, dtype=self.dtype)
        self.impl.forward(self.layer, xbc, dt, self.state, md, out)
        return out, md


def _seq(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, LCFG.conv_dim, generator=g), torch.randn(n, LCFG.num_heads, generator=g)


def test_chunked_prefill_and_decodes_continue_exactly_like_one_shot():
    xa, da = _seq(1, 19)
    xb, db = _seq(2, 11)
    ref = Stepper()
    ya, _ = ref.step([(1, 0, xa, da)])
    yb, _ = ref.step([(2, 0, xb, db)])

    run = Stepper()
    plan_a = [(0, 6), (6, 7), (7, 16), (16, 17), (17, 18), (18, 19)]   # prefill, decode, prefill, decodes
    plan_b = [(0, 1), (1, 5), (5, 6), (6, 10), (10, 11), None]          # 1-token first chunk, ...
    got_a, got_b = [], []
    for pa, pb in zip(plan_a, plan_b):
        rows, who = [], []
        for slot, plan, x, d, who_ in ((3, pa, xa, da, "a"), (5, pb, xb, db, "b")):
            if plan is not None:
                rows.append((slot, plan[0], x[plan[0]:plan[1]], d[plan[0]:plan[1]]))
                who.append(who_)
        # decodes first, as the runner orders rows
        order = sorted(range(len(rows)), key=lambda i: rows[i][2].shape[0] != 1)
        rows, who = [rows[i] for i in order], [who[i] for i in order]
        out, md = run.step(rows, pad=2)
        assert (out[md.num_actual_tokens:] == -7.0).all(), "padded rows were written"
        off = 0
        for w, (_, _, x, _) in zip(who, rows):
            (got_a if w == "a" else got_b).append(out[off:off + x.shape[0]])
            off += x.shape[0]
    torch.testing.assert_close(torch.cat(got_a), ya, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(got_b), yb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run.state.ssm_state[3], ref.state.ssm_state[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run.state.conv_state[5], ref.state.conv_state[2])


def test_stale_slot_contents_are_ignored_without_initial_state():
    xa, da = _seq(3, 5)
    clean, dirty = Stepper(), Stepper()
    dirty.state.conv_state.fill_(1e3)
    dirty.state.ssm_state.fill_(float("nan"))
    rows = [(2, 0, xa[:1], da[:1]), (4, 0, xa, da)]   # a one-token prompt (decode path) and a prefill
    torch.testing.assert_close(dirty.step(rows)[0], clean.step(rows)[0])
    torch.testing.assert_close(dirty.state.ssm_state[[2, 4]], clean.state.ssm_state[[2, 4]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_activations_keep_float32_ssm_state(dtype):
    xa, da = _seq(4, 9)
    lo, hi = Stepper(dtype), Stepper()
    rows = [(1, 0, xa, da)]
    y_lo, y_hi = lo.step(rows)[0], hi.step(rows)[0]
    assert y_lo.dtype == dtype and lo.state.ssm_state.dtype == torch.float32 and lo.state.conv_state.dtype == dtype
    torch.testing.assert_close(y_lo.float(), y_hi, rtol=5e-2, atol=5e-2)


def test_validate_configuration_lists_every_reason():
    bad = MambaLayerConfig(num_heads=6, head_size=3, state_size=5, n_groups=4, conv_kernel_size=4, chunk_size=0,
                           ssm_dtype=torch.float16, activation="gelu")
    reasons = Mamba2Backend.validate_configuration(bad)
    text = " | ".join(reasons)
    assert "n_groups" in text and "chunk_size" in text and "gelu" in text and "ssm state dtype" in text
    assert Mamba2Backend.validate_configuration(LCFG) == []


def test_time_step_limit_clamps_decode_and_prefill_alike():
    clamped = dataclasses.replace(LCFG, time_step_limit=(0.2, 0.6))
    xa, da = _seq(5, 6)
    one, split = Stepper(layer_cfg=clamped), Stepper(layer_cfg=clamped)
    y_one = one.step([(1, 0, xa, da)])[0]
    y_split = torch.cat([split.step([(1, i, xa[i:i + 1], da[i:i + 1])])[0] for i in range(6)])
    torch.testing.assert_close(y_split, y_one, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(y_one, Stepper().step([(1, 0, xa, da)])[0]), "the clamp had no effect"
