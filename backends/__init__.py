"""attnplug.backends."""
