"""``flashinfer_mla``: MLA decode through FlashInfer's ``BatchMLAPagedAttentionWrapper``."""
