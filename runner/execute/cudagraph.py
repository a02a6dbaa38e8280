"""CUDA-graph padding and graph-mode negotiation.

A CUDA graph replays fixed shapes, so a step is *padded* to one of a few capture sizes:

* the token count ``Q`` goes up to the next capture size ``P``; padded tokens get
  position 0, token 0 and ``PAD_SLOT_ID`` (``prepare_inputs(num_tokens_padded=P)``);
* the request count ``R`` goes up to the next capture size ``R_pad`` (``== P`` for a
  uniform single-token decode batch); padded requests have *empty queries*
  (``query_start_loc`` repeats its last value), ``seq_lens`` 0 and null block-table rows;
* ``num_actual_tokens`` and ``num_reqs`` stay the real counts.

Example: three decodes and a 5-token prefill, capture sizes ``[1, 2, 4, 8, 16]``::

    Q = 8 -> P = 8;  R = 4 -> R_pad = 4           (already sizes: nothing to pad)
    Q = 9 -> P = 16; R = 5 -> R_pad = 8
    query_start_loc [0, 1, 2, 3, 4, 9]  ->  [0, 1, 2, 3, 4, 9, 9, 9, 9]
    seq_lens        [7, 5, 9, 3, 5]     ->  [7, 5, 9, 3, 5, 0, 0, 0]

The graph *mode* is negotiated from the minimum ``AttentionCGSupport`` over all the
runner's builders (:func:`negotiate_cudagraph_mode`): ``ALWAYS`` -> ``FULL`` (any batch in
one graph), ``UNIFORM_BATCH`` / ``UNIFORM_SINGLE_TOKEN_DECODE`` -> ``FULL_DECODE_ONLY``
(pure-decode batches in graphs, the rest eager), ``NEVER`` -> ``PIECEWISE`` (attention
must stay outside graphs; attnplug has no piecewise compilation, so such steps run
eagerly, unpadded). The decision names the limiting builder.

A step that will replay a graph builds its metadata with
``builder.build_for_cudagraph_capture`` (capture and every replay alike: the host ints a
graph bakes in must be the same bounds each time). Capturing and replaying is
:class:`CUDAGraphRunner` (``cudagraph_capture.py``); on a CPU the steps are padded the
same way but nothing is captured.
"""

from __future__ import annotations

import enum
from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from attnplug.cache_groups.buffers import CpuGpuBuffer
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.contracts import AttentionCGSupport, AttentionMetadataBuilder
from attnplug.core.devices import resolve_device
from attnplug.core.errors import ConfigError, MetadataError
from attnplug.core.metadata import CommonAttentionMetadata

DEFAULT_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4) + tuple(range(8, 513, 8))
"""Token counts (and request counts) graphs are captured for: 1, 2, 4, then every 8 up to 512."""


class CUDAGraphMode(str, enum.Enum):
    """How much of a step runs in a CUDA graph (ordered: NONE < PIECEWISE < FULL_DECODE_ONLY < FULL)."""

    NONE = "none"
    """No graphs; steps are not padded."""
    PIECEWISE = "piecewise"
    """Attention outside graphs (some builder supports none); attnplug runs such steps eagerly."""
    FULL_DECODE_ONLY = "full_decode_only"
    """Pure single-token-decode steps in one graph each; other steps eager."""
    FULL = "full"
    """Every step up to the largest capture size in one graph."""

    @property
    def rank(self) -> int:
        return list(CUDAGraphMode).index(self)

    @classmethod
    def parse(cls, value: "CUDAGraphMode | str | None") -> "CUDAGraphMode":
        """``None`` -> NONE; names are case-insensitive (``"full_decode_only"``...).

        Raises:
            ConfigError: an unknown name.
        """
        if value is None:
            return cls.NONE
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ConfigError("cudagraph_mode", f"{value!r} is not a CUDA-graph mode; use one of "
                                                f"{[m.value for m in cls]}") from None


_MODE_FOR_SUPPORT = {
    AttentionCGSupport.ALWAYS: CUDAGraphMode.FULL,
    AttentionCGSupport.UNIFORM_BATCH: CUDAGraphMode.FULL_DECODE_ONLY,
    AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE: CUDAGraphMode.FULL_DECODE_ONLY,
    AttentionCGSupport.NEVER: CUDAGraphMode.PIECEWISE,
}


@dataclass(frozen=True)
class GraphModeDecision:
    """The negotiated mode and why.

    Attributes:
        mode: what the runner uses.
        reason: one sentence naming the limiting builder (or the request / device).
        limiting: ``"cache group G (NAME, BuilderClass): SUPPORT"`` of the builder with the
            lowest support, ``None`` when the request itself was the limit.
        capture: graphs are actually captured (the device is CUDA); on a CPU the steps
            are still padded as ``mode`` says.
    """

    mode: CUDAGraphMode
    reason: str
    limiting: str | None = None
    capture: bool = False


def negotiate_cudagraph_mode(builders: Sequence[AttentionMetadataBuilder], requested: CUDAGraphMode | str | None,
                             device: torch.device | str = "cuda", names: Sequence[str] | None = None
                             ) -> GraphModeDecision:
    """The graph mode for a runner: ``min(requested, mode of the least capable builder)``.

    Args:
        builders: one per cache group; each says ``get_cudagraph_support(kv_cache_spec)``.
        requested: the user's mode (``None``/``"none"`` turns graphs off).
        device: the runner's device (graphs are captured only on CUDA).
        names: per builder, a label for messages (the backend name); default the class.

    Returns:
        The decision, its reason naming the limiting builder.

    Raises:
        ConfigError: an unknown ``requested`` mode.
        ValueError: ``names`` not one per builder.

    Examples:
        >>> negotiate_cudagraph_mode([], "full", "cpu").mode.value
        'full'
    """
    requested = CUDAGraphMode.parse(requested)
    capture = torch.device(device).type == "cuda"
    where = "" if capture else f"; on {torch.device(device).type} nothing is captured (steps are only padded)"
    if requested is CUDAGraphMode.NONE:
        return GraphModeDecision(CUDAGraphMode.NONE, "CUDA graphs are off (cudagraph_mode='none')", None, False)
    labels = list(names) if names is not None else [type(b).__name__ for b in builders]
    if len(labels) != len(builders):
        raise ValueError(f"names has {len(labels)} labels for {len(builders)} builders: give one per builder")
    worst = None
    for g, (b, label) in enumerate(zip(builders, labels)):
        support = AttentionCGSupport(type(b).get_cudagraph_support(b.kv_cache_spec))
        if worst is None or support < worst[0]:
            worst = (support, f"cache group {g} ({label}, {type(b).__name__}): {support.name}")
    allowed = CUDAGraphMode.FULL if worst is None else _MODE_FOR_SUPPORT[worst[0]]
    if requested.rank <= allowed.rank:
        why = f"{requested.value} as requested"
        if worst is not None:
            why += f"; the least capable builder is {worst[1]}"
        full = requested in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY)
        return GraphModeDecision(requested, why + (where if full else ""), None, capture and full)
    mode = allowed
    what = {CUDAGraphMode.FULL_DECODE_ONLY: "only pure single-token-decode steps run in full graphs",
            CUDAGraphMode.PIECEWISE: "attention cannot be captured, and attnplug has no piecewise compilation: "
                                     "steps run eagerly"}[mode]
    full = mode in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY)
    return GraphModeDecision(mode, f"{mode.value} instead of {requested.value}: {worst[1]} limits it; {what}"
                             f"{where if full else ''}", worst[1], capture and full)


@dataclass(frozen=True)
class PaddedBatch:
    """How one step is shaped.

    Attributes:
        num_tokens, num_reqs: the real counts.
        num_tokens_padded, num_reqs_padded: the padded counts (equal to the real ones when
            the step is not padded).
        uniform_decode: every request has exactly one query token.
        use_graph: the step runs in a full graph (capture or replay) of :attr:`key`.
    """

    num_tokens: int
    num_reqs: int
    num_tokens_padded: int
    num_reqs_padded: int
    uniform_decode: bool
    use_graph: bool

    @property
    def padded(self) -> bool:
        return self.num_tokens_padded != self.num_tokens or self.num_reqs_padded != self.num_reqs

    @property
    def key(self) -> tuple[int, int, bool]:
        """The graph a step of this shape replays."""
        return (self.num_tokens_padded, self.num_reqs_padded, self.uniform_decode)


class CUDAGraphDispatcher:
    """Chooses each step's padded shape (see the module docstring).

    Args:
        mode: the negotiated mode.
        capture_sizes: sizes graphs exist for (sorted, deduplicated); only sizes up to
            ``max_num_batched_tokens`` are kept.
        max_num_reqs, max_num_batched_tokens: the runner's limits.

    A uniform decode batch pads its requests with its tokens (``num_reqs_padded ==
    num_tokens_padded``), so it runs in a graph only while that size is at most
    ``max_num_reqs``: with ``max_num_reqs`` not itself a capture size, the decodes just
    below it run eagerly (add it to ``capture_sizes`` to graph them).

    Raises:
        ConfigError: an unknown mode, a capture size that is not a positive int, limits
            that are not positive ints, or no capture size in ``[1,
            max_num_batched_tokens]`` (unless the mode is ``NONE``).

    Examples:
        >>> d = CUDAGraphDispatcher(CUDAGraphMode.FULL, [1, 2, 4, 8, 16], 16, 16)
        >>> b = d.dispatch(num_tokens=9, num_reqs=5, max_query_len=5)
        >>> (b.num_tokens_padded, b.num_reqs_padded, b.use_graph)
        (16, 8, True)
        >>> d.dispatch(num_tokens=3, num_reqs=3, max_query_len=1).key
        (4, 4, True)
    """

    def __init__(self, mode: CUDAGraphMode, capture_sizes: Sequence[int], max_num_reqs: int,
                 max_num_batched_tokens: int):
        mode = CUDAGraphMode.parse(mode)
        for name, value in (("max_num_reqs", max_num_reqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not _is_int(value) or value < 1:
                raise ConfigError(name, f"{value!r} must be a positive int")
        if isinstance(capture_sizes, (str, bytes)) or not all(_is_int(s) and s > 0 for s in capture_sizes):
            raise ConfigError("cudagraph_capture_sizes", f"{capture_sizes!r} must be a sequence of positive ints "
                                                         "(token counts)")
        sizes = sorted({int(s) for s in capture_sizes if s <= max_num_batched_tokens})
        if mode is not CUDAGraphMode.NONE and not sizes:
            raise ConfigError("cudagraph_capture_sizes", f"{list(capture_sizes)!r} has no size in [1, "
                              f"{max_num_batched_tokens}] (max_num_batched_tokens): give at least one")
        self.mode = mode
        self.capture_sizes = tuple(sizes)
        self.max_num_reqs = int(max_num_reqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)

    def next_size(self, n: int) -> int | None:
        """The smallest capture size ``>= n``, or ``None`` when ``n`` exceeds them all."""
        i = bisect_left(self.capture_sizes, n)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def dispatch(self, num_tokens: int, num_reqs: int, max_query_len: int) -> PaddedBatch:
        """The shape of a step with ``num_tokens`` tokens over ``num_reqs`` requests.

        A step runs in a graph when the mode allows its kind (any step under FULL,
        pure decodes under FULL_DECODE_ONLY) and its padded sizes fit the capture sizes
        and ``max_num_reqs``; otherwise it runs eagerly, unpadded.

        Raises:
            MetadataError: counts no step can have: negative, more requests than tokens
                (every scheduled request has a token), ``max_query_len`` outside
                ``[1, num_tokens]`` for a non-empty step, or counts past the runner's limits.
        """
        problems = []
        if not all(_is_int(x) and x >= 0 for x in (num_tokens, num_reqs, max_query_len)):
            problems.append("counts must be non-negative ints")
        elif num_reqs > num_tokens or (num_tokens and not 1 <= max_query_len <= num_tokens):
            problems.append("every request has 1..num_tokens query tokens")
        elif num_reqs > self.max_num_reqs or num_tokens > self.max_num_batched_tokens:
            problems.append(f"the runner's limits are max_num_reqs={self.max_num_reqs}, "
                            f"max_num_batched_tokens={self.max_num_batched_tokens}")
        if problems:
            raise MetadataError(f"dispatch(num_tokens={num_tokens!r}, num_reqs={num_reqs!r}, "
                                f"max_query_len={max_query_len!r}): {problems[0]}")
        uniform = num_reqs > 0 and max_query_len == 1 and num_tokens == num_reqs
        eager = PaddedBatch(num_tokens, num_reqs, num_tokens, num_reqs, uniform, False)
        if num_tokens == 0 or self.mode is CUDAGraphMode.NONE or self.mode is CUDAGraphMode.PIECEWISE:
            return eager
        if self.mode is CUDAGraphMode.FULL_DECODE_ONLY and not uniform:
            return eager
        P = self.next_size(num_tokens)
        R = P if uniform else self.next_size(num_reqs)
        if P is None or R is None or R > self.max_num_reqs:
            return eager
        return PaddedBatch(num_tokens, num_reqs, P, R, uniform, True)


def _is_int(x) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


class PaddedMetadata:
    """Persistent buffers that hold the padded per-request metadata of a step.

    Args:
        max_num_reqs: rows (padded requests included).
        device: the compute device.

    The padded tensors have the same address every step (CUDA graphs read them).
    """

    def __init__(self, max_num_reqs: int, device: torch.device | str):
        self.device = resolve_device(device)
        self.max_num_reqs = int(max_num_reqs)
        self._qsl = CpuGpuBuffer((max_num_reqs + 1,), torch.int32, self.device)
        self._seq_lens = CpuGpuBuffer((max_num_reqs,), torch.int32, self.device)
        self._computed = torch.zeros(max_num_reqs, dtype=torch.int32)
        self._prefilling = torch.zeros(max_num_reqs, dtype=torch.bool)
        self._block_tables: dict[int, torch.Tensor] = {}

    def pad(self, common: Sequence[CommonAttentionMetadata], num_reqs_padded: int) -> list[CommonAttentionMetadata]:
        """Per group, ``common[g]`` with ``num_reqs_padded`` request rows (module docstring).

        Args:
            common: the step's per-group metadata (unpadded requests; the slot mapping may
                already be padded to the padded token count).
            num_reqs_padded: ``>= num_reqs``, ``<= max_num_reqs``.

        Returns:
            New metadata objects (``replace`` copies): ``query_start_loc(_cpu)``
            ``[num_reqs_padded + 1]``, ``seq_lens(_cpu)``, ``num_computed_tokens_cpu``,
            ``is_prefilling`` ``[num_reqs_padded]`` and each group's ``block_table_tensor``
            ``[num_reqs_padded, width]``; ``num_reqs`` and ``num_actual_tokens`` unchanged.

        Raises:
            MetadataError: ``num_reqs_padded`` out of range (nothing is written).

        Host→device copies are non-blocking; no host synchronisation.
        """
        if not common:
            return []
        cm0 = common[0]
        R, Rp = cm0.num_reqs, int(num_reqs_padded)
        if not R <= Rp <= self.max_num_reqs:
            raise MetadataError(f"num_reqs_padded={Rp} must lie in [num_reqs={R}, max_num_reqs={self.max_num_reqs}]")
        qsl = self._qsl.np
        qsl[: R + 1] = cm0.query_start_loc_cpu[: R + 1].numpy()
        qsl[R + 1: Rp + 1] = qsl[R]
        seq = self._seq_lens.np
        seq[:R] = cm0.seq_lens_cpu[:R].numpy()
        seq[R:Rp] = 0
        self._computed[:R] = cm0.num_computed_tokens_cpu[:R]
        self._computed[R:Rp] = 0
        prefilling = None
        if cm0.is_prefilling is not None:
            self._prefilling[:R] = cm0.is_prefilling[:R]
            self._prefilling[R:Rp] = False
            prefilling = self._prefilling[:Rp]
        shared = dict(query_start_loc=self._qsl.copy_to_gpu(Rp + 1), query_start_loc_cpu=self._qsl.cpu[: Rp + 1],
                      seq_lens=self._seq_lens.copy_to_gpu(Rp), seq_lens_cpu=self._seq_lens.cpu[:Rp],
                      num_computed_tokens_cpu=self._computed[:Rp], is_prefilling=prefilling)
        return [cm.replace(block_table_tensor=self._padded_block_table(g, cm.block_table_tensor, R, Rp), **shared)
                for g, cm in enumerate(common)]

    def _padded_block_table(self, group: int, block_table: torch.Tensor, R: int, Rp: int) -> torch.Tensor:
        width = block_table.shape[1]
        buf = self._block_tables.get(group)
        if buf is None or buf.shape[1] < width:
            buf = torch.full((self.max_num_reqs, width), NULL_BLOCK_ID, dtype=torch.int32, device=self.device)
            self._block_tables[group] = buf
        view = buf[:Rp, :width]
        view[:R].copy_(block_table[:R], non_blocking=True)
        view[R:].fill_(NULL_BLOCK_ID)
        return view


def batch_shape(num_scheduled_tokens: np.ndarray) -> tuple[int, int, int]:
    """``(num_tokens, num_reqs, max_query_len)`` of a step from its per-row query lengths."""
    n = int(num_scheduled_tokens.shape[0])
    return int(num_scheduled_tokens.sum()), n, int(num_scheduled_tokens.max()) if n else 0
