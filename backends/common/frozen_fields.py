"""Frozen metadata dataclasses built without their generated ``__init__``.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` and
``dataclasses.replace`` goes through ``fields()`` and ``__init__`` again: a few µs per
build for a dozen fields, paid by every group on every step. Plain frozen metadata
dataclasses (no ``__post_init__``, no ``__slots__``, no ``InitVar``: the flash_attn
builder's; the triton one is sealed instead, ``sealed.py``, which builds faster still)
are filled here through the instance ``__dict__``, which is what
``__init__`` ends up writing; the result compares equal to the ``__init__``-built one
(``tests/backends/test_frozen_fields.py``).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Callable, TypeVar

T = TypeVar("T")

_NAMES: dict[type, tuple[str, ...]] = {}


def field_names(cls: type) -> tuple[str, ...]:
    """The fields of dataclass ``cls``, in declaration order (cached per class)."""
    names = _NAMES.get(cls)
    if names is None:
        if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
            raise TypeError(f"{cls.__name__}: only plain dataclasses (no __post_init__, no __slots__)")
        names = _NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


def new_frozen(cls: type[T], *values) -> T:
    """``cls(*values)`` with every field given (defaults included), in declaration order.

    Raises:
        TypeError: not one value per field.
    """
    names = field_names(cls)
    if len(values) != len(names):
        raise TypeError(f"{cls.__name__} has {len(names)} fields, got {len(values)} values")
    obj = object.__new__(cls)
    obj.__dict__.update(zip(names, values))
    return obj


def frozen_factory(cls: type[T]) -> Callable[..., T]:
    """A function ``make(*values) -> cls`` equal to ``cls(*values)`` with every field given
    in declaration order, for the hot path: generated once per class (as ``dataclasses``
    generates ``__init__``), it builds the instance dict in one literal (about a third of
    :func:`new_frozen`'s cost)."""
    names = field_names(cls)
    args = ", ".join(f"v{i}" for i in range(len(names)))
    body = ", ".join(f"{n!r}: v{i}" for i, n in enumerate(names))
    src = f"def make({args}):\n    obj = _new(cls)\n    _set_dict(obj, {{{body}}})\n    return obj\n"
    ns: dict = {"_new": object.__new__, "_set_dict": _dict_setter(cls), "cls": cls}
    exec(src, ns)  # noqa: S102 -- generated from the dataclass's own field names
    make = ns["make"]
    make.__doc__ = f"{cls.__name__}({', '.join(names)}) without the frozen __init__."
    return make


def tables_replacer(cls: type[T], *names: str) -> Callable[..., T]:
    """A function ``replace(obj, *values) -> cls``: ``dataclasses.replace(obj, **dict(zip(names,
    values)))`` for instances of ``cls`` made by :func:`frozen_factory` or its ``__init__``,
    generated once (a copy of the instance dict with the named fields swapped; the hot
    path of ``update_block_table``).

    Raises:
        TypeError: a name that is not a field of ``cls`` (when generated).
    """
    replace = _dict_copier(cls, names, "obj.__dict__")
    replace.__doc__ = f"{cls.__name__}: replace({', '.join(names)}) without dataclasses.replace."
    return replace


def template_factory(cls: type[T], *names: str) -> Callable[..., T]:
    """A function ``make(template, *values) -> cls``: an instance whose fields are those of
    the dict ``template`` (an instance dict of ``cls``, every field in declaration order;
    not modified) with ``names`` set to ``values``; equal to ``cls(**{**template,
    **dict(zip(names, values))})``. Generated once: a dict copy and one store per name,
    for builds where most fields repeat the last step's (about half of
    :func:`frozen_factory`'s cost for a dozen fields).

    Raises:
        TypeError: a name that is not a field of ``cls`` (when generated).
    """
    make = _dict_copier(cls, names, "template")
    make.__doc__ = f"{cls.__name__} from a template instance dict with ({', '.join(names)}) set."
    return make


def _dict_copier(cls: type[T], names: tuple[str, ...], source: str) -> Callable[..., T]:
    """Generate ``f(src, *values) -> cls``: a new instance whose ``__dict__`` is a copy of
    ``source`` (an expression of ``src``: ``"obj.__dict__"`` or ``"template"``) with
    ``names`` set to ``values`` (one store each), past a frozen ``__setattr__``.

    Raises:
        TypeError: a name that is not a field of ``cls``.
    """
    fields_ = field_names(cls)
    for n in names:
        if n not in fields_:
            raise TypeError(f"{cls.__name__} has no field {n!r}")
    args = ", ".join(f"v{i}" for i in range(len(names)))
    stores = "".join(f"    d[{n!r}] = v{i}\n" for i, n in enumerate(names))
    param = source.split(".")[0]
    src = (f"def copy_with({param}, {args}):\n    d = {source}.copy()\n{stores}"
           "    new = _new(cls)\n    _set_dict(new, d)\n    return new\n")
    ns: dict = {"_new": object.__new__, "_set_dict": _dict_setter(cls), "cls": cls}
    exec(src, ns)  # noqa: S102 -- generated from the dataclass's own field names
    return ns["copy_with"]


def _dict_setter(cls: type) -> Callable[[object, dict], None]:
    """``obj.__dict__ = d`` for an instance of ``cls``, past a frozen ``__setattr__`` (the
    ``__dict__`` descriptor's ``__set__``: what ``object.__setattr__(obj, "__dict__", d)``
    ends up calling)."""
    for klass in cls.__mro__:
        descr = vars(klass).get("__dict__")
        if descr is not None and hasattr(descr, "__set__"):
            return descr.__set__
    raise TypeError(f"{cls.__name__} instances have no __dict__")


def replace_fields(obj: T, **changes) -> T:
    """``dataclasses.replace(obj, **changes)`` for a plain frozen dataclass instance.

    Raises:
        TypeError: a name that is not a field.
    """
    cls = type(obj)
    names = field_names(cls)
    for k in changes:
        if k not in names:
            raise TypeError(f"{cls.__name__} has no field {k!r}")
    new = object.__new__(cls)
    d = new.__dict__
    d.update(obj.__dict__)
    d.update(changes)
    return new
