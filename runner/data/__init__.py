"""attnplug.runner.data."""
