"""``triton_indexer`` and ``triton_sparse_mla``: the selector's scoring and the sparse MLA
consumer as Triton kernels (GPU, or the interpreter on the CPU)."""
