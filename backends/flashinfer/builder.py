"""``FlashInferMetadataBuilder``: page metadata from the block table, then ``plan()``.

Per step: the decode/prefill split (decodes first, ``reorder_batch_threshold = 1``);
int32 ``paged_kv_indptr`` / ``paged_kv_indices`` / ``paged_kv_last_page_len`` computed
once, vectorised, into persistent buffers (``pages.py``: host arithmetic on the ``_cpu``
copies, one device gather reading only the pages' block-table entries); ``qo_indptr``
of the prefill slice; then one
decode and one prefill ``plan()`` per distinct layer configuration (query heads,
``window_left = W - 1``, soft-cap, scale) of the group's live impls. CUDA-graph builds
(``build_for_cudagraph_capture``: pure single-token decodes only) use graph decode wrappers,
one per padded batch size, all on the builder's fixed buffers, and copy the slot mapping
into a persistent buffer. Eager builds are re-entrant: each plans wrappers no live metadata
holds (a pool per configuration, normally one wrapper each) and keeps its own copies of the
page metadata, so N builds before their N forwards run as built (``_free_wrapper``).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from attnplug.backends.common.buffer_checks import builder_values_checked, check_slot_mapping
from attnplug.backends.common.window import flashinfer_window_left
from attnplug.backends.flashinfer.kernels import LIVE_LAYER_PARAMS, installed_module, unavailable_reason
from attnplug.backends.flashinfer.metadata import FlashInferMetadata, FlashInferPlan, FlashInferPlanKey
from attnplug.backends.flashinfer.pages import PageMetadataBuffers
from attnplug.cache_groups.specs import cdiv
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import AttentionCGSupport, AttentionMetadataBuilder, BuilderConfig
from attnplug.core.devices import same_device
from attnplug.core.errors import BackendUnsupportedError, MetadataError
from attnplug.core.kv_quant import is_quantized
from attnplug.core.metadata import CommonAttentionMetadata

def _CLAIMED():  # the owner of a wrapper claimed by the build in progress (a live "weakref")
    return True


WORKSPACE_BYTES = 128 << 20
"""FlashInfer's float workspace (shared by every wrapper of a builder)."""


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`FlashInferMetadata` and plans the wrappers (module docstring).

    ``FlashInferMetadataBuilder(kv_cache_spec, layer_names, config, device)``: the page
    size is ``kv_cache_spec.block_size``; a ``sliding_window`` on the spec sets
    ``window_left``. The group's impls must exist before the first ``build`` (their
    parameters are what is planned).

    Raises:
        MetadataError: non-positive limits.
    """

    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold = 1
    supports_update_block_table = False
    cascade_unsupported_reason = (
        "flashinfer: cascade needs MultiLevelCascadeAttentionWrapper, planned per level with its own "
        "page indices; this builder plans BatchPrefill/BatchDecode wrappers only (not wired)")
    workspace_bytes = WORKSPACE_BYTES

    @classmethod
    def load_flashinfer(cls) -> Any:
        """The ``flashinfer`` module (the emulators override this with a stand-in).

        Raises:
            BackendUnsupportedError: flashinfer is not installed.
        """
        module = installed_module()
        if module is None:
            raise BackendUnsupportedError("flashinfer", [unavailable_reason() or "flashinfer unavailable"],
                                          context="FlashInferMetadataBuilder")
        return module

    def __init__(self, kv_cache_spec, layer_names: list[str], config: BuilderConfig,
                 device: torch.device | str):
        super().__init__(kv_cache_spec, layer_names, config, device)
        if min(config.max_num_reqs, config.max_num_batched_tokens, config.max_model_len) <= 0:
            raise MetadataError(f"FlashInferMetadataBuilder: BuilderConfig limits must be positive, got {config}")
        self.page_size = int(kv_cache_spec.block_size)
        self.sliding_window = getattr(kv_cache_spec, "sliding_window", None)
        self.window_left = flashinfer_window_left(self.sliding_window)
        self.dtype = kv_cache_spec.dtype
        """``kv_data_type`` of every plan: the cache's dtype (fp8 for a quantized cache)."""
        self.q_dtype = config.dtype or kv_cache_spec.dtype
        """``q_data_type``: the activation dtype (``BuilderConfig.dtype``; the spec's dtype when
        not given, which an fp8 cache refuses below)."""
        if is_quantized(self.dtype) and not (config.dtype is not None and not is_quantized(config.dtype)):
            raise MetadataError(f"FlashInferMetadataBuilder: the KV cache is {self.dtype} but BuilderConfig.dtype "
                                f"is {config.dtype}: plan() needs the queries' (activation) dtype as q_data_type")
        self.max_num_blocks_per_req = cdiv(config.max_model_len, self.page_size)
        n, dev = config.max_num_reqs, self.device
        self._indptr_buf = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self._indices_buf = torch.zeros(n * self.max_num_blocks_per_req, dtype=torch.int32, device=dev)
        self._last_page_len_buf = torch.ones(n, dtype=torch.int32, device=dev)
        self._slot_mapping_buf = torch.full((config.max_num_batched_tokens,), PAD_SLOT_ID, dtype=torch.int64,
                                            device=dev)
        self._pages = PageMetadataBuffers(n, self.max_num_blocks_per_req, self.page_size, dev)
        self._workspace: torch.Tensor | None = None
        self.validate_values = builder_values_checked()
        """Check the host values of every step (``ATTNPLUG_VALIDATE=1`` when created)."""
        self._wrappers: dict[tuple, list[Any]] = {}
        """Eager wrappers per ``(kind, plan key)``: a pool (``_free_wrapper``)."""
        self._owners: dict[int, Any] = {}
        """``id(wrapper) -> weakref`` of the ``FlashInferPlan`` holding it (dead: free)."""
        self._claimed: list[Any] = []
        self._graph_wrappers: dict[tuple, Any] = {}

    # --- build ---------------------------------------------------------------------------
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlashInferMetadata:
        """Compute the page metadata and plan the wrappers (never mutates the input).

        Args:
            common_prefix_len: ignored (no cascade).
            common_attn_metadata: the step's metadata for this group, decodes first; may be
                padded (padded requests own no pages).
            fast_build: ignored.

        Returns:
            The metadata every layer of the group passes to ``forward``. Its wrappers are
            its own while it is alive (a later ``build`` plans others): re-entrant.

        Raises:
            MetadataError: sizes that disagree, or prefills before decodes (the runner did
                not honour ``reorder_batch_threshold``).

        Runs ``plan()`` outside CUDA graphs. ``plan()`` (flashinfer 0.6.x) reads the host
        copies of the metadata and queues a non-blocking copy of its schedule from a pinned
        buffer of the wrapper: planning the same wrapper again before that copy ran would
        overwrite it, so successive builds need a fence between them (``ModelRunner`` waits on
        its ``HostBufferFence`` before every step's build).
        """
        return self._build(common_attn_metadata, graph=False)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> FlashInferMetadata:
        """Metadata for a CUDA-graph step (capture, and every replay of the same padded shape).

        Plans the graph decode wrapper of this padded batch size (its indptr / indices /
        last-page-length live in the builder's fixed buffers) and copies the slot mapping
        into the builder's persistent buffer, so the captured metadata reads each replay's
        values.

        Raises:
            MetadataError: as :meth:`build`, and for a step that is not a pure single-token
                decode (this backend declares ``UNIFORM_SINGLE_TOKEN_DECODE``).
        """
        return self._build(common_attn_metadata, graph=True)

    def _build(self, cm: CommonAttentionMetadata, graph: bool) -> FlashInferMetadata:
        n, qsl, seq_lens, num_decodes = self._check(cm)
        B_padded = cm.query_start_loc.shape[0] - 1
        pure_decode = num_decodes == n and n > 0 and B_padded <= cm.slot_mapping.shape[0]
        if graph and not pure_decode:
            raise MetadataError(
                f"build_for_cudagraph_capture got {n - num_decodes} prefill request(s) among {n}: flashinfer's "
                "CUDA graphs hold pure single-token decode batches only (UNIFORM_SINGLE_TOKEN_DECODE); build "
                "mixed steps eagerly with build().")
        B = B_padded if pure_decode else n
        indptr_t, last_t, indices, _ = self._pages.compute(seq_lens, B, cm.block_table_tensor)
        qo_indptr = self._pages.prefill_qo_indptr(qsl, num_decodes)
        if not graph:  # re-entrancy: this metadata keeps its own copies (the buffers are the next build's)
            indptr_t, last_t, indices, qo_indptr = (t.clone() for t in (indptr_t, last_t, indices, qo_indptr))
        num_decode_tokens = B if pure_decode else num_decodes
        plans = {}
        self._claimed = []
        try:
            for key in self.plan_keys():
                decode = prefill = None
                if num_decode_tokens:
                    decode = self._plan_decode(key, indptr_t[: num_decode_tokens + 1], indices,
                                               last_t[:num_decode_tokens], graph=graph)
                if num_decodes < n:
                    lo = int(indptr_t[num_decodes])
                    prefill = self._plan_prefill(key, qo_indptr, indptr_t[num_decodes: n + 1] - lo,
                                                 indices[lo: int(indptr_t[n])], last_t[num_decodes:n])
                plans[key] = FlashInferPlan(decode, prefill)
        except BaseException:
            for w in self._claimed:  # a failed build holds no wrapper
                self._owners.pop(id(w), None)
            raise
        slot_mapping = cm.slot_mapping
        if graph:
            slot_mapping = self._slot_mapping_buf[: slot_mapping.shape[0]]
            slot_mapping.copy_(cm.slot_mapping, non_blocking=True)
        md = FlashInferMetadata(
            num_reqs=n, num_actual_tokens=cm.num_actual_tokens, num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens, num_prefills=n - num_decodes,
            num_prefill_tokens=cm.num_actual_tokens - num_decodes, page_size=self.page_size,
            slot_mapping=slot_mapping, paged_kv_indptr=indptr_t, paged_kv_indices=indices,
            paged_kv_last_page_len=last_t, qo_indptr=qo_indptr, plans=plans)
        claimed = {id(w) for w in self._claimed}
        for plan in plans.values():  # held while the plan is alive: this metadata and any copy of it
            for w in (plan.decode, plan.prefill):
                if w is not None and id(w) in claimed:
                    self._owners[id(w)] = weakref.ref(plan)
        return md

    def plan_keys(self) -> list[FlashInferPlanKey]:
        """One key per distinct configuration of the live impls matching this group's spec."""
        keys = {FlashInferPlanKey(p.num_heads, flashinfer_window_left(p.sliding_window),
                                  float(p.logits_soft_cap or 0.0), float(p.scale))
                for p in LIVE_LAYER_PARAMS.for_spec(self.kv_cache_spec)}
        return sorted(keys, key=lambda k: (k.num_qo_heads, k.logits_soft_cap, k.sm_scale))

    # --- wrappers ------------------------------------------------------------------------
    def _workspace_buffer(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        return self._workspace

    def _free_wrapper(self, wkey: tuple, make) -> Any:
        """An eager wrapper of ``wkey`` no live metadata holds (a new one from ``make()`` when
        all are held), claimed by the build in progress.

        Re-entrancy (``docs/writing-a-backend.md``): FlashInfer keeps a plan in its wrapper,
        so metadata whose wrapper a later build re-planned would run the later step. Each
        eager build therefore plans wrappers that no live metadata holds; a wrapper returns
        to the pool when the ``FlashInferPlan`` it serves is dropped (a weak reference: the
        metadata and any ``dataclasses.replace`` copy of it share the plan). Build then
        forward, step after step, reuses one wrapper per key; N builds before their
        forwards hold N."""
        pool = self._wrappers.setdefault(wkey, [])
        for wrapper in pool:
            ref = self._owners.get(id(wrapper))
            if ref is None or ref() is None:
                break
        else:
            wrapper = make()
            pool.append(wrapper)
        self._owners[id(wrapper)] = _CLAIMED
        self._claimed.append(wrapper)
        return wrapper

    def _plan_decode(self, key: FlashInferPlanKey, indptr, indices, last_page_len, graph: bool):
        fi = self.load_flashinfer()
        B = last_page_len.shape[0]
        tensor_cores = key.num_qo_heads // int(self.kv_cache_spec.num_kv_heads) > 4
        if graph:  # one per padded batch size, on the fixed buffers (replays read those)
            wkey = ("decode", key, B)
            wrapper = self._graph_wrappers.get(wkey)
            if wrapper is None:
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace_buffer(), "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                    paged_kv_indptr_buffer=self._indptr_buf[: B + 1], paged_kv_indices_buffer=self._indices_buf,
                    paged_kv_last_page_len_buffer=self._last_page_len_buf[:B])
                self._graph_wrappers[wkey] = wrapper
        else:
            wrapper = self._free_wrapper(("decode", key), lambda: fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace_buffer(), "NHD", use_tensor_cores=tensor_cores))
        wrapper.plan(indptr, indices, last_page_len, key.num_qo_heads, int(self.kv_cache_spec.num_kv_heads),
                     int(self.kv_cache_spec.head_size), self.page_size, window_left=key.window_left,
                     logits_soft_cap=key.logits_soft_cap or None, q_data_type=self.q_dtype, kv_data_type=self.dtype,
                     sm_scale=key.sm_scale)
        return wrapper

    def _plan_prefill(self, key: FlashInferPlanKey, qo_indptr, indptr, indices, last_page_len):
        fi = self.load_flashinfer()
        wrapper = self._free_wrapper(("prefill", key),
                                     lambda: fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace_buffer(), "NHD"))
        wrapper.plan(qo_indptr, indptr, indices, last_page_len, key.num_qo_heads,
                     int(self.kv_cache_spec.num_kv_heads), int(self.kv_cache_spec.head_size), self.page_size,
                     causal=True, sm_scale=key.sm_scale, window_left=key.window_left,
                     logits_soft_cap=key.logits_soft_cap or None, q_data_type=self.q_dtype, kv_data_type=self.dtype)
        return wrapper

    # --- validation (raises before anything is planned) ----------------------------------
    def _check(self, cm: CommonAttentionMetadata) -> tuple[int, np.ndarray, np.ndarray, int]:
        """``(num_reqs, query_start_loc_cpu [n + 1], seq_lens_cpu [n], num_decodes)`` as host
        numpy views, after the structural checks (always) and, with ``validate_values``,
        the value checks. The decodes-first order is checked always (it decides the split)."""
        n, cap = cm.num_reqs, self.config.max_num_reqs
        B = cm.query_start_loc.shape[0] - 1
        if not n <= B <= cap or cm.query_start_loc_cpu.shape[0] < n + 1 or cm.seq_lens_cpu.shape[0] < n:
            raise MetadataError(
                f"query_start_loc has {B + 1} entries (host copy {cm.query_start_loc_cpu.shape[0]}), seq_lens_cpu "
                f"{cm.seq_lens_cpu.shape[0]}, for num_reqs={n}: need num_reqs + 1 <= entries <= "
                f"BuilderConfig.max_num_reqs + 1 = {cap + 1}.")
        qsl = cm.query_start_loc_cpu[: n + 1].numpy()
        seq_lens = cm.seq_lens_cpu[:n].numpy()
        qlens = np.diff(qsl)
        if self.validate_values:
            self._check_values(cm, qsl, qlens, seq_lens)
        decode = qlens == 1
        num_decodes = int(np.count_nonzero(decode))
        if num_decodes and not decode[:num_decodes].all():
            i = int(np.argmax(~decode))
            raise MetadataError(
                f"request {i} is a prefill ({int(qlens[i])} query tokens) but a decode follows it: flashinfer runs "
                "decodes first and prefills last; the runner must honour reorder_batch_threshold = 1 "
                "(StepCompiler(reorder_batch_threshold=...)).")
        bt = cm.block_table_tensor
        if bt.dim() != 2 or bt.shape[0] < B or bt.dtype != torch.int32 or not same_device(bt.device, self.device):
            raise MetadataError(f"block_table_tensor is {bt.dtype} {tuple(bt.shape)} on {bt.device}: flashinfer needs "
                                f"int32 [>= {B}, max_num_blocks_per_req] on {self.device}.")
        if n and cdiv(cm.max_seq_len, self.page_size) > bt.shape[1]:
            raise MetadataError(f"max_seq_len {cm.max_seq_len} needs more than the block table's {bt.shape[1]} "
                                f"pages of {self.page_size} tokens.")
        check_slot_mapping(cm.slot_mapping, cm.num_actual_tokens, self.config.max_num_batched_tokens, self.device)
        return n, qsl, seq_lens, num_decodes

    @staticmethod
    def _check_values(cm: CommonAttentionMetadata, qsl: np.ndarray, qlens: np.ndarray, seq_lens: np.ndarray) -> None:
        if int(qsl[-1]) != cm.num_actual_tokens:
            raise MetadataError(f"query_start_loc_cpu[num_reqs]={int(qsl[-1])} but num_actual_tokens="
                                f"{cm.num_actual_tokens}: they must agree.")
        bad = (qlens < 1) | (seq_lens < qlens)
        if bad.any():
            i = int(np.argmax(bad))
            raise MetadataError(f"request {i}: query length {int(qlens[i])} with seq_len {int(seq_lens[i])}: need "
                                "1 <= query_len <= seq_len for every real request.")
        if seq_lens.shape[0] and int(seq_lens.max()) > cm.max_seq_len:
            raise MetadataError(f"max_seq_len={cm.max_seq_len} but seq_lens holds {int(seq_lens.max())}: "
                                "max_seq_len must bound every seq_len.")
