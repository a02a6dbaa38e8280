"""negotiate_cudagraph_mode: the whole decision (mode, reason, limiting builder, capture) of
each path, compared exactly: graphs off, the mode as requested (full or not, CUDA or CPU,
the default device), a builder that lowers it, ties between equally capable builders; and the padding buffers' dtypes and batch_shape."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from attnplug.backends.emulators import FlashAttn3EmulatedBackend, FlashInferEmulatedBackend
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core.contracts import AttentionCGSupport, BuilderConfig
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.runner.execute.cudagraph import (
    CUDAGraphDispatcher,
    CUDAGraphMode,
    GraphModeDecision,
    PaddedMetadata,
    batch_shape,
    negotiate_cudagraph_mode,
)

FULL, DECODE, PIECEWISE, NONE = (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.PIECEWISE,
                                 CUDAGraphMode.NONE)
FA3, FI, TN = "FlashAttn3EmulatedBuilder", "FlashInferEmulatedBuilder", "TorchNativeMetadataBuilder"
ON_CPU = "; on cpu nothing is captured (steps are only padded)"


def _builders(*backends):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16)
    return [b.get_builder_cls()(spec, [f"l{i}"], BuilderConfig(8, 64, 256), "cpu") for i, b in enumerate(backends)]


def test_graphs_off():
    off = GraphModeDecision(NONE, "CUDA graphs are off (cudagraph_mode='none')", None, False)
    assert negotiate_cudagraph_mode(_builders(FlashAttn3EmulatedBackend), "none", "cuda") == off
    assert negotiate_cudagraph_mode(_builders(TorchNativeBackend), None) == off


def test_as_requested():
    fa3 = _builders(FlashAttn3EmulatedBackend)
    why = f"full as requested; the least capable builder is cache group 0 ({FA3}, {FA3}): ALWAYS"
    assert negotiate_cudagraph_mode(fa3, "full") == GraphModeDecision(FULL, why, None, True)  # default: CUDA
    assert negotiate_cudagraph_mode(fa3, "full", "cuda") == GraphModeDecision(FULL, why, None, True)
    assert negotiate_cudagraph_mode(fa3, "full", "cpu") == GraphModeDecision(FULL, why + ON_CPU, None, False)
    # piecewise is not a full mode: nothing to capture, no device note
    why = f"piecewise as requested; the least capable builder is cache group 0 ({FA3}, {FA3}): ALWAYS"
    for device in ("cuda", "cpu"):
        assert negotiate_cudagraph_mode(fa3, "piecewise", device) == GraphModeDecision(PIECEWISE, why, None, False)
    assert negotiate_cudagraph_mode([], "full", "cpu") == GraphModeDecision(FULL, "full as requested" + ON_CPU,
                                                                            None, False)


def test_the_first_of_equally_capable_builders_is_named():
    d = negotiate_cudagraph_mode(_builders(FlashAttn3EmulatedBackend, FlashAttn3EmulatedBackend), "full", "cuda",
                                 names=["a", "b"])
    assert d == GraphModeDecision(FULL, f"full as requested; the least capable builder is cache group 0 (a, {FA3}): "
                                        "ALWAYS", None, True)


def test_a_builder_that_lowers_the_mode():
    lim = f"cache group 1 (fi, {FI}): UNIFORM_SINGLE_TOKEN_DECODE"
    why = f"full_decode_only instead of full: {lim} limits it; only pure single-token-decode steps run in full graphs"
    b = _builders(FlashAttn3EmulatedBackend, FlashInferEmulatedBackend)
    assert negotiate_cudagraph_mode(b, "full", "cuda", names=["fa", "fi"]) == GraphModeDecision(DECODE, why, lim, True)
    assert negotiate_cudagraph_mode(b, "full", "cpu", names=["fa", "fi"]) == GraphModeDecision(
        DECODE, why + ON_CPU, lim, False)
    lim = f"cache group 0 ({TN}, {TN}): NEVER"
    why = (f"piecewise instead of full_decode_only: {lim} limits it; attention cannot be captured, and attnplug "
           "has no piecewise compilation: steps run eagerly")
    assert negotiate_cudagraph_mode(_builders(TorchNativeBackend), "full_decode_only", "cpu") == GraphModeDecision(
        PIECEWISE, why, lim, False)


def test_batch_shape_of_an_empty_and_a_mixed_step():
    assert batch_shape(np.zeros(0, dtype=np.int32)) == (0, 0, 0)
    assert batch_shape(np.array([3, 1, 2], dtype=np.int32)) == (6, 3, 3)


def test_padded_metadata_keeps_the_dtypes():
    cm = CommonAttentionMetadata.from_lengths([4, 0], [1, 3], [[1, 2], [3, 0]], 4, num_prompt_tokens=[5, 3])
    (p,) = PaddedMetadata(4, "cpu").pad([cm], 4)
    assert p.query_start_loc.dtype == p.seq_lens.dtype == p.num_computed_tokens_cpu.dtype == torch.int32
    assert p.is_prefilling.dtype == torch.bool and p.is_prefilling.tolist() == [True, True, False, False]
    assert p.num_computed_tokens_cpu.tolist() == [4, 0, 0, 0]


def test_each_builder_is_asked_about_its_own_spec():
    (fa3,) = _builders(FlashAttn3EmulatedBackend)

    class BySpec(type(fa3)):
        """A plugin whose support depends on the group's block size."""

        @classmethod
        def get_cudagraph_support(cls, kv_cache_spec=None):
            small = kv_cache_spec is not None and kv_cache_spec.block_size <= 16
            return AttentionCGSupport.ALWAYS if small else AttentionCGSupport.NEVER

    b = BySpec(fa3.kv_cache_spec, ["l0"], BuilderConfig(8, 64, 256), "cpu")
    assert negotiate_cudagraph_mode([b], "full", "cuda", names=["p"]).mode is FULL


def test_pad_reads_only_the_real_requests_offsets_and_keeps_a_missing_prefill_mask_missing():
    cm = CommonAttentionMetadata.from_lengths([4, 0], [1, 3], [[1, 2], [3, 0]], 4)
    cm = cm.replace(query_start_loc_cpu=torch.tensor([0, 1, 4, 9, 9], dtype=torch.int32), is_prefilling=None)
    (p,) = PaddedMetadata(4, "cpu").pad([cm], 3)
    assert p.query_start_loc_cpu.tolist() == [0, 1, 4, 4] and p.is_prefilling is None


def test_dispatch_edges():
    d = CUDAGraphDispatcher(FULL, [1, 2, 4, 8, 16, 32, 40], max_num_reqs=16, max_num_batched_tokens=40)
    assert d.dispatch(1, 1, 1).key == (1, 1, True)  # a single decode is a uniform decode
    assert d.dispatch(40, 2, 20).key == (40, 2, False)  # exactly the token limit
    assert not d.dispatch(0, 0, 0).uniform_decode and not d.dispatch(0, 0, 1).uniform_decode  # no request
    for args, problem in (((-1, 0, 0), "counts must be non-negative ints"),
                          ((2, 3, 1), "every request has 1..num_tokens query tokens")):
        with pytest.raises(MetadataError, match="^" + re.escape(
                f"dispatch(num_tokens={args[0]}, num_reqs={args[1]}, max_query_len={args[2]}): {problem}") + "$"):
            d.dispatch(*args)
