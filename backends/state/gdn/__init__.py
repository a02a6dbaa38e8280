"""``gdn_torch`` and ``gdn_triton``: Gated DeltaNet state backends (builder, torch reference of the
gated delta rule, the rule's fused recurrence in Triton)."""

from attnplug.backends.state.gdn.backend import GDNTorchBackend, GDNTritonBackend
from attnplug.backends.state.gdn.impl import GDNTorchImpl, GDNTritonImpl
from attnplug.backends.state.gdn.metadata import GDNMetadata, GDNMetadataBuilder, fla_chunk_tables

__all__ = ["GDNMetadata", "GDNMetadataBuilder", "GDNTorchBackend", "GDNTorchImpl", "GDNTritonBackend", "GDNTritonImpl",
           "fla_chunk_tables"]
