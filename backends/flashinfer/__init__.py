"""``flashinfer``: paged attention with FlashInfer's decode/prefill wrappers (optional extra).

Importing this package never imports ``flashinfer``: :class:`FlashInferBackend`
registers everywhere and says through ``is_available()`` why it cannot run (missing
package, no CUDA). On machines without a GPU its lowering is checked against a CPU
emulator of the wrappers' contract (``attnplug.backends.emulators``).

Modules: ``backend.py`` (capabilities), ``kernels.py`` (finding flashinfer, the live
layer parameters), ``metadata.py``, ``pages.py`` (page metadata) and ``builder.py`` (planning),
``impl.py`` (``run()`` on the two slices).
"""

from attnplug.backends.flashinfer.backend import FlashInferBackend
from attnplug.backends.flashinfer.builder import FlashInferMetadataBuilder
from attnplug.backends.flashinfer.impl import FlashInferImpl
from attnplug.backends.flashinfer.metadata import FlashInferMetadata, FlashInferPlan, FlashInferPlanKey
from attnplug.backends.flashinfer.pages import PageMetadataBuffers, gather_page_indices, page_metadata

__all__ = [
    "FlashInferBackend", "FlashInferImpl", "FlashInferMetadata", "FlashInferMetadataBuilder", "FlashInferPlan",
    "FlashInferPlanKey", "PageMetadataBuffers", "gather_page_indices", "page_metadata",
]
