"""State backends (recurrent-state cache groups), one folder each: ``gdn`` (Gated DeltaNet).

The Mamba2 backend predates this folder and lives in ``backends/mamba2``.
"""
