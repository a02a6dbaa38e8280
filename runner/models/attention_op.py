"""The attention and Mamba mixer calls as ``torch.library`` custom ops, for ``torch.compile``.

Eagerly, a layer calls its backend's impl directly (:func:`attend`, :func:`mix`): nothing
here runs and nothing costs more than before. While ``torch.compile`` traces, the same
helpers emit one opaque op per layer instead, so Dynamo never traces a backend's Python
(host ints, kernel launches, metadata objects) and any plugin backend compiles with
``fullgraph=True`` without knowing about it:

* ``attnplug::attention(query, key, value, kv_cache!, output!, layer_name) -> ()``
* ``attnplug::mamba_mixer(hidden_states_B_C, dt, conv_state!, ssm_state!, output!, layer_name) -> ()``
* ``attnplug::gdn_mixer(mixed_qkv, a, b, conv_state!, recurrent_state!, output!, layer_name) -> ()``

(``!``: declared in ``mutates_args``; the fake implementations return nothing, so
tracing needs no kernel.) Metadata objects are not tensors and cannot be op arguments, so
at run time each op finds the calling layer and this step's metadata in a per-forward
context keyed by layer name (:func:`forward_context`), which the caller sets around the
compiled call; :class:`CompiledModel` does both. See docs/writing-a-backend.md
("torch.compile") and the ``torch.library.custom_op`` documentation (upstream).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from attnplug.core.errors import MetadataError
from attnplug.core.gdn import GDNStateCache
from attnplug.core.mamba import MambaStateCache
from attnplug.runner.models.kv_scales import calibrate_once


@dataclass(frozen=True)
class ForwardContext:
    """What the ops need during one model forward that cannot be an op argument.

    Attributes:
        layers: ``{layer_name: layer module}``; each module has ``impl`` (its backend's
            ``AttentionImpl`` or ``MambaImpl``), read at call time.
        attn_metadata: ``{layer_name: backend metadata}`` for this step.
    """

    layers: Mapping[str, Any]
    attn_metadata: Mapping[str, Any]


_CONTEXT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("attnplug_forward", default=None)


def backend_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{layer_name: module}`` of every submodule of ``model`` that holds a backend impl.

    A module counts when it has a ``str`` attribute ``layer_name`` and an ``impl`` with a
    ``forward`` method (the attention layers of every family and the Mamba2 mixers).

    Raises:
        ValueError: two such modules share a layer name.
    """
    out: dict[str, torch.nn.Module] = {}
    for module in model.modules():
        name = getattr(module, "layer_name", None)
        if isinstance(name, str) and callable(getattr(getattr(module, "impl", None), "forward", None)):
            if name in out:
                raise ValueError(f"two modules of the model are named attention layer {name!r}")
            out[name] = module
    return out


@contextlib.contextmanager
def forward_context(layers: Mapping[str, Any], attn_metadata: Mapping[str, Any]) -> Iterator[ForwardContext]:
    """Make ``layers`` and this step's ``attn_metadata`` visible to the ops (nests; per thread).

    Args:
        layers: ``{layer_name: layer module}``, e.g. :func:`backend_layers` of the model.
        attn_metadata: ``{layer_name: backend metadata}``, what the model's ``forward`` takes.
    """
    token = _CONTEXT.set(ForwardContext(layers, attn_metadata))
    try:
        yield _CONTEXT.get()
    finally:
        _CONTEXT.reset(token)


def _layer_and_metadata(layer_name: str) -> tuple[Any, Any]:
    """The calling layer and its metadata from the current context.

    Raises:
        MetadataError: no context is set, or it lacks ``layer_name``.
    """
    ctx = _CONTEXT.get()
    if ctx is None:
        raise MetadataError(
            f"attention layer {layer_name!r} ran a compiled attnplug op outside a forward context: call the "
            f"compiled model through attnplug.runner.models.attention_op.CompiledModel, or inside "
            f"forward_context(backend_layers(model), attn_metadata).")
    for what, mapping in (("the forward context's layers", ctx.layers), ("attn_metadata", ctx.attn_metadata)):
        if layer_name not in mapping:
            raise MetadataError(
                f"{what} has no entry for attention layer {layer_name!r} (it has {len(mapping)} entries): "
                f"pass one per layer, keyed by the names in model.layer_names.")
    return ctx.layers[layer_name], ctx.attn_metadata[layer_name]


@torch.library.custom_op("attnplug::attention", mutates_args=("kv_cache", "output"))
def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 output: torch.Tensor, layer_name: str) -> None:
    """``layer.impl.forward(layer, query, key, value, kv_cache, metadata, output)`` for the
    context's layer ``layer_name`` (shapes as ``AttentionImpl.forward``, core/contracts.py).

    Writes this step's K/V into ``kv_cache`` and attention into ``output`` (in place).

    Raises:
        MetadataError: no forward context, or it lacks the layer; whatever the impl raises.
    """
    layer, meta = _layer_and_metadata(layer_name)
    calibrate_once(layer, key, value)  # fp8 caches whose scales come from the first batch (kv_scales.py)
    layer.impl.forward(layer, query, key, value, kv_cache, meta, output)


@attention_op.register_fake
def _attention_fake(query, key, value, kv_cache, output, layer_name) -> None:
    return None


@torch.library.custom_op("attnplug::mamba_mixer", mutates_args=("conv_state", "ssm_state", "output"))
def mamba_mixer_op(hidden_states_B_C: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor,
                   ssm_state: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """``layer.impl.forward(layer, hidden_states_B_C, dt, MambaStateCache(conv_state,
    ssm_state), metadata, output)`` for the context's layer ``layer_name`` (shapes as
    ``MambaImpl.forward``, core/mamba.py): this step's slots of both states and ``output``
    are written in place.

    Raises:
        MetadataError: no forward context, or it lacks the layer; whatever the impl raises.
    """
    layer, meta = _layer_and_metadata(layer_name)
    layer.impl.forward(layer, hidden_states_B_C, dt, MambaStateCache(conv_state, ssm_state), meta, output)


@mamba_mixer_op.register_fake
def _mamba_mixer_fake(hidden_states_B_C, dt, conv_state, ssm_state, output, layer_name) -> None:
    return None


@torch.library.custom_op("attnplug::gdn_mixer", mutates_args=("conv_state", "recurrent_state", "output"))
def gdn_mixer_op(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_state: torch.Tensor,
                 recurrent_state: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """``layer.impl.forward(layer, mixed_qkv, a, b, GDNStateCache(conv_state, recurrent_state),
    metadata, output)`` for the context's layer ``layer_name`` (shapes as ``GDNImpl.forward``,
    core/gdn.py): this step's slots of both states and ``output`` are written in place.

    Raises:
        MetadataError: no forward context, or it lacks the layer; whatever the impl raises.
    """
    layer, meta = _layer_and_metadata(layer_name)
    layer.impl.forward(layer, mixed_qkv, a, b, GDNStateCache(conv_state, recurrent_state), meta, output)


@gdn_mixer_op.register_fake
def _gdn_mixer_fake(mixed_qkv, a, b, conv_state, recurrent_state, output, layer_name) -> None:
    return None


def attend(layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
           attn_metadata: Any, output: torch.Tensor) -> None:
    """Run ``layer.impl`` on one attention layer's step; ``output`` is written in place.

    Eager: ``layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata, output)``.
    While ``torch.compile`` traces: ``attnplug::attention`` (``attn_metadata`` is then
    ignored; the op reads the forward context). ``layer`` needs ``impl`` and ``layer_name``.
    """
    if torch.compiler.is_compiling():
        attention_op(query, key, value, kv_cache, output, layer.layer_name)
    else:
        calibrate_once(layer, key, value)  # fp8 caches whose scales come from the first batch (kv_scales.py)
        layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata, output)


def mix(layer: Any, hidden_states_B_C: torch.Tensor, dt: torch.Tensor, state: MambaStateCache,
        attn_metadata: Any, output: torch.Tensor) -> None:
    """Run ``layer.impl`` on one Mamba2 layer's step (as :func:`attend`, through
    ``attnplug::mamba_mixer`` while compiling); ``state`` and ``output`` are written in place."""
    if torch.compiler.is_compiling():
        mamba_mixer_op(hidden_states_B_C, dt, state.conv_state, state.ssm_state, output, layer.layer_name)
    else:
        layer.impl.forward(layer, hidden_states_B_C, dt, state, attn_metadata, output)


def mix_gdn(layer: Any, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, state: GDNStateCache,
            attn_metadata: Any, output: torch.Tensor) -> None:
    """Run ``layer.impl`` on one GDN layer's step (as :func:`attend`, through
    ``attnplug::gdn_mixer`` while compiling); ``state`` and ``output`` are written in place."""
    if torch.compiler.is_compiling():
        gdn_mixer_op(mixed_qkv, a, b, state.conv_state, state.recurrent_state, output, layer.layer_name)
    else:
        layer.impl.forward(layer, mixed_qkv, a, b, state, attn_metadata, output)


class CompiledModel:
    """A model compiled with ``torch.compile``, called like the model itself.

    ``CompiledModel(model, **compile_kwargs)(input_ids, positions, attn_metadata,
    kv_caches)`` marks dim 0 (tokens) of ``input_ids`` and ``positions`` dynamic, sets the
    :func:`forward_context` and runs the compiled forward. Every other attribute
    (``compute_logits``, ``layer_names``, ``kv_cache_specs``...) is the model's, so a
    ``ModelRunner`` can take it in place of the model.

    Args:
        model: an attnplug model (``forward(input_ids, positions, attn_metadata, kv_caches)``).
        compile_kwargs: passed to ``torch.compile``; ``fullgraph`` defaults to ``True``.

    Raises:
        ValueError: two modules of ``model`` share a layer name.
    """

    def __init__(self, model: torch.nn.Module, **compile_kwargs: Any):
        self.model = model
        self.layers = backend_layers(model)
        compile_kwargs.setdefault("fullgraph", True)
        self.compiled = torch.compile(model, **compile_kwargs)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Mapping[str, Any],
                 kv_caches: Mapping[str, Any]) -> torch.Tensor:
        """The model's forward, compiled (same arguments and result).

        Raises:
            MetadataError: ``kv_caches`` or ``attn_metadata`` lacks a layer (checked here
                and in the op, so that it is not raised while Dynamo traces, which would
                wrap it); whatever the impls raise.
        """
        for name in self.layers:
            if name not in kv_caches:
                raise MetadataError(
                    f"kv_caches has no entry for attention layer {name!r} (it has {len(kv_caches)} entries): "
                    f"pass one per layer, keyed by the names in model.layer_names.")
        torch._dynamo.maybe_mark_dynamic(input_ids, 0)
        torch._dynamo.maybe_mark_dynamic(positions, 0)
        with forward_context(self.layers, attn_metadata):
            return self.compiled(input_ids, positions, attn_metadata, kv_caches)

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not yet set (unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.model, name)
