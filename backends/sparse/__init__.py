"""Sparse-attention backends (DeepSeek-V3.2): selectors (``indexer`` caches) and sparse MLA
consumers (``mla`` caches), one folder each; contracts in ``core/sparse.py``."""
