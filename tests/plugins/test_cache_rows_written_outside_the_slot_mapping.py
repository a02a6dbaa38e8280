"""The MLA and sparse checks name the cache rows a step wrote outside its slot mapping by their
row index in the cache (not by their index among the untouched rows), NaN poison kept as NaN
counting as unchanged."""

import torch

from attnplug.plugins.conformance.snapshots import rows_written_outside


def test_rows_outside_the_slots_are_named_by_their_cache_index():
    before = torch.zeros(8, 3)
    before[5] = float("nan")  # poison that stays poison is unchanged
    after = before.clone()
    slots = torch.tensor([0, 2, 3])
    after[slots] = 1.0  # allowed writes
    after[6, 1] = 7.0   # a stray write
    after[4] = 2.0      # another
    assert rows_written_outside(before, after, slots) == [4, 6]


def test_nan_overwritten_or_written_into_is_a_change():
    before = torch.zeros(4, 2)
    before[1] = float("nan")
    after = before.clone()
    after[1] = 0.0          # poison overwritten
    after[3, 0] = float("nan")  # a NaN written
    assert rows_written_outside(before, after, torch.tensor([0])) == [1, 3]
