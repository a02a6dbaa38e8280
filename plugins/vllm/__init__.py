"""The bridge to vLLM (0.32, 0.33): attnplug backends serve inside vLLM, and vLLM's
backends are judged by attnplug's conformance suite (``attnplug check vllm:NAME``).

Nothing here imports vLLM at package import. ``versions`` (no vLLM import) names the
supported minors and the adapter package of each (``v0_32/``, ``v0_33/``: where that minor
keeps every vLLM name the bridge uses, and ``interface.py``, the interface it was written
against); ``_vllm`` imports vLLM, checks its version and re-exports the adapter's names;
``fingerprint`` reads the installed vLLM's interface. The translation is written once:
``entry`` (the ``vllm.general_plugins`` entry point), ``bridged`` (class paths vLLM loads), ``adapter`` (vLLM backend/builder/impl
around an attnplug backend), ``metadata`` (vLLM's ``CommonAttentionMetadata`` ->
attnplug's), ``kv_layout`` (vLLM's KV cache in the attnplug backend's layout, zero-copy),
``reverse`` (a vLLM backend as an attnplug backend). See ``docs/vllm.md``.
"""
