"""Helpers shared by the kernel backends (``flash_attn``, ``flashinfer``, ``triton``).

Not a backend: nothing here is registered. Each module is one concept:

* ``window.py`` — attnplug's sliding window ``W`` in the kernel libraries' conventions;
* ``decoder_impl.py`` — the constructor of a decoder impl taking sinks and ALiBi slopes:
  every argument checked, then stored (``torch_native``, ``triton``);
* ``shape_checks.py`` — the per-head shapes of query / key / value, checked by every impl;
* ``features.py`` — the sliding-window / soft-cap declarations the paged backends share;
* ``cache_write.py`` — a graph-safe torch scatter of K/V into a paged cache by slot;
* ``layer_params.py`` — the live impls' per-layer attention parameters (scale, soft-cap,
  window, heads), which builders need to plan kernels before any layer runs;
* ``merge.py`` — merging two partial attention results by their log-sum-exp (cascade);
* ``buffer_checks.py`` — copies into persistent (CUDA-graph) buffers, with their checks;
* ``value_checks.py`` — slots, block ids and lengths checked against the cache before a
  kernel indexes memory with them (CPU always, a GPU with ``ATTNPLUG_VALIDATE=1``).
"""

from attnplug.backends.common.cache_write import write_kv_by_slot
from attnplug.backends.common.layer_params import AttentionLayerParams, LiveLayerParams
from attnplug.backends.common.merge import merge_attn_states
from attnplug.backends.common.window import fa_window_size, flashinfer_window_left

__all__ = [
    "AttentionLayerParams", "LiveLayerParams", "fa_window_size", "flashinfer_window_left",
    "merge_attn_states", "write_kv_by_slot",
]
