"""``gdn_torch``: Gated DeltaNet state backend (builder, torch reference of the gated delta rule)."""

from attnplug.backends.state.gdn.backend import GDNTorchBackend
from attnplug.backends.state.gdn.impl import GDNTorchImpl
from attnplug.backends.state.gdn.metadata import GDNMetadata, GDNMetadataBuilder, fla_chunk_tables

__all__ = ["GDNMetadata", "GDNMetadataBuilder", "GDNTorchBackend", "GDNTorchImpl", "fla_chunk_tables"]
