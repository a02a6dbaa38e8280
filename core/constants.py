"""Named sentinels shared by every layer.

Never reuse a bare ``-1`` or ``0`` for several meanings: use these names.
"""

PAD_SLOT_ID: int = -1
"""Slot id of a padded token in ``slot_mapping``. No kernel writes K/V for it."""

NULL_BLOCK_ID: int = 0
"""Physical block 0 of every block pool is reserved and never handed to a request.

Block-table entries past a request's last block hold this id; sliding-window groups
also put it where blocks that no future query can see were freed. Kernels must never
read keys from it for a real query (its contents are garbage)."""
