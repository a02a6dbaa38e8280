"""``triton_mla``: MLA in Triton: a paged split-KV decode kernel over the latent cache and
the varlen paged attention kernel of ``backends/triton`` for the prefill MHA."""
