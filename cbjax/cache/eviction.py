"""Which host page the host KV tier drops when it needs room: `cache.host_eviction` (no jax).

A policy is told of every page that enters the tier (`inserted`), is used again (`touched`:
an eviction from the device pool found it there, a request loads it back, or a load of the
plan being made pins it) and leaves (`removed`), and of every session whose next turn becomes
expected or stops being expected (`expected_changed`), and names the `victim` to drop. It
reads the tier through a read-only view (`cbjax.cache.host_tier.HostTierView`): each page's
session (set when the page enters and fixed until it leaves), whether a session's next turn is
expected, and whether a page may be dropped now: a page a load of the plan being made reads
may not (the tier touches a page as it pins it), and every page may again once the plan is
written. A user's policy is a `HostEviction` subclass named
"package.module:ClassName", built with the view as its one argument; the hooks it does not
override do nothing beyond keeping `self.pages`.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from typing import Optional

from cbjax.core.plugins import load_class


class HostEviction:
    """The interface, and the pages in use in least recently used order (`self.pages`), which
    every built-in policy keeps."""

    name = "base"

    def __init__(self, view):
        self.view = view
        self.pages: OrderedDict[int, None] = OrderedDict()

    def inserted(self, page: int) -> None:
        """`page` now holds a page the device pool evicted."""
        self.pages[page] = None

    def touched(self, page: int) -> None:
        """`page` was used again: found by a device eviction, loaded back, or pinned by a load."""
        self.pages.move_to_end(page)

    def removed(self, page: int) -> None:
        """`page` left the tier (dropped, or its pool went to swap preemption)."""
        del self.pages[page]

    def expected_changed(self, session_id: str) -> None:
        """`view.expected(session_id)` has just changed."""

    def victim(self) -> Optional[int]:
        """The page to drop: one in use that `view.droppable` allows; None if there is none."""
        raise NotImplementedError


class LruEviction(HostEviction):
    """The least recently used page goes first. Pinned pages were touched when pinned, so the
    walk meets them only after every page used before the plan being made."""

    name = "lru"

    def victim(self) -> Optional[int]:
        droppable = self.view.droppable
        return next((p for p in self.pages if droppable(p)), None)


class SessionEviction(HostEviction):
    """Pages of sessions whose next turn is expected (`Request.more_turns`, and the next turn
    neither admitted nor rejected yet) stay while any other page can go: the least recently
    used of the others goes first, then the least recently used of all (AttentionStore's
    scheduler-aware eviction).
    A page belongs to the session of the request that last registered, shared or loaded it
    before it entered the tier.

    The others (pages of no session, or of a session not expected) are kept in a min-heap by
    the time of their last use, so a victim costs no walk over the expected sessions' pages.
    An entry goes stale when its page is used again or leaves, or its session becomes
    expected, and is skipped when met; a session that stops being expected puts its pages back.
    """

    name = "session"

    def __init__(self, view):
        super().__init__(view)
        self._clock = 0
        self._used_at: dict[int, int] = {}  # page -> the clock at its last insert or touch
        self._session: dict[int, Optional[str]] = {}  # page -> its session
        self._pages_of: dict[str, set[int]] = {}  # session -> its pages
        self._others: list[tuple[int, int]] = []  # a min-heap of (used_at, page), stale entries among them
        self._aside: deque[tuple[int, int]] = deque()  # entries of the others met while not droppable

    def _held(self, session: Optional[str]) -> bool:
        return session is not None and self.view.expected(session)

    def _used(self, page: int) -> None:
        self._clock += 1
        self._used_at[page] = self._clock
        if not self._held(self._session[page]):
            heapq.heappush(self._others, (self._clock, page))
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heap without its stale entries once they outnumber the live pages."""
        if len(self._others) > 2 * len(self._used_at) + 64:
            held, session = self._held, self._session
            self._others = [(t, p) for p, t in self._used_at.items() if not held(session[p])]
            heapq.heapify(self._others)
            self._aside.clear()

    def inserted(self, page: int) -> None:
        super().inserted(page)
        session = self.view.session_of(page)
        self._session[page] = session
        if session is not None:
            self._pages_of.setdefault(session, set()).add(page)
        self._used(page)

    def touched(self, page: int) -> None:
        super().touched(page)
        self._used(page)

    def removed(self, page: int) -> None:
        super().removed(page)
        del self._used_at[page]
        session = self._session.pop(page)
        if session is not None:
            pages = self._pages_of[session]
            pages.discard(page)
            if not pages:
                del self._pages_of[session]

    def expected_changed(self, session_id: str) -> None:
        if self.view.expected(session_id):
            return  # its entries go stale
        used_at, others = self._used_at, self._others
        for page in self._pages_of.get(session_id, ()):
            heapq.heappush(others, (used_at[page], page))
        self._compact()

    def _restore(self) -> None:
        """Put the entries set aside as not droppable back in the heap once their plan is
        written. A page turns not droppable only when touched (a load pins it), so an entry
        set aside and not stale since is of a page still pinned by the plan being made, or
        of one whose plan is written; entries are set aside in order, so the oldest live one
        tells which."""
        aside, used_at = self._aside, self._used_at
        while aside and used_at.get(aside[0][1]) != aside[0][0]:
            aside.popleft()
        if aside and self.view.droppable(aside[0][1]):
            for entry in aside:
                heapq.heappush(self._others, entry)
            aside.clear()

    def victim(self) -> Optional[int]:
        self._restore()
        others, used_at, session, held = self._others, self._used_at, self._session, self._held
        droppable = self.view.droppable
        while others:
            t, page = others[0]
            if used_at.get(page) != t or held(session[page]):
                heapq.heappop(others)
            elif droppable(page):
                return page
            else:
                self._aside.append(heapq.heappop(others))
        return next((p for p in self.pages if droppable(p)), None)


HOST_EVICTIONS = {cls.name: cls for cls in (LruEviction, SessionEviction)}


def make_host_eviction(name: str, view) -> HostEviction:
    """The policy `cache.host_eviction` names, over `view`."""
    if name in HOST_EVICTIONS:
        return HOST_EVICTIONS[name](view)
    if ":" not in name:
        raise ValueError(f"cache.host_eviction: unknown value {name!r}; choose one of {', '.join(HOST_EVICTIONS)}")
    return load_class(name, HostEviction, "cache.host_eviction")(view)
