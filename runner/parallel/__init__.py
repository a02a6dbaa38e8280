"""Tensor and pipeline parallel on ``torch.distributed``: one process per rank, launched by ``torchrun``.

The layer between ``runner/execute`` (one step on one model) and the commands: rank 0
runs the scheduler and broadcasts each ``SchedulerOutput`` (``channel.py``); every rank runs
its own ``ModelRunner`` (its own ``StepCompiler``, its own KV caches holding its heads and
layers only) on a model whose projections are sharded (``tp_layers.py``, ``sharding.py``,
``tp_model.py``) and whose layers are cut into stages (``pipeline.py``). Design and launch:
docs/distributed.md.
"""
