"""The Redis connector's worker side: fetch, check and copy loads; copy out and write saves.

A mixin of :class:`~attnplug.plugins.kv_connectors.redis_connector.RedisConnector` (which
sets ``store``, ``groups``, ``stats`` and the worker state in its constructor).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any, Mapping

import torch

from attnplug.core.errors import ConfigError
from attnplug.core.kv_connector import KVConnectorOutput
from attnplug.plugins.kv_connectors.block_codec import BlockFault, BlockLayout, decode_block, encode_block
from attnplug.plugins.kv_connectors.redis_meta import LoadSpec, RedisConnectorMetadata
from attnplug.plugins.kv_connectors.store import StoreUnavailable


class RedisWorkerSide:
    """``register_kv_caches``, ``start_load_kv``, ``get_finished``, ``save_kv_layer``, ``wait_for_save``."""

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Per group: its layers' cache tensors and the block layout of a value.

        Raises:
            ConfigError: a layer's cache is not one tensor in the group's declared layout.
        """
        for g, grp in enumerate(self.groups):
            if grp.kind == "mamba":
                self._register_state_group(g, grp, kv_caches)
                continue
            dim = grp.layout_dims.index("block")
            k = grp.block_size // grp.kernel_block_size
            layers = []
            for j, name in enumerate(grp.layer_names):
                t = kv_caches[name]
                if not isinstance(t, torch.Tensor) or t.dim() != len(grp.layout_dims):
                    raise ConfigError("--kv-connector", f"redis: layer {name!r}'s cache is not a tensor of dims "
                                      f"{grp.layout_dims}")
                layers.append((name, t))
                self._layer_index[name] = (g, j)
            shape = list(layers[0][1].shape)
            shape[dim] = k
            self._caches.append(layers)
            self._block_dims.append(dim)
            dtype = str(layers[0][1].dtype).replace("torch.", "")
            self._layouts.append(BlockLayout(grp.kind, grp.block_size, grp.kernel_block_size, grp.sliding_window,
                                             tuple(grp.layout_dims), ((dtype, tuple(shape)),), len(layers)))
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnplug-kv-load")

    def _register_state_group(self, g: int, grp, kv_caches: Mapping[str, Any]) -> None:
        """A Mamba group: each layer's cache is a tuple of ``[num_slots, ...]`` state tensors."""
        layers = []
        for j, name in enumerate(grp.layer_names):
            t = kv_caches[name]
            if not isinstance(t, tuple) or not t or not all(isinstance(x, torch.Tensor) for x in t):
                raise ConfigError("--kv-connector", f"redis: Mamba layer {name!r}'s cache is not a tuple of tensors")
            layers.append((name, t))
            self._layer_index[name] = (g, j)
        parts = tuple((str(x.dtype).replace("torch.", ""), tuple(x.shape[1:])) for x in layers[0][1])
        self._caches.append(layers)
        self._block_dims.append(-1)
        self._layouts.append(BlockLayout(grp.kind, grp.block_size, grp.kernel_block_size, None, (), parts,
                                         len(layers)))

    def _block_view(self, g: int, layer: int, block_id: int) -> list[torch.Tensor]:
        """Views of ``block_id`` in layer ``layer`` of group ``g``, one per part."""
        cache = self._caches[g][layer][1]
        if self._block_dims[g] < 0:  # a state group: the slot's row of each state tensor
            return [t[block_id] for t in cache]
        k = self._layouts[g].parts[0][1][self._block_dims[g]]
        return [cache.narrow(self._block_dims[g], block_id * k, k)]

    def _install_blocks(self, blocks, num_tokens: int, t0_ns: int) -> None:
        """Copy checked blocks into the cache and count the load: ``blocks`` is a list of
        ``(group, block id, per-layer parts)`` (each part a tensor shaped as
        :meth:`_block_view`'s view); ``num_tokens`` the tokens they bring; ``t0_ns`` when the
        load started (``time.perf_counter_ns``)."""
        nbytes = 0
        for g, bid, layers in blocks:
            for j, parts in enumerate(layers):
                for view, part in zip(self._block_view(g, j, bid), parts):
                    view.copy_(part)
                    nbytes += part.numel() * part.element_size()
        self.stats.tokens_loaded += num_tokens
        self.stats.bytes_loaded += nbytes
        self.stats.load_time_ns.append(time.perf_counter_ns() - t0_ns)

    def start_load_kv(self) -> None:
        """Submit each load of the bound step to the fetch thread."""
        meta = self._meta
        if not isinstance(meta, RedisConnectorMetadata):
            return
        for spec in meta.loads:
            self._inflight[spec.req_id] = (self._executor.submit(self._fetch, spec), spec, time.perf_counter_ns())

    def _fetch(self, spec: LoadSpec) -> list[tuple[int, int, list[torch.Tensor]]]:
        """Fetch and check every block of a load (the fetch thread). Raises BlockFault or StoreUnavailable."""
        values = self.store.get_many([key for _, _, key in spec.blocks])
        out = []
        for (g, bid, key), value in zip(spec.blocks, values):
            if value is None:
                raise BlockFault("missing", f"{key} is not in the store any more")
            try:
                out.append((g, bid, decode_block(self._layouts[g], value)))
            except BlockFault:
                self.store.forget(key)
                raise
        return out

    def get_finished(self, block: bool = False) -> KVConnectorOutput:
        """Loads done since the last call, their blocks copied into the caches; with
        ``block`` (a step that computed nothing) wait for at least one first."""
        res = KVConnectorOutput()
        if not self._inflight:
            return res
        if block:
            cf.wait([f for f, _, _ in self._inflight.values()], return_when=cf.FIRST_COMPLETED)
        for rid in [r for r, (f, _, _) in self._inflight.items() if f.done()]:
            fut, spec, t0 = self._inflight.pop(rid)
            try:
                blocks = fut.result()
            except BlockFault as exc:
                self._fault(exc.kind, str(exc))
                res.failed_recving.add(rid)
                continue
            except StoreUnavailable as exc:
                self._fault("store_unavailable", str(exc))
                res.failed_recving.add(rid)
                continue
            self._install_blocks(blocks, spec.num_tokens, t0)
            res.finished_recving.add(rid)
        return res

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        """Copy this step's saved blocks of ``layer_name`` out of its cache (to the CPU)."""
        meta = self._meta
        if not isinstance(meta, RedisConnectorMetadata) or not meta.saves or layer_name not in self._layer_index:
            return
        g, j = self._layer_index[layer_name]
        n = len(self._caches[g])
        for spec in meta.saves:
            if spec.group != g:
                continue
            entry = self._pending_saves.setdefault(spec.key, (spec, [None] * n))
            entry[1][j] = [v.to("cpu", copy=True) for v in self._block_view(g, j, spec.block_id)]

    def wait_for_save(self) -> None:
        """Encode the step's complete blocks and write them (tier, then one pipeline)."""
        if not self._pending_saves:
            return
        t0 = time.perf_counter_ns()
        items, tokens = [], 0
        for key, (spec, slices) in self._pending_saves.items():
            if any(s is None for s in slices):
                continue  # a layer never saved (cannot happen through ModelRunner)
            items.append((key, encode_block(self._layouts[spec.group], slices)))
            if spec.group == 0:
                tokens += self.groups[0].block_size
        self._pending_saves = {}
        try:
            self.store.put_many(items)
        except StoreUnavailable as exc:
            self._fault("store_unavailable", str(exc))
            return
        self.stats.tokens_saved += tokens
        self.stats.bytes_saved += sum(len(v) for _, v in items)
        self.stats.save_time_ns.append(time.perf_counter_ns() - t0)
