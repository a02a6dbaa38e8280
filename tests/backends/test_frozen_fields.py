"""``backends/common/frozen_fields.py``: the flash_attn metadata built without the frozen
dataclass ``__init__`` equals the ``__init__``-built one, field for field; and the live
layer registry's cached answers follow adds and drops. (The triton metadata is sealed:
``tests/backends/common/test_sealed_metadata.py``.)"""

import dataclasses
import gc

import pytest
import torch

from attnplug.backends.common.frozen_fields import field_names, new_frozen, replace_fields
from attnplug.backends.common.layer_params import LiveLayerParams
from attnplug.backends.flash_attn.metadata import FlashAttnMetadata


def _values(cls):
    """Distinct values, one per field (ints, tensors, None for the defaults' types)."""
    return tuple(torch.tensor([i]) if "Tensor" in str(f.type) and "None" not in str(f.type) else i
                 for i, f in enumerate(dataclasses.fields(cls)))


@pytest.mark.parametrize("cls", [FlashAttnMetadata])
def test_new_frozen_equals_the_dataclass_init(cls):
    vals = _values(cls)
    fast, slow = new_frozen(cls, *vals), cls(*vals)
    assert type(fast) is cls and fast.__dict__.keys() == slow.__dict__.keys()
    for name in field_names(cls):
        assert getattr(fast, name) is getattr(slow, name), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.num_reqs = 7  # still frozen
    with pytest.raises(TypeError, match="fields"):
        new_frozen(cls, *vals[:-1])


@pytest.mark.parametrize("cls", [FlashAttnMetadata])
def test_replace_fields_equals_dataclasses_replace(cls):
    md = cls(*_values(cls))
    a, b = replace_fields(md, num_reqs=99, slot_mapping="s"), dataclasses.replace(md, num_reqs=99, slot_mapping="s")
    assert a.__dict__ == b.__dict__ and md.num_reqs == 0 and a is not md
    with pytest.raises(TypeError, match="no field"):
        replace_fields(md, not_a_field=1)


class _Impl:
    num_kv_heads, head_size, scale = 2, 8, 0.5
    sliding_window = logits_soft_cap = kv_cache_dtype = None

    def __init__(self, heads):
        self.num_heads = heads


def test_live_layer_answers_follow_adds_and_drops():
    reg = LiveLayerParams()
    a = _Impl(4)
    reg.add(a)
    assert [p.num_heads for p in reg.matching(2, 8, None)] == [4]
    b = _Impl(6)
    reg.add(b)
    assert [p.num_heads for p in reg.matching(2, 8, None)] == [4, 6]
    del a
    gc.collect()
    assert [p.num_heads for p in reg.matching(2, 8, None)] == [6]
    assert reg.matching(2, 16, None) == []


@pytest.mark.parametrize("cls", [FlashAttnMetadata])
def test_the_generated_factory_equals_the_dataclass_init(cls):
    from attnplug.backends.common.frozen_fields import frozen_factory

    vals = _values(cls)
    fast, slow = frozen_factory(cls)(*vals), cls(*vals)
    assert type(fast) is cls and list(fast.__dict__) == list(slow.__dict__)
    for name in field_names(cls):
        assert getattr(fast, name) is getattr(slow, name), name
    with pytest.raises(TypeError):
        frozen_factory(cls)(*vals[:-1])


@pytest.mark.parametrize("cls", [FlashAttnMetadata])
def test_the_template_factory_and_the_replacer_equal_dataclasses_replace(cls):
    from attnplug.backends.common.frozen_fields import tables_replacer, template_factory

    md = cls(*_values(cls))
    names = ("num_actual_tokens", "max_seq_len", "causal")
    template = dict(md.__dict__)
    fast = template_factory(cls, *names)(template, 91, 92, False)
    slow = dataclasses.replace(md, num_actual_tokens=91, max_seq_len=92, causal=False)
    assert type(fast) is cls and list(fast.__dict__) == list(slow.__dict__)
    assert all(getattr(fast, n) is getattr(slow, n) for n in field_names(cls))
    assert template == md.__dict__ and md.num_actual_tokens == 1, "the template is not modified"
    swapped = tables_replacer(cls, "slot_mapping")(md, "s")
    assert swapped.__dict__ == dataclasses.replace(md, slot_mapping="s").__dict__ and swapped is not md
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.num_reqs = 7  # still frozen
    with pytest.raises(TypeError, match="no field"):
        template_factory(cls, "not_a_field")
    with pytest.raises(TypeError, match="no field"):
        tables_replacer(cls, "not_a_field")


def test_the_live_layer_version_changes_on_adds_and_drops():
    reg = LiveLayerParams()
    v0 = reg.version
    a = _Impl(4)
    reg.add(a)
    v1 = reg.version
    assert v1 != v0
    del a
    gc.collect()
    assert reg.version != v1, "a dropped impl changes the version (builders re-plan)"
