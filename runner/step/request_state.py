"""``CachedRequestState``: the runner's object view of one request.

The runner keeps two views of its requests (docs/architecture.md): this object view, one per
request id, which survives being *unscheduled*; and the columnar ``InputBatch``, one row
per request of the current step. They are not two copies of the truth. While a request
holds a batch row, the row's columns ARE its ``num_computed_tokens``, token history and
block ids, and the properties below read through to them; when the request leaves the
batch (unscheduled or preempted) the row's values are written back into the object, and
written into a row again when it returns. So the views cannot disagree, and the hot path
updates only the columns (vectorized), never per-request Python objects.

Mutate a request through the step compiler (``StepCompiler.update_states`` /
``append_output_tokens``); the properties returning token or block lists return copies.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np
import torch

from attnplug.core.errors import MetadataError
from attnplug.runner.step.scheduler_output import SamplingParams


class BatchRows(Protocol):
    """What a request reads of the batch that holds its row (``InputBatch`` implements
    it): the token table, the counts and the block tables, indexed by row."""

    token_ids_cpu: np.ndarray
    """``[max_num_reqs, max_model_len]`` ``int32``."""
    num_tokens: np.ndarray
    """``[max_num_reqs]`` ``int32``."""
    num_computed_tokens_cpu: np.ndarray
    """``[max_num_reqs]`` ``int32``."""
    block_table: Any
    """A ``MultiGroupBlockTable``: iterates over the groups' ``BlockTable``."""


def make_generator(sampling_params: SamplingParams | None) -> torch.Generator | None:
    """A CPU ``torch.Generator`` seeded with ``sampling_params.seed``, or ``None`` when unseeded."""
    if sampling_params is None or sampling_params.seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed(int(sampling_params.seed))
    return gen


class CachedRequestState:
    """One request as the runner knows it.

    Args:
        req_id: the request id.
        prompt_token_ids: the prompt (copied: the caller's list is not kept).
        block_ids: per cache group, the manager block ids in logical order.
        num_computed_tokens: tokens whose K/V is cached (units: tokens).
        sampling_params: sampling settings (``None`` → greedy defaults).
        output_token_ids: tokens generated so far (non-empty for a request re-sent in full).
        generator: per-request RNG; ``None`` creates one from ``sampling_params.seed`` (or
            none when unseeded).
        token_ids_np, block_ids_np: the same tokens (``[num_tokens]`` ``int32``) and block
            ids (per group ``[n]`` ``int32``) already converted (the step compiler's
            packers); then ``output_token_ids`` / ``block_ids`` are not read again.

    Attributes:
        req_id, sampling_params, generator: as given.
    """

    __slots__ = ("req_id", "sampling_params", "generator", "_token_ids_np",
                 "_num_prompt_tokens", "_block_ids_np", "_num_computed_tokens", "_batch", "_row")

    def __init__(self, req_id: str, prompt_token_ids: Sequence[int], block_ids: Sequence[Sequence[int]],
                 num_computed_tokens: int = 0, sampling_params: SamplingParams | None = None,
                 output_token_ids: Sequence[int] = (), generator: torch.Generator | None = None,
                 *, token_ids_np: np.ndarray | None = None, block_ids_np: tuple[np.ndarray, ...] | None = None):
        self.req_id = req_id
        sp = self.sampling_params = SamplingParams() if sampling_params is None else sampling_params
        self.generator = generator if generator is not None or sp.seed is None else make_generator(sp)
        self._num_prompt_tokens = len(prompt_token_ids)
        if token_ids_np is None:
            token_ids_np = np.asarray([*prompt_token_ids, *output_token_ids], dtype=np.int32)
        self._token_ids_np = token_ids_np
        """Detached storage: prompt then outputs, ``[num_tokens]`` int32 (``None`` while attached)."""
        self._block_ids_np = (tuple(np.asarray(b, dtype=np.int32) for b in block_ids)
                              if block_ids_np is None else block_ids_np)
        self._num_computed_tokens = int(num_computed_tokens)
        self._batch: BatchRows | None = None
        self._row = -1

    @classmethod
    def _admitted(cls, new_req, batch: BatchRows, row: int) -> "CachedRequestState":
        """The state of a fresh request whose row ``InputBatch.admit_staged`` already
        wrote (``new_req``: its ``NewRequestData``, validated)."""
        st = cls.__new__(cls)
        st.req_id = new_req.req_id
        sp = st.sampling_params = new_req.sampling_params
        st.generator = None if sp.seed is None else make_generator(sp)
        st._num_prompt_tokens = len(new_req.prompt_token_ids)
        st._token_ids_np = st._block_ids_np = None
        st._num_computed_tokens = new_req.num_computed_tokens
        st._batch, st._row = batch, row
        return st

    # --- batch attachment (used by InputBatch only) -------------------------------------
    def _attach(self, batch: BatchRows, row: int) -> None:
        self._batch, self._row = batch, row
        self._token_ids_np = None
        self._block_ids_np = None

    def _detach(self) -> None:
        b, r = self._batch, self._row
        self._token_ids_np = b.token_ids_cpu[r, :b.num_tokens[r]].copy()
        self._num_computed_tokens = int(b.num_computed_tokens_cpu[r])
        self._block_ids_np = tuple(bt.block_table_np[r, :bt.num_blocks_per_row[r]].copy()
                                   for bt in b.block_table)
        self._batch, self._row = None, -1

    def _drop(self) -> None:
        """The request finished while in the batch: its state is gone, not written back."""
        self._batch, self._row = None, -1
        self._token_ids_np = None

    def detached_token_ids(self) -> np.ndarray:
        """The detached storage itself (``[num_tokens]`` ``int32``, writable), for filling a
        placeholder of a request that left the batch (``runner/step/placeholders.py``).

        Raises:
            MetadataError: the request is in the batch (its row is the storage), or dropped.
        """
        if self._batch is not None:
            raise MetadataError(f"request {self.req_id!r} is in the batch: its row holds its tokens")
        return self._detached_tokens()

    def _detached_tokens(self) -> np.ndarray:
        if self._token_ids_np is None:
            raise MetadataError(f"request {self.req_id!r} finished and its state was dropped; keep what "
                                "you need before it finishes")
        return self._token_ids_np

    # --- the object view ----------------------------------------------------------------
    @property
    def row(self) -> int | None:
        """The request's batch row, or ``None`` when it is not in the batch."""
        return None if self._batch is None else self._row

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V is cached (units: tokens)."""
        if self._batch is not None:
            return int(self._batch.num_computed_tokens_cpu[self._row])
        return self._num_computed_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt (a fresh list, from the runner's own copy)."""
        return self.token_ids_np()[:self._num_prompt_tokens].tolist()

    @property
    def num_tokens(self) -> int:
        """All tokens the request holds: prompt plus outputs."""
        if self._batch is not None:
            return int(self._batch.num_tokens[self._row])
        return int(self._detached_tokens().shape[0])

    def token_ids_np(self) -> np.ndarray:
        """``[num_tokens]`` ``int32``: prompt then outputs (a copy while in the batch)."""
        if self._batch is not None:
            return self._batch.token_ids_cpu[self._row, :self._batch.num_tokens[self._row]].copy()
        return self._detached_tokens()

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs (a fresh list)."""
        return self.token_ids_np().tolist()

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """Generated tokens so far. A snapshot tuple: append through
        ``StepCompiler.append_output_tokens``, not here."""
        return tuple(self.token_ids_np()[self._num_prompt_tokens:].tolist())

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        """Per cache group, the manager block ids in logical order (fresh lists)."""
        if self._batch is not None:
            return tuple(bt.row_block_ids(self._row) for bt in self._batch.block_table)
        self._detached_tokens()
        return tuple(b.tolist() for b in self._block_ids_np)

    def block_ids_np(self) -> tuple[np.ndarray, ...]:
        """Per cache group, ``[num_blocks]`` ``int32`` manager ids (views while in the batch)."""
        if self._batch is not None:
            return tuple(bt.block_table_np[self._row, :bt.num_blocks_per_row[self._row]]
                         for bt in self._batch.block_table)
        self._detached_tokens()
        return self._block_ids_np

    def __repr__(self) -> str:
        where = f"row {self._row}" if self._batch is not None else "not in batch"
        return (f"CachedRequestState({self.req_id!r}, num_prompt_tokens={self.num_prompt_tokens}, "
                f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens}, {where})")
