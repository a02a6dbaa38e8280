"""attnplug.runner.execute."""
