"""Re-export: ``SpecDecodeMetadata`` lives in ``runner/step/spec_metadata.py`` (the step
compiler's ``prepare_inputs`` builds it; ``runner/step`` may not import ``runner/execute``)."""

from attnplug.runner.step.spec_metadata import SpecDecodeMetadata, build_spec_decode_metadata

__all__ = ["SpecDecodeMetadata", "build_spec_decode_metadata"]
