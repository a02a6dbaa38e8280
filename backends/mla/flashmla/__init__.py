"""``flashmla``: MLA decode through DeepSeek's FlashMLA kernel (``flash_mla``, block size 64)."""
