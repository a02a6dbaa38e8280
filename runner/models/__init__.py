"""attnplug.runner.models."""
