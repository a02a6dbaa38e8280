"""``flashmla_sparse``: the sparse MLA consumer lowered to FlashMLA's ``flash_mla_sparse_fwd``."""
