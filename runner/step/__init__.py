"""attnplug.runner.step."""
