"""The Mamba2 builder's layout of verifying rows (speculative decoding, backends/mamba2/verify.py):
the worked example, and the bad inputs it refuses (one line, nothing built)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.backends.mamba2 import Mamba2Backend
from attnplug.backends.mamba2.verify import compute_verify_layout
from attnplug.cache_groups.specs import MambaSpec
from attnplug.core.contracts import BuilderConfig
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata


def test_worked_example():
    lay = compute_verify_layout(np.array([0, 1, 4, 9, 11]), np.array([0, 2, 0, 1]), 1, 4)
    assert lay.verify_rows.tolist() == [1, 3] and lay.max_verify_len == 3
    assert lay.verify_token_index.tolist() == [1, 2, 3, 9, 10, 9]      # row 3's third entry repeats its first token
    assert lay.verify_write_index.tolist() == [0, 1, 2, 3, 4]
    assert lay.verify_write_bt_index.tolist() == [4, 5, 6, 12, 13]     # row * width + column
    assert lay.prefill_rows.tolist() == [2] and lay.prefill_token_index.tolist() == [4, 5, 6, 7, 8]


@pytest.mark.parametrize("qsl, drafts, nd, width, needle", [
    ([0, 1, 4], [0, 3, 0], 1, 4, "query length 3 but 3 drafts"),
    ([0, 1, 5], [0, 3], 1, 3, "need 4 state slots"),
    ([0, 2, 3], [1, 0], 1, 4, "a one-token row cannot verify"),
], ids=["length_not_1_plus_d", "more_positions_than_slots", "drafts_on_a_decode_row"])
def test_bad_verifying_rows_are_refused(qsl, drafts, nd, width, needle):
    with pytest.raises(MetadataError, match=needle) as e:
        compute_verify_layout(np.array(qsl[:len(drafts) + 1]), np.array(drafts), nd, width)
    assert "\n" not in str(e.value)


def test_builder_reads_scratch_slots_from_the_block_table_and_update_block_table_rereads_them():
    spec = MambaSpec(block_size=16, conv_state_shape=(24, 3), ssm_state_shape=(2, 4, 4), dtype=torch.float32,
                     ssm_dtype=torch.float32, chunk_size=4)
    b = Mamba2Backend.get_builder_cls()(spec, ["m"], BuilderConfig(4, 16, 64), "cpu")
    cm = CommonAttentionMetadata.from_lengths([5, 3, 7], [1, 3, 2], [[1, 2, 3], [4, 5, 6], [7, 8, 9]], 64)
    cm = cm.replace(num_draft_tokens_cpu=torch.tensor([0, 2, 0], dtype=torch.int32))
    md = b.build(0, cm)
    assert (md.num_decodes, md.num_verify_rows, md.num_prefills, md.max_verify_len) == (1, 1, 1, 3)
    assert md.verify_write_slots.tolist() == [4, 5, 6] and md.prefill_token_index.tolist() == [4, 5]
    other = torch.tensor([[11, 12, 13], [14, 15, 16], [17, 18, 19]], dtype=torch.int32)
    md2 = b.update_block_table(md, other, cm.slot_mapping)
    assert md2.verify_write_slots.tolist() == [14, 15, 16] and md.verify_write_slots.tolist() == [4, 5, 6]
