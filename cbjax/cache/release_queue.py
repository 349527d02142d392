"""The prefix cache's evictable pages in the order they were released (no jax): a queue that
also lets a page out of its middle, each operation O(1) per page."""

from __future__ import annotations


class ReleaseQueue:
    """Pages, least recently released first: the entries of `entries` from `head` on whose
    page's `at` is their position (`base` + index). A page is queued exactly when its `at` is
    at least the head's position: a page popped from the front keeps its old, smaller one, so
    popping writes nothing per page, and one taken out of the middle (`remove`) gets -1 and
    leaves a dead entry behind, which `pop_front` skips; `dead` counts those from the head on.
    Spent entries before the head are dropped now and then, `base` counting them, so
    positions stay valid; so are dead entries once they outnumber the live ones, so the list
    stays within about twice the queue however many pages pass through it.

    `PageAllocator.free` appends a table's pages in its own loop, as `push` does (an entry,
    its position, then `count`): it is the cache's hottest path."""

    def __init__(self, num_pages: int):
        self.entries: list[int] = []
        self.at: list[int] = [-1] * num_pages
        self.head = self.base = self.dead = self.count = 0

    def __len__(self) -> int:
        return self.count

    def __contains__(self, page: int) -> bool:
        return self.at[page] >= self.base + self.head

    def push(self, page: int) -> None:
        """Queue `page` (not queued) at the back: the most recently released."""
        self.at[page] = self.base + len(self.entries)
        self.entries.append(page)
        self.count += 1

    def remove(self, page: int) -> None:
        """Take the queued `page` out, wherever it is."""
        self.at[page] = -1
        self.count -= 1
        self.dead += 1
        if self.dead > 4096 and self.dead > self.count:
            self._drop_dead()

    def _drop_dead(self) -> None:
        """Rewrite the queue as its live entries, at positions past every earlier one (so a
        page popped before keeps a position below the head's)."""
        live = self.pages()
        self.base += len(self.entries)
        self.entries[:] = live
        for i, page in enumerate(live, self.base):
            self.at[page] = i
        self.head = self.dead = 0

    def pop_front(self, n: int) -> list[int]:
        """Take out the `n` least recently released pages (at most `count`), in that order."""
        entries, at, head = self.entries, self.at, self.head
        if not self.dead:  # every entry from the head on is live
            pages = entries[head : head + n]
            head += n
        else:
            pages, base = [], self.base
            while len(pages) < n:
                page = entries[head]
                if at[page] == base + head:
                    pages.append(page)
                else:
                    self.dead -= 1
                head += 1
        self.count -= n
        if head > 4096 and 2 * head > len(entries):  # drop the spent entries
            del entries[:head]
            self.base += head
            head = 0
        self.head = head
        return pages

    def pages(self) -> list[int]:
        """The queued pages, least recently released first."""
        start = self.base + self.head
        return [p for i, p in enumerate(self.entries[self.head :], start) if self.at[p] == i]

    def check(self) -> None:
        """Raise AssertionError unless every queued page has one live entry from the head on,
        and `count` and `dead` count what they say."""
        queued = [p for p in range(len(self.at)) if p in self]
        for p in queued:
            i = self.at[p] - self.base
            assert self.head <= i < len(self.entries) and self.entries[i] == p, f"page {p}: its queue entry is not where it points"
        assert len(queued) == self.count, "the queued count differs from the queued pages"
        assert len(self.entries) - self.head - self.count == self.dead, "the dead entries are miscounted"
