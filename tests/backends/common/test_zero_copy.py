"""Zero-copy lowering on real steps: the tensors the triton and flash_attn metadata hand to
the kernels keep their addresses from step to step (what a captured CUDA graph reads).

Eager builds pass the step compiler's views through, so their addresses are the step's
persistent buffers (``runner/step/prepare.py``, ``cache_groups/block_table.py``); graph
builds (after the runner's padding, ``runner/execute/cudagraph.py``) copy into the
builder's own buffers. Both are checked over steps whose batch changes (requests finish
and arrive, block tables grow), and the contents must be the step's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.backends.emulators.backends import FlashAttn3EmulatedBackend
from attnplug.backends.triton import TritonMetadataBuilder
from attnplug.cache_groups.specs import FullAttentionSpec, cdiv
from attnplug.core.contracts import BuilderConfig
from attnplug.runner.commands.bench.workloads import steady_decode
from attnplug.runner.execute.cudagraph import PaddedMetadata
from attnplug.runner.execute.group_metadata import GroupMetadataBuilder
from attnplug.runner.step.compiler import StepCompiler

N, STEPS, BLOCK = 8, 6, 16
BUILDERS = {"triton": TritonMetadataBuilder, "flash_attn3": FlashAttn3EmulatedBackend.get_builder_cls()}
FIELDS = {"triton": ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"),
          "flash_attn3": ("query_start_loc", "seq_lens", "block_table", "slot_mapping")}


def _steps():
    w = steady_decode(N, STEPS)
    cfg = dict(w.config)
    sc = StepCompiler(cfg.pop("block_sizes"), **cfg)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32)
    bcfg = BuilderConfig(cfg["max_num_reqs"], cfg["max_num_batched_tokens"], cfg["max_model_len"])
    for so in w.steps:
        sc.update_states(so)
        inputs = sc.prepare_inputs(so)
        yield spec, bcfg, inputs
        keep = np.flatnonzero(~inputs.discard)
        sc.append_output_tokens(keep, np.ones(keep.shape[0], dtype=np.int64))


def _ptrs(md, fields):
    return [getattr(md, f).data_ptr() for f in fields]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_eager_builds_read_the_steps_persistent_buffers(name):
    fields, seen, builders = FIELDS[name], set(), None
    for spec, bcfg, inputs in _steps():
        if builders is None:
            builders = [BUILDERS[name](spec, [f"l{g}"], bcfg, "cpu") for g in range(2)]
            group = GroupMetadataBuilder(builders, [["l0"], ["l1"]])
        per_group, _ = group.build(inputs.common_attn_metadata)
        assert group.counters.reuses == 1, "the second group shares the build (update_block_table)"
        for g, (md, cm) in enumerate(zip(per_group, inputs.common_attn_metadata)):
            assert _ptrs(md, fields) == [t.data_ptr() for t in (cm.query_start_loc, cm.seq_lens,
                                                                 cm.block_table_tensor, cm.slot_mapping)]
            seen.add((g, *_ptrs(md, fields)))
    assert len(seen) == 2, f"one address set per group across {STEPS} steps, got {len(seen)}"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_graph_builds_keep_their_addresses_and_read_the_step(name):
    fields, seen, builders, padded = FIELDS[name], set(), None, None
    for spec, bcfg, inputs in _steps():
        if builders is None:
            builders = [BUILDERS[name](spec, [f"l{g}"], bcfg, "cpu") for g in range(2)]
            group = GroupMetadataBuilder(builders, [["l0"], ["l1"]])
            padded = PaddedMetadata(bcfg.max_num_reqs, "cpu")
        R = inputs.num_reqs
        common = padded.pad(inputs.common_attn_metadata, bcfg.max_num_reqs)
        per_group, _ = group.build(common, for_cudagraph=True)
        for g, (md, cm) in enumerate(zip(per_group, common)):
            assert md.graph
            seen.add((g, *_ptrs(md, fields), md.query_start_loc.shape[0]))
            step = inputs.common_attn_metadata[g]
            assert torch.equal(md.query_start_loc[: R + 1], step.query_start_loc)
            assert torch.equal(md.seq_lens[:R], step.seq_lens)
            assert torch.equal(md.slot_mapping, step.slot_mapping)
            live = cdiv(step.max_seq_len, BLOCK)
            table = getattr(md, fields[2])
            assert torch.equal(table[:R, :live], step.block_table_tensor[:, :live])
            assert table.data_ptr() == builders[g]._block_table.data_ptr(), "the builder's own buffer"
    assert len(seen) == 2, f"one address set per group across {STEPS} steps, got {len(seen)}"
