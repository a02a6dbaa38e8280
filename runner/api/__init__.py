"""The OpenAI-compatible server over the engine (``attnplug serve``, docs/serving.md).

``engine_loop.py`` runs an :class:`~attnplug.runner.serve.engine.LLMEngine` in its own
thread, requests joining it as they arrive; ``protocol.py`` reads and checks the request
bodies; ``app.py`` is the FastAPI application (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``); ``metrics.py`` the
Prometheus collectors; ``text.py`` turns token ids into text with stop strings;
``byte_tokenizer.py`` gives the random-weight presets a tokenizer. Imported only by
``runner/commands/`` (docs/architecture.md).
"""
