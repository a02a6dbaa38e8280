"""``StepTensorChecks``: the memo of the tensors last checked skips only the tensor
attribute reads; every host int is still compared, and any other tensor object is
checked in full (so a bad step is refused whether or not the memo is warm)."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.common.buffer_checks import StepTensorChecks
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata


def _checks():
    return StepTensorChecks(device=torch.device("cpu"), block_size=4, max_num_blocks_per_req=4, max_model_len=16,
                            slot_capacity=8, backend="test")


def _cm():
    return CommonAttentionMetadata.from_lengths([3, 5], [1, 1], [[1, 2, 0, 0], [3, 4, 0, 0]], block_size=4)


def test_a_warm_memo_still_compares_every_host_int():
    checks, cm = _checks(), _cm()
    checks.check(cm, 2)
    checks.check(cm, 2)  # warm: the same tensor objects
    with pytest.raises(MetadataError, match="slot_mapping has 2 entries"):
        checks.check(cm.replace(num_actual_tokens=3), 2)
    with pytest.raises(MetadataError, match="max_seq_len=17 needs 5 blocks"):
        checks.check(cm.replace(max_seq_len=17), 2)
    with pytest.raises(MetadataError, match="for 3 rows"):
        checks.check(cm, 3)


def test_another_tensor_object_is_checked_in_full():
    checks, cm = _checks(), _cm()
    checks.check(cm, 2)
    with pytest.raises(MetadataError, match="slot_mapping is torch.int32"):
        checks.check(cm.replace(slot_mapping=cm.slot_mapping.to(torch.int32)), 2)
    with pytest.raises(MetadataError, match="block_table_tensor is torch.int64"):
        checks.check(cm.replace(block_table_tensor=cm.block_table_tensor.long()), 2)
    checks.check(cm, 2)  # the good step passes again


def test_update_block_table_checks_share_the_memo_and_still_refuse():
    checks, cm = _checks(), _cm()
    bt, sm = cm.block_table_tensor, cm.slot_mapping
    checks.check_tables(bt, sm, 2, 2, 8)
    checks.check_tables(bt, sm, 2, 2, 8)  # warm
    with pytest.raises(MetadataError, match="slot_mapping has 2 entries"):
        checks.check_tables(bt, sm, 2, 3, 8)
    with pytest.raises(MetadataError, match="needs 5 blocks"):
        checks.check_tables(bt, sm, 2, 2, 17)
    with pytest.raises(MetadataError, match="block_table_tensor is torch.int32 \\(1, 4\\)"):
        checks.check_tables(bt[:1], sm, 2, 2, 8)
