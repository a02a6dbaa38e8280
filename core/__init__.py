"""Backend-agnostic metadata, the backend contract, errors and validation."""

from attnplug.core.capabilities import BackendCapabilities, Feature, ScaleGranularity, layer_needs
from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.core.contracts import (
    PLUGIN_API_VERSION,
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayerConfig,
    AttentionMetadataBuilder,
    AttentionType,
    BuilderConfig,
)
from attnplug.core.errors import (
    AttnplugError,
    BackendUnsupportedError,
    ConfigError,
    InvalidSchedulerOutput,
    KVCacheSpecError,
    MetadataError,
    MetadataInvariantError,
    PluginValidationError,
    TraceFormatError,
    UnknownBackendError,
)
from attnplug.core.mamba import MambaBackend, MambaImpl, MambaLayerConfig, MambaStateCache
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.state import StateBackend, StateLayerConfig
from attnplug.core.mla import (
    MLABackend,
    MLAContextChunk,
    MLADecodeMetadata,
    MLAImpl,
    MLALayerConfig,
    MLAMetadata,
    MLAPrefillMetadata,
)
from attnplug.core.validation import BatchView, RowState, validate

__all__ = [
    "NULL_BLOCK_ID", "PAD_SLOT_ID", "PLUGIN_API_VERSION", "AttentionBackend", "AttentionCGSupport",
    "AttentionImpl", "AttentionLayerConfig", "AttentionMetadataBuilder", "AttentionType",
    "BuilderConfig", "AttnplugError", "BackendUnsupportedError", "ConfigError", "InvalidSchedulerOutput",
    "KVCacheSpecError", "MetadataError", "MetadataInvariantError", "PluginValidationError",
    "TraceFormatError", "UnknownBackendError", "CommonAttentionMetadata", "BatchView", "RowState",
    "validate", "MambaBackend", "MambaImpl", "MambaLayerConfig", "MambaStateCache", "StateBackend", "StateLayerConfig",
    "MLABackend", "MLAContextChunk", "MLADecodeMetadata", "MLAImpl", "MLALayerConfig", "MLAMetadata",
    "MLAPrefillMetadata", "BackendCapabilities", "Feature", "ScaleGranularity", "layer_needs",
]
