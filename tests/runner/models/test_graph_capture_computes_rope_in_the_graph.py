"""The per-step cos/sin cache (``Attention.cos_sin``) is not hit by a CUDA-graph capture.

A graph step runs the forward eagerly (the warm-up), then again under capture with the same
``positions`` tensor object (``runner/execute/cudagraph_capture.py``). Had the capture hit
the warm-up's entry, cos/sin would not be computed inside the graph and every replay would
rope with the capture step's positions (the first H200 run, session 18: graph decodes
diverged from eager ones). Here the capture is simulated on the CPU by patching
``stream_capturing``; tests/gpu/test_flash_runner_cudagraph.py checks the real thing."""

from __future__ import annotations

import torch

from attnplug.runner.models import layers
from attnplug.runner.models.presets import make_preset_model


def test_a_capture_recomputes_cos_sin_and_its_layers_share_it(monkeypatch):
    attn = [m for m in make_preset_model("tiny-llama").modules() if isinstance(m, layers.Attention)]
    calls = []
    rope = attn[0].rope
    real = type(rope).cos_sin
    monkeypatch.setattr(type(rope), "cos_sin", lambda self, p, dt: calls.append(p) or real(self, p, dt))
    positions = torch.arange(5)

    eager = [a.cos_sin(positions, torch.float32) for a in attn]  # the warm-up: one computation
    assert len(calls) == 1 and all(c is eager[0] for c in eager)

    monkeypatch.setattr(layers, "stream_capturing", lambda p: True)
    captured = [a.cos_sin(positions, torch.float32) for a in attn]  # the capture: its own one
    assert len(calls) == 2, "the capture reused the warm-up's cos/sin: replays would keep its positions"
    assert captured[0] is not eager[0] and all(c is captured[0] for c in captured)
    assert torch.equal(captured[0][0], eager[0][0]) and torch.equal(captured[0][1], eager[0][1])
