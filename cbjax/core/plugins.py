"""Plug-in classes named in a config as "package.module:ClassName", built with their `*_args`
(no cbjax imports)."""

from __future__ import annotations

import collections.abc
import importlib
import inspect
import types
import typing
from typing import Any, Optional


def load_class(path: str, base: type, key: str) -> type:
    """The subclass of `base` that `path` names; errors name the config `key`."""
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"{key}: cannot import module {module_name!r} ({err}); "
            "is its directory on PYTHONPATH or the working directory?"
        ) from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ValueError(f"{key}: {path!r} is not a subclass of {base.__module__.rsplit('.', 1)[0]}.{base.__name__}")
    return obj


def build_plugin(cls: type, args: Optional[dict[str, Any]], key: str, *leading: Any) -> Any:
    """`cls(*leading, **args)` once `check_args` accepts the arguments."""
    args = dict(args or {})
    check_args(cls, args, key, *leading)
    return cls(*leading, **args)


def check_args(cls: type, args: dict[str, Any], key: str, *leading: Any) -> None:
    """Raise ValueError naming the config `key` (e.g. cluster.router_args) when `cls`'s
    constructor does not take `args` after the positional `leading`, or when an argument's
    value does not match its parameter's annotation. Annotations this cannot judge (a class
    of the plug-in's own, a name it cannot resolve) are not checked."""
    signature = inspect.signature(cls)
    try:
        signature.bind(*leading, **args)
    except TypeError as err:
        raise ValueError(f"{key}: {cls.__name__} does not accept {args}: {err}") from None
    namespace = getattr(cls.__init__, "__globals__", {})
    for name, value in args.items():
        param = signature.parameters.get(name)
        if param is None or param.kind is param.VAR_KEYWORD:
            continue
        hint = _resolve(param.annotation, namespace)
        if hint is not None and _matches(value, hint) is False:
            raise ValueError(f"{key}.{name}: {cls.__name__} expects {_type_name(hint)}, got {value!r}")


def _resolve(annotation: Any, namespace: dict[str, Any]) -> Any:
    """The annotation as a type (a string one evaluated in the class's module), or None."""
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):
        try:
            return eval(annotation, {**vars(typing), **namespace})  # as typing.get_type_hints would
        except Exception:
            return None
    return annotation


def _matches(value: Any, hint: Any) -> Optional[bool]:
    """Whether `value` (as a config gives it) fits `hint`; None where this cannot tell."""
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        verdicts = [_matches(value, h) for h in typing.get_args(hint)]
        return True if True in verdicts else (None if None in verdicts else False)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    container = origin or hint
    if container in (list, tuple, set, frozenset, collections.abc.Sequence):
        return isinstance(value, (list, tuple))  # a config holds lists, never tuples or sets
    if container in (dict, collections.abc.Mapping):
        return isinstance(value, dict)
    return None


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
