"""attnplug.runner."""
