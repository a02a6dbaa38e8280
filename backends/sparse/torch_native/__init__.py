"""``torch_native_indexer`` and ``torch_native_sparse_mla``: the golden-reference selector and
consumer in plain torch."""
