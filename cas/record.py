"""Immutable records, made without the ``dataclasses`` module.

``@record`` is ``@dataclass(frozen=True, slots=True)`` for the subset the
project uses — fields with defaults or ``field(default_factory=…)``,
``field(compare=False, repr=False)``, no inheritance of fields, no ClassVars
— at a fraction of the start-up cost: importing ``dataclasses`` (and the
``inspect``, ``ast``, ``dis`` and ``tokenize`` it pulls in) and generating a
dozen classes cost a cold ``oncepatch`` process about 14 ms, a quarter of a
CLI replay (docs/BENCHMARKS.md).  Here only ``__init__`` is generated (one
``exec`` per class, so creating instances stays as fast as a dataclass's);
``__repr__``, ``__eq__``, ``__hash__`` and pickling are shared functions.
Mutable classes stay dataclasses.

``replace(obj, **changes)`` is ``dataclasses.replace``.  mypy understands
``@record`` through ``typing.dataclass_transform``.
"""

from __future__ import annotations

from collections.abc import Callable

TYPE_CHECKING = False  # typing is not imported at run time (start-up: docs/DECISIONS.md)
if TYPE_CHECKING:
    from typing import Any, TypeVar, dataclass_transform

__all__ = ["record", "field", "replace", "fields", "FrozenRecordError"]

if TYPE_CHECKING:
    _T = TypeVar("_T", bound=type)
    _R = TypeVar("_R")
else:
    def dataclass_transform(**_kw: object) -> Callable[[_F], _F]:
        return lambda f: f  # only type checkers read it

_MISSING: Any = object()


class FrozenRecordError(AttributeError):
    """An attempt to assign to or delete a field of a record."""


class _Field:
    __slots__ = ("name", "default", "default_factory", "compare", "repr")

    def __init__(self, default: Any, default_factory: Callable[[], Any] | None, compare: bool, repr: bool) -> None:
        self.name = ""
        self.default = default
        self.default_factory = default_factory
        self.compare = compare
        self.repr = repr


def field(*, default: Any = _MISSING, default_factory: Callable[[], Any] | None = None, compare: bool = True,
          repr: bool = True) -> Any:
    """A field's options, as ``dataclasses.field`` takes them."""
    if default is not _MISSING and default_factory is not None:
        raise ValueError("cannot specify both default and default_factory")
    return _Field(default, default_factory, compare, repr)


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    raise FrozenRecordError(f"cannot assign to field '{name}' of a {type(self).__name__} record")


def _frozen_delattr(self: Any, name: str) -> None:
    raise FrozenRecordError(f"cannot delete field '{name}' of a {type(self).__name__} record")


def _repr(self: Any) -> str:
    parts = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in self.__record_fields__ if f.repr)
    return f"{type(self).__qualname__}({parts})"


def _key(self: Any) -> tuple[Any, ...]:
    return tuple(getattr(self, f.name) for f in self.__record_fields__ if f.compare)


def _eq(self: Any, other: object) -> Any:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _key(self) == _key(other)


def _hash(self: Any) -> int:
    return hash(_key(self))


def _getstate(self: Any) -> tuple[Any, ...]:
    return tuple(getattr(self, f.name) for f in self.__record_fields__)


def _setstate(self: Any, state: tuple[Any, ...]) -> None:
    for f, value in zip(self.__record_fields__, state):
        object.__setattr__(self, f.name, value)


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def record(cls: _T) -> _T:
    """Make ``cls`` a frozen, slotted record of its annotated fields (module docstring)."""
    if any(hasattr(base, "__record_fields__") for base in cls.__mro__[1:]):
        raise TypeError(f"{cls.__name__}: records do not inherit fields")
    specs: list[_Field] = []
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        if str(annotation).startswith(("ClassVar", "typing.ClassVar")):
            raise TypeError(f"{cls.__name__}.{name}: ClassVar is not supported in a record")
        value = cls.__dict__.get(name, _MISSING)
        spec = value if isinstance(value, _Field) else _Field(value, None, True, True)
        spec.name = name
        specs.append(spec)
    seen_default = False
    params, body = ["self"], []
    env: dict[str, Any] = {"_set": object.__setattr__, "_MISSING": _MISSING}
    for spec in specs:
        n = spec.name
        if spec.default_factory is not None:
            env[f"_factory_{n}"] = spec.default_factory
            params.append(f"{n}=_MISSING")
            body.append(f" _set(self, {n!r}, _factory_{n}() if {n} is _MISSING else {n})")
            seen_default = True
            continue
        if spec.default is not _MISSING:
            env[f"_default_{n}"] = spec.default
            params.append(f"{n}=_default_{n}")
            seen_default = True
        elif seen_default:
            raise TypeError(f"{cls.__name__}: non-default field '{n}' follows a field with a default")
        else:
            params.append(n)
        body.append(f" _set(self, {n!r}, {n})")
    source = f"def __init__({', '.join(params)}):\n" + ("\n".join(body) or " pass") + "\n"
    exec(source, env)  # noqa: S102 - generated from the class's own field names, as dataclasses does
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"

    ns = {k: v for k, v in cls.__dict__.items()
          if k not in ("__dict__", "__weakref__") and k not in {s.name for s in specs}}
    ns.update(
        __slots__=tuple(s.name for s in specs),
        __record_fields__=tuple(specs),
        __init__=init,
        __repr__=_repr,
        __eq__=_eq,
        __hash__=_hash,
        __setattr__=_frozen_setattr,
        __delattr__=_frozen_delattr,
        __getstate__=_getstate,
        __setstate__=_setstate,
        __match_args__=tuple(s.name for s in specs),
    )
    new = type(cls)(cls.__name__, cls.__bases__, ns)
    new.__qualname__ = cls.__qualname__
    return new


def fields(obj: Any) -> tuple[str, ...]:
    """The field names of a record (class or instance), in order."""
    return tuple(f.name for f in obj.__record_fields__)


def replace(obj: _R, **changes: Any) -> _R:
    """A copy of ``obj`` with ``changes`` (``dataclasses.replace`` for records)."""
    kwargs = {f.name: getattr(obj, f.name) for f in obj.__record_fields__}  # type: ignore[attr-defined]
    unknown = set(changes) - set(kwargs)
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field(s) {sorted(unknown)}")
    kwargs.update(changes)
    return type(obj)(**kwargs)

