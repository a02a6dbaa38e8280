"""``backends/common/sealed.py``: the triton metadata (a sealed slots dataclass) refuses
writes like a frozen dataclass, and the builders' generated factory and replacer give the
same objects as its ``__init__`` and ``dataclasses.replace``."""

import copy
import dataclasses
import pickle

import pytest
import torch

from attnplug.backends.common.sealed import sealed, sealed_factory, sealed_replacer
from attnplug.backends.triton.metadata import TritonAttentionMetadata

T = TritonAttentionMetadata


def _values():
    """Distinct values, one per field (tensors for the tensor fields)."""
    return tuple(torch.tensor([i]) if "Tensor" in str(f.type) and "None" not in str(f.type) else i
                 for i, f in enumerate(dataclasses.fields(T)))


def _same(a, b):
    return type(a) is type(b) and all(getattr(a, n) is getattr(b, n) for n in T._sealed_fields)


def test_writes_and_deletes_are_refused():
    md = sealed_factory(T)(*_values())
    for obj in (md, T(*_values())):
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.num_reqs = 7
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.not_a_field = 7
        with pytest.raises(dataclasses.FrozenInstanceError):
            del obj.seq_lens
        assert obj.num_reqs == 0 and not hasattr(obj, "__dict__")


def test_the_factory_and_the_replacer_equal_init_and_dataclasses_replace():
    vals = _values()
    md = T(*vals)
    assert _same(sealed_factory(T)(*vals), md) and sealed_factory(T)(*vals) == md
    fast = sealed_replacer(T, "num_actual_tokens", "max_seq_len", "causal")(md, 91, 92, False)
    slow = dataclasses.replace(md, num_actual_tokens=91, max_seq_len=92, causal=False)
    assert _same(fast, slow) and md.num_actual_tokens == 1, "the source is not modified"
    assert _same(T(*vals[:11]), dataclasses.replace(md, graph=False, cascade=None))  # the defaults
    with pytest.raises(TypeError):
        sealed_factory(T)(*vals[:-1])
    with pytest.raises(TypeError, match="no field"):
        sealed_replacer(T, "not_a_field")


def test_copies_pickles_hashes_and_repr_as_a_frozen_dataclass():
    vals = tuple(v if not isinstance(v, torch.Tensor) else v.item() for v in _values())  # hashable values
    md = T(*vals)
    for other in (copy.copy(md), copy.deepcopy(md), pickle.loads(pickle.dumps(md))):
        assert type(other) is T and other == md and other is not md and hash(other) == hash(md)
    assert repr(md).startswith("TritonAttentionMetadata(num_reqs=0, ") and dataclasses.is_dataclass(md)
    assert isinstance(md, T) and not isinstance(object.__new__(T.__mro__[1]), T)


def test_only_slots_dataclasses_can_be_sealed():
    @dataclasses.dataclass
    class Plain:
        a: int

    @dataclasses.dataclass(slots=True)
    class Factory:
        a: list = dataclasses.field(default_factory=list)

    for cls in (Plain, Factory):
        with pytest.raises(TypeError):
            sealed(cls)
    with pytest.raises(TypeError, match="not a @sealed"):
        sealed_factory(Plain)
