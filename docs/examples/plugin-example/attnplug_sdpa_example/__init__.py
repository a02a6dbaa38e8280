"""attnplug-sdpa-example: an attnplug plugin whose backend runs torch SDPA over paged K/V."""

from attnplug_sdpa_example.backend import SdpaExampleBackend

__all__ = ["SdpaExampleBackend"]
