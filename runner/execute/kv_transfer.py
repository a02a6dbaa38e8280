"""The worker's side of a KV connector (``core/kv_connector.py``) around one step.

``ModelRunner.execute_model`` calls :func:`before_forward` with the step's
``SchedulerOutput`` (bind the metadata, ``start_load_kv``, then ``wait_for_layer_load``
for every layer in model order) and :func:`after_forward` when the step is done
(``save_kv_layer`` for every layer, ``wait_for_save``, ``get_finished``, clear). The layer
hooks run in layer order around the whole forward, not interleaved with it: a connector
that overlaps a layer's transfer with the next layer's compute would need the calls inside
the model (``runner/models/attention_op.py``), which none does yet.

A step that computes nothing still runs both (a connector may have loads to start or to
finish); in that case ``get_finished`` may block until one load ends, so an engine with
only loading requests does not spin.
"""

from __future__ import annotations

import time

from attnplug.core.kv_connector import KVConnectorBase, KVConnectorOutput


def attach_kv_connector(runner, connector: KVConnectorBase) -> None:
    """Give ``runner`` (a ``ModelRunner``) its worker-side connector and register its caches.

    Raises:
        ConfigError: the connector cannot serve the caches (its ``register_kv_caches``).
    """
    connector.register_kv_caches(runner.kv_caches)
    runner.kv_connector = connector
    runner.kv_connector_step_ns = []


def _layers(runner) -> list[str]:
    return [name for g in runner.kv_cache_config.groups for name in g.layer_names]


def before_forward(runner, scheduler_output) -> None:
    conn = runner.kv_connector
    t0 = time.perf_counter_ns()
    conn.bind_connector_metadata(getattr(scheduler_output, "kv_connector_metadata", None))
    conn.start_load_kv()
    for name in _layers(runner):
        conn.wait_for_layer_load(name)
    runner._kv_connector_ns = time.perf_counter_ns() - t0


def after_forward(runner, computed: bool) -> KVConnectorOutput:
    """Saves, then the loads that ended; ``computed``: the step ran a forward."""
    conn = runner.kv_connector
    t0 = time.perf_counter_ns()
    try:
        if computed:
            for name in _layers(runner):
                conn.save_kv_layer(name, runner.kv_caches[name])
        conn.wait_for_save()
        return conn.get_finished(block=not computed)
    finally:
        conn.clear_connector_metadata()
        runner.kv_connector_step_ns.append(runner._kv_connector_ns + time.perf_counter_ns() - t0)
