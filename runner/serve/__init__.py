"""attnplug.runner.serve."""
