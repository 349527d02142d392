"""Plug-in classes named in a config as "package.module:ClassName" (no cbjax imports)."""

from __future__ import annotations

import importlib


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
