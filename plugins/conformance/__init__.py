"""The attnplug backend conformance suite (a pytest plugin plus its test module).

Run it against a backend with ``attnplug check NAME`` or
``pytest --pyargs attnplug.plugins.conformance --attnplug-backend NAME``; see
``docs/conformance.md``. Modules: ``cases`` (JSON-serializable workloads),
``requirements`` (declared capabilities -> skips), ``harness`` (runs a case through the
runner path), ``oracle`` (inputs and a dense reference), ``checks`` (the properties),
``snapshots`` (mutation detection), ``session`` (per-run caching), ``pytest_plugin``
(options, parametrization) and ``test_conformance`` (the tests).

This package imports nothing on import: the pytest plugin below it loads in every
pytest run of an environment that has attnplug installed.
"""
