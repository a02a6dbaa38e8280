"""The bridge to vLLM (0.32): attnplug backends serve inside vLLM, and vLLM's backends
are judged by attnplug's conformance suite (``attnplug check vllm:NAME``).

Nothing here imports vLLM at package import; every vLLM import is in ``_vllm.py`` (with
the supported version range). Modules: ``entry`` (the ``vllm.general_plugins`` entry
point), ``bridged`` (class paths vLLM loads), ``adapter`` (vLLM backend/builder/impl
around an attnplug backend), ``metadata`` (vLLM's ``CommonAttentionMetadata`` ->
attnplug's), ``kv_layout`` (vLLM's KV cache in the attnplug backend's layout, zero-copy),
``reverse`` (a vLLM backend as an attnplug backend). See ``docs/vllm.md``.
"""
