"""``torch_native_mla``: the golden-reference MLA backend in plain torch."""
