"""Which host page the host KV tier drops when it needs room: `cache.host_eviction` (no jax).

A policy is told of every page that enters the tier (`inserted`), is used again (`touched`:
an eviction from the device pool found it there, or a request loads it back) and leaves
(`removed`), and names the `victim` to drop. It reads the tier through a read-only view
(`cbjax.cache.host_tier.HostTierView`): each page's session, whether a session's next turn is
expected, and whether a page may be dropped now (a page a load of the plan being made reads
may not). A user's policy is a `HostEviction` subclass named "package.module:ClassName",
built with the view as its one argument.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from cbjax.core.plugins import load_class


class HostEviction:
    """The interface, and the pages in use in least recently used order (`self.pages`), which
    every built-in policy keeps: `victim` walks them oldest first."""

    name = "base"

    def __init__(self, view):
        self.view = view
        self.pages: OrderedDict[int, None] = OrderedDict()

    def inserted(self, page: int) -> None:
        """`page` now holds a page the device pool evicted."""
        self.pages[page] = None

    def touched(self, page: int) -> None:
        """`page` was used again: found by a device eviction, or loaded back."""
        self.pages.move_to_end(page)

    def removed(self, page: int) -> None:
        """`page` left the tier (dropped, or its pool went to swap preemption)."""
        del self.pages[page]

    def victim(self) -> Optional[int]:
        """The page to drop: one in use that `view.droppable` allows; None if there is none."""
        raise NotImplementedError


class LruEviction(HostEviction):
    """The least recently used page goes first."""

    name = "lru"

    def victim(self) -> Optional[int]:
        droppable = self.view.droppable
        return next((p for p in self.pages if droppable(p)), None)


class SessionEviction(HostEviction):
    """Pages of sessions whose next turn is expected (`Request.more_turns`, and the next turn
    not yet admitted) stay while any other page can go: the least recently used of the others
    goes first, then the least recently used of all (AttentionStore's scheduler-aware eviction).
    A page belongs to the session of the request that last registered, shared or loaded it."""

    name = "session"

    def victim(self) -> Optional[int]:
        view = self.view
        droppable, expected, session_of = view.droppable, view.expected, view.session_of
        fallback = None
        for page in self.pages:
            if not droppable(page):
                continue
            session = session_of(page)
            if session is None or not expected(session):
                return page
            if fallback is None:
                fallback = page
        return fallback


HOST_EVICTIONS = {cls.name: cls for cls in (LruEviction, SessionEviction)}


def make_host_eviction(name: str, view) -> HostEviction:
    """The policy `cache.host_eviction` names, over `view`."""
    if name in HOST_EVICTIONS:
        return HOST_EVICTIONS[name](view)
    if ":" not in name:
        raise ValueError(f"cache.host_eviction: unknown value {name!r}; choose one of {', '.join(HOST_EVICTIONS)}")
    return load_class(name, HostEviction, "cache.host_eviction")(view)
