"""What every MLA backend shares: the latent cache write, the builder, the two-phase impl."""

from attnplug.backends.mla.common.builder import MLACommonMetadataBuilder, plan_context_chunks
from attnplug.backends.mla.common.cache import concat_and_cache_mla, gather_latent
from attnplug.backends.mla.common.impl import MLACommonImpl

__all__ = ["MLACommonImpl", "MLACommonMetadataBuilder", "concat_and_cache_mla", "gather_latent", "plan_context_chunks"]
