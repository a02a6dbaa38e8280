"""attnplug.backends.torch_native."""
