"""What every sparse backend shares: per-token key ranges, the two builders, the row write,
the consumer's orchestration."""

from attnplug.backends.sparse.common.builders import SelectorMetadataBuilder, SparseMLAMetadataBuilder
from attnplug.backends.sparse.common.ranges import positions_to_slots, token_ranges, write_rows

__all__ = ["SelectorMetadataBuilder", "SparseMLAMetadataBuilder", "positions_to_slots", "token_ranges", "write_rows"]
