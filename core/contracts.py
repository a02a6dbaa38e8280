"""The backend contract: ``AttentionBackend``, ``AttentionMetadataBuilder``, ``AttentionImpl``.

A backend is a class (never instantiated) that names its builder and impl classes and
declares its capabilities. Per step, for each KV-cache group, the runner calls the
group's builder once (``build``) to lower the :class:`CommonAttentionMetadata` into the
backend's own metadata; every layer of the group then calls ``AttentionImpl.forward``
with that object. Shapes mirror vLLM V1 (``vllm/v1/attention/backend.py``).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attnplug.core.capabilities import FeatureDeclarations, layer_needs
from attnplug.core.devices import resolve_device
from attnplug.core.kv_layout import KVCacheLayout
from attnplug.core.metadata import CommonAttentionMetadata

PLUGIN_API_VERSION: tuple[int, int] = (1, 0)
"""Version of this contract, ``(major, minor)``. A backend declares the version it was
written against (``AttentionBackend.plugin_api_version``); a different major, or a newer
minor than ours, is rejected at registration."""


class AttentionType(str, enum.Enum):
    """Which tokens attend to which (vLLM's ``AttentionType``)."""

    DECODER = "decoder"
    """Causal self-attention over the paged KV cache (the only kind the runner drives)."""
    ENCODER = "encoder"
    ENCODER_ONLY = "encoder_only"
    ENCODER_DECODER = "encoder_decoder"


class AttentionCGSupport(enum.IntEnum):
    """How much of a step a builder's metadata lets a CUDA graph capture (higher = more).

    The runner negotiates the graph mode from the minimum over all builders.
    """

    NEVER = 0
    """No CUDA graphs over attention (run attention eagerly / piecewise)."""
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    """Full graphs only for batches where every request has exactly one query token."""
    UNIFORM_BATCH = 2
    """Full graphs for batches where every request has the same query length."""
    ALWAYS = 3
    """Full graphs for any batch (mixed prefill and decode)."""


@dataclass(frozen=True)
class AttentionLayerConfig:
    """What a builder or a capability check knows about the layers it serves.

    ``head_size`` not ``head_dim`` (vLLM's term). ``sliding_window`` is W tokens, the
    current token included (HF ``config.sliding_window``): key k is visible to query p iff
    ``p - W < k <= p``. ``None`` means full attention.

    The needs below are what selection refuses a backend for when it does not declare
    the matching :class:`~attnplug.core.capabilities.Feature` (``layer_needs``):
    ``has_sinks`` (per-head sink logits, ``AttentionImpl(sinks=)``), ``use_alibi`` /
    ``use_alibi_sqrt`` (ALiBi biases, sqrt-ALiBi), ``causal=False`` (bidirectional
    attention in the paged decoder path) and ``batch_invariant``.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: torch.dtype | None = None
    block_size: int = 16
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    attn_type: AttentionType = AttentionType.DECODER
    device: str = "cpu"
    has_sinks: bool = False
    use_alibi: bool = False
    use_alibi_sqrt: bool = False
    causal: bool = True
    batch_invariant: bool = False

    @property
    def effective_kv_cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype


@dataclass(frozen=True)
class BuilderConfig:
    """Limits a metadata builder may size its persistent buffers by."""

    max_num_reqs: int
    max_num_batched_tokens: int
    max_model_len: int
    dtype: torch.dtype | None = None
    """The queries' (model's) dtype; ``None``: the spec's (differs for an fp8 cache)."""


class AttentionMetadataBuilder(ABC):
    """Lowers a step's :class:`CommonAttentionMetadata` into one backend's metadata.

    One instance per KV-cache group, created once at runner start:
    ``Builder(kv_cache_spec, layer_names, config, device)``.

    Class attributes:
        cudagraph_support: the :class:`AttentionCGSupport` level of the metadata it builds.
        reorder_batch_threshold: if set, the runner puts requests whose query length is
            ``<= threshold`` (decodes) before the others before preparing inputs.
        supports_update_block_table: ``update_block_table`` is implemented (groups with the
            same spec and builder class then reuse one build per step).
        supports_cascade: ``build`` with ``common_prefix_len > 0`` runs cascade attention
            (a shared-prefix pass, a suffix pass, merged by log-sum-exp); the runner passes a
            non-zero ``common_prefix_len`` only then (``runner/execute/cascade.py``).
        cascade_unsupported_reason: why not, when ``supports_cascade`` is False.
    """

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: ClassVar[int | None] = None
    supports_update_block_table: ClassVar[bool] = False
    supports_cascade: ClassVar[bool] = False
    cascade_unsupported_reason: ClassVar[str] = "the builder does not declare supports_cascade"

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], config: BuilderConfig,
                 device: torch.device | str):
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = list(layer_names)
        self.config = config
        self.device = resolve_device(device)

    @classmethod
    def get_cudagraph_support(cls, kv_cache_spec: Any = None) -> AttentionCGSupport:
        """The CUDA-graph support level for ``kv_cache_spec`` (default: the class attribute)."""
        return cls.cudagraph_support

    @abstractmethod
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> Any:
        """Build this backend's metadata for one step. Must not mutate ``common_attn_metadata``.

        Args:
            common_prefix_len: tokens shared by every request's prefix (cascade attention);
                0 when unknown or unused.
            common_attn_metadata: the step's metadata, with this group's block table and
                slot mapping.
            fast_build: prefer a cheap build over a fast kernel (speculative drafts).

        Returns:
            The backend's metadata object, passed unchanged to every layer's ``forward``.

        May synchronise with the host (it runs once per step, outside CUDA graphs unless
        ``cudagraph_support`` says otherwise).
        """

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> Any:
        """Build metadata for a dummy batch being captured in a CUDA graph (default: ``build``)."""
        return self.build(0, common_attn_metadata)

    def update_block_table(self, metadata: Any, block_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> Any:
        """Return a copy of ``metadata`` (built for another group with the same spec) that
        uses ``block_table`` (``[num_reqs, max_num_blocks_per_req]``, int32) and
        ``slot_mapping`` (``[num_tokens]``, int64). Must not mutate ``metadata``.

        Raises:
            NotImplementedError: when ``supports_update_block_table`` is False.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support update_block_table")


class AttentionImpl(ABC):
    """Runs attention for one layer with the metadata its builder made.

    ``Impl(num_heads, head_size, scale, num_kv_heads, sliding_window=None,
    logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_cache_dtype=None,
    sinks=None)``.

    ``sinks`` (vLLM's impl argument of that name, gpt-oss's ``self_attn.sinks``): ``None``
    or a ``[num_heads]`` float32 tensor of per-head *sink logits*. With a sink ``s_h``, query
    head ``h`` attends with ``p_k = exp(l_k) / (exp(s_h) + sum_j exp(l_j))``: the sink is
    one more logit in the softmax denominator, compared with the logits *after* scaling
    and soft-capping, and contributes no value (the probabilities sum to less than 1).
    It applies on full and sliding-window layers alike. Only models pass it; they pass it
    only to a backend whose ``supports_sink()`` is True (selection refuses the others), and
    an impl given sinks it cannot apply must raise, never drop them. ``alibi_slopes``
    (keyword, vLLM's; only to a backend whose ``supports_alibi()`` is True): ``[num_heads]``
    float32; head ``h``'s logit of a key ``d`` positions back gets ``- slopes[h] * d``.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 attn_type: AttentionType = AttentionType.DECODER,
                 kv_cache_dtype: torch.dtype | None = None, sinks: torch.Tensor | None = None):
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type
        self.kv_cache_dtype = kv_cache_dtype
        self.sinks = sinks

    @staticmethod
    def sinks_argument_problems(sinks: Any, num_heads: int) -> list[str]:
        """Reasons ``sinks`` is not a valid sink argument (empty: fine, or ``None``).

        Valid: a ``torch.Tensor`` of shape ``[num_heads]``, dtype float32. (Finiteness is not
        checked here: it would synchronise a GPU tensor with the host.)
        """
        if sinks is None:
            return []
        if not isinstance(sinks, torch.Tensor):
            return [f"sinks must be a [num_heads] float32 tensor or None, got {type(sinks).__name__}"]
        if sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_heads,):
            return [f"sinks must be [{num_heads}] float32 (one sink logit per query head), got "
                    f"{list(sinks.shape)} {sinks.dtype}"]
        return []

    @staticmethod
    def decoder_argument_problems(num_heads: int, num_kv_heads: int, sliding_window: int | None,
                                  logits_soft_cap: float | None, attn_type: AttentionType) -> list[str]:
        """Reasons a decoder-only impl rejects its constructor arguments (empty: fine).

        Checks the GQA ratio (``num_heads`` a positive multiple of ``num_kv_heads``), a
        positive window (tokens) and soft-cap, and ``AttentionType.DECODER``. Impls extend the
        list with their own limits and raise ``BackendUnsupportedError`` if it is non-empty.
        """
        reasons = []
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            reasons.append(f"num_heads {num_heads} is not a positive multiple of num_kv_heads {num_kv_heads}")
        if sliding_window is not None and sliding_window <= 0:
            reasons.append(f"sliding_window must be a positive number of tokens, got {sliding_window!r}")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            reasons.append(f"logits_soft_cap must be > 0, got {logits_soft_cap!r}")
        if attn_type != AttentionType.DECODER:
            reasons.append(f"attention type {AttentionType(attn_type).value!r} not supported (decoder only)")
        return reasons

    @abstractmethod
    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor) -> torch.Tensor:
        """Write this step's K/V into ``kv_cache`` at the slot mapping, then attend.

        Args:
            layer: the calling layer module (may carry per-layer scales); may be ``None``.
            query: ``[num_tokens, num_heads, head_size]``.
            key, value: ``[num_tokens, num_kv_heads, head_size]``.
            kv_cache: the backend's layout (``get_kv_cache_shape``).
            attn_metadata: what this group's builder returned this step.
            output: ``[num_tokens, num_heads, head_size]``, written in place for the first
                ``num_actual_tokens`` rows.

        Returns:
            ``output``.

        Must not synchronise with the host (no ``.item()``/``.tolist()``): runs per layer.
        """


class AttentionBackend(FeatureDeclarations, ABC):
    """A named attention backend and its capabilities. Never instantiated.

    Subclasses set the class attributes below and implement the ``get_*`` methods; the
    ``supports_*`` feature claims and ``features()`` come from
    :class:`~attnplug.core.capabilities.FeatureDeclarations`. The default
    :meth:`validate_configuration` checks a layer against the declared capabilities;
    override it to add checks, and call ``super()``.
    """

    plugin_api_version: ClassVar[tuple[int, int]] = PLUGIN_API_VERSION
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None
    """Head sizes the kernels accept; ``None`` means any."""
    supported_kernel_block_sizes: ClassVar[tuple[int, ...] | None] = None
    """Kernel block sizes; ``None`` means any. A manager block size that is a multiple of one
    of these is served by splitting manager blocks into kernel blocks."""
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    supported_attn_types: ClassVar[tuple[AttentionType, ...]] = (AttentionType.DECODER,)
    kv_cache_kind: ClassVar[str] = "attention"
    """``"attention"`` (paged K/V) or ``"mamba"`` (state slots)."""
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    """``--kv-cache-dtype`` names the impl writes and reads (vLLM's ``supported_kv_cache_dtypes``):
    ``"auto"`` (the model's dtype), ``"fp8_e4m3"``, ``"fp8_e5m2"`` (``core/kv_quant.py``). A
    backend that lists an fp8 name reads ``layer.k_scale`` / ``layer.v_scale`` in ``forward``."""
    supports_per_head_kv_scales: ClassVar[bool] = False
    """``k_scale`` / ``v_scale`` may be ``[num_kv_heads]`` (else per tensor, shape ``[]``, only)."""
    supports_quant_query_input: ClassVar[bool] = False
    """With an fp8 cache the impl reads fp8 queries, ``saturate(q / layer.q_scale)`` (FA3;
    vLLM's name; ``core/kv_quant.quantize_query``). Others never read ``q_scale``."""
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout()
    """The cache's dimension order and where fp8 scales live (``core/kv_layout.py``); the
    default ``get_kv_cache_shape`` and ``split_kv_cache`` follow it."""

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The registered name users select (``"torch_native"``, ``"triton"``...)."""

    @classmethod
    @abstractmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        """The metadata builder class."""

    @classmethod
    @abstractmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        """The attention impl class."""

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache: ``kv_cache_layout.shape(...)``; with the default
        layout ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (K at index 0, V at
        index 1; NHD inside a block)."""
        return cls.kv_cache_layout.shape(num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def split_kv_cache(cls, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the K and V halves of one layer's cache, whatever the backend's layout.

        Args:
            kv_cache: a tensor shaped as :meth:`get_kv_cache_shape` says.

        Returns:
            ``(key_cache, value_cache)``, each ``[num_blocks, block_size, num_kv_heads,
            head_size]`` (kernel blocks, NHD), views sharing ``kv_cache``'s storage
            (writing through them writes the cache). The conformance suite and debugging
            tools read and poison caches through this. The default follows
            ``kv_cache_layout``; a backend whose cache is not a permutation of its
            dimensions (another packing) must override it.
        """
        return cls.kv_cache_layout.split(kv_cache)

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Whether the backend can run on this machine, and if not why (missing package,
        no CUDA...). Cheap; never raises."""
        return True, ""

    @classmethod
    def get_supported_kernel_block_size(cls, block_size: int) -> int | None:
        """The kernel block size for a manager ``block_size``: the largest declared size that
        divides it, ``block_size`` itself when any size is allowed, ``None`` if none fits."""
        sizes = cls.supported_kernel_block_sizes
        if sizes is None or block_size in sizes:
            return block_size
        fits = [s for s in sizes if block_size % s == 0]
        return max(fits) if fits else None

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig) -> list[str]:
        """Every reason this backend cannot serve ``layer`` (empty list: it can).

        Reasons are human-readable sentences that name the value and what is supported. The
        base checks the declarations, and that a CUDA layer has a CUDA build of torch.
        """
        reasons: list[str] = []
        ok, why = cls.is_available()
        if not ok:
            reasons.append(f"not available on this machine: {why}")
        if cls.kv_cache_kind != "attention":
            reasons.append(f"serves {cls.kv_cache_kind} state, not attention layers")
            return reasons
        if layer.dtype not in cls.supported_dtypes:
            reasons.append(f"dtype {layer.dtype} not supported (supported: "
                           f"{', '.join(str(d) for d in cls.supported_dtypes)})")
        if cls.supported_head_sizes is not None and layer.head_size not in cls.supported_head_sizes:
            reasons.append(f"head_size {layer.head_size} not supported (supported: "
                           f"{list(cls.supported_head_sizes)})")
        if cls.get_supported_kernel_block_size(layer.block_size) is None:
            reasons.append(f"block_size {layer.block_size} is not a multiple of any supported kernel "
                           f"block size {list(cls.supported_kernel_block_sizes or ())}")
        declared = cls.features()
        reasons += [f"{need} not supported" for feat, need in layer_needs(layer).items()
                    if not declared.get(feat.value, False)]
        if layer.num_heads % layer.num_kv_heads != 0:
            reasons.append(f"num_heads {layer.num_heads} is not a multiple of num_kv_heads "
                           f"{layer.num_kv_heads}")
        elif layer.num_heads != layer.num_kv_heads and not cls.supports_mqa_gqa():
            reasons.append(f"GQA/MQA (num_heads {layer.num_heads} / num_kv_heads "
                           f"{layer.num_kv_heads}) not supported")
        dev = torch.device(layer.device).type
        if dev not in cls.supported_devices:
            reasons.append(f"device {dev!r} not supported (supported: {list(cls.supported_devices)})")
        elif dev == "cuda" and ok and not torch.cuda.is_available():  # unavailable: its reason says why
            reasons.append("device 'cuda' requested but torch.cuda.is_available() is False")
        if layer.attn_type not in cls.supported_attn_types:
            reasons.append(f"attention type {layer.attn_type.value!r} not supported")
        from attnplug.core.kv_quant import kv_cache_dtype_problems

        reasons.extend(kv_cache_dtype_problems(cls, layer.effective_kv_cache_dtype))
        return reasons
