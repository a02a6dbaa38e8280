"""MLA backends (multi-head latent attention), one sub-package each; ``common/`` holds what
they share: the builder that splits decodes from prefills and plans the chunked context,
the impl that writes the latent cache and runs both phases (docs/mla.md)."""
