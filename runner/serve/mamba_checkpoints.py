"""Prefix caching for Mamba groups: state checkpoints at multiples of the Mamba block size.

A Mamba request holds one state slot (``MambaStateManager``), overwritten every step, so a
prefix hit needs a *copy* of the state as it was after the prefix. With prefix caching the
Mamba group gets a checkpoint interval ``Bm`` (``mamba_block_size``: by default the least
common multiple of the attention groups' block sizes), and (vLLM's
``mamba_cache_mode = "align"`` semantics, not code):

* **align**: a chunk that crosses a multiple of ``Bm`` is cut to end at the last one inside
  it, so the state after ``k * Bm`` tokens exists at the end of some step (the rest of the
  prompt is computed in the next step);
* **save**: when a scheduled chunk ends at ``k * Bm`` (and those tokens are known), a free
  slot ``X`` of the group's pool is taken; the step's ``SchedulerOutput.mamba_state_copies``
  asks the runner to copy the request's slot into ``X`` *after* the forward; when the step
  is applied, ``X`` is registered under the hash of Mamba block ``k - 1`` (the chain at
  block size ``Bm``) and released to the pool's LRU (findable until evicted);
* **restore**: a hit of ``h = k * Bm`` tokens (the coordinator's Mamba rule: checkpoint
  ``k - 1`` cached) holds the checkpoint slot for the step and asks the runner to copy it
  into the request's own slot *before* the forward, which then starts from it
  (``has_initial_state``, as ``num_computed_tokens > 0``).

Every slot a copy touches is held (``ref_cnt > 0``) until the step is applied, so no slot
is read and reused in one step. Not with asynchronous scheduling (a step would be planned
before the previous one's saves are registered): the manager then disables caching.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from attnplug.cache_groups.specs import StateSpec


@dataclass
class MambaStateCopies:
    """Slot copies of one step, per Mamba group ``g`` (``SchedulerOutput.mamba_state_copies``).

    Attributes:
        restores: ``(g, src_slot, dst_slot)`` copied before the forward (checkpoint -> request).
        saves: ``(g, src_slot, dst_slot)`` copied after the forward (request -> checkpoint).
    """

    restores: list[tuple[int, int, int]] = field(default_factory=list)
    saves: list[tuple[int, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.restores or self.saves)


def mamba_block_size(specs) -> int:
    """The checkpoint interval: lcm of the attention groups' block sizes (16 with none)."""
    sizes = [s.block_size for s in specs if not isinstance(s, StateSpec)]
    return math.lcm(*sizes) if sizes else 16


class MambaCheckpoints:
    """The save / restore bookkeeping of a ``PrefixCachingKVCacheManager``'s Mamba groups.

    Args:
        manager: the owning manager (``pools``, ``managers``, ``_block_hashes``).
        groups: indices of the Mamba groups.
        block_size: ``Bm`` tokens.
    """

    def __init__(self, manager, groups: list[int], block_size: int):
        self.manager = manager
        self.groups = groups
        self.block_size = block_size
        self.copies = MambaStateCopies()
        self._pending_saves: list[tuple[int, int, bytes]] = []  # (g, slot, hash) to register
        self._held: list[tuple[int, int]] = []  # (g, slot) to release when the step is applied
        self.num_saves = 0
        self.num_restores = 0

    def align(self, start: int, n: int) -> int:
        """``n`` cut so that ``start + n`` is the last multiple of ``Bm`` in ``(start, start + n]``
        (unchanged when there is none)."""
        end = (start + n) // self.block_size * self.block_size
        return end - start if end > start else n

    def hold_hit(self, rid: str, hit_ids: dict[int, int]) -> None:
        """A hit admitted: per Mamba group, the checkpoint slot to restore into ``rid``'s own
        slot (already allocated) this step."""
        for g, slot in hit_ids.items():
            pool = self.manager.pools[g]
            pool.touch([slot])
            own = self.manager.managers[g].block_ids(rid)[0]
            self.copies.restores.append((g, slot, own))
            self._held.append((g, slot))
            self.num_restores += 1

    def plan_saves(self, sched: dict[str, int], requests: dict) -> None:
        """After scheduling: a save for every chunk that ends at a multiple of ``Bm``."""
        B = self.block_size
        for rid, n in sched.items():
            req = requests[rid]
            end = req.num_computed_tokens + n
            tokens = req.all_token_ids
            if end % B or end > len(tokens):
                continue
            h = self.manager._block_hashes(rid, tokens)[B][end // B - 1]
            for g in self.groups:
                pool, own = self.manager.pools[g], self.manager.managers[g].block_ids(rid)
                if not own or pool.get_cached_block(h) is not None or pool.num_free_blocks == 0:
                    continue
                (slot,) = pool.allocate(1)
                self.copies.saves.append((g, own[0], slot))
                self._pending_saves.append((g, slot, h))
                self._held.append((g, slot))
                self.num_saves += 1

    def take(self) -> MambaStateCopies:
        """This step's copies (for the ``SchedulerOutput``); the next step starts empty."""
        out, self.copies = self.copies, MambaStateCopies()
        return out

    def finish_step(self) -> None:
        """The step was applied: register its saves, release every slot it held."""
        for g, slot, h in self._pending_saves:
            self.manager.pools[g].cache_full_blocks([slot], [h], 0, 1)
        for g, slot in self._held:
            self.manager.pools[g].free([slot])
        self._pending_saves, self._held = [], []
