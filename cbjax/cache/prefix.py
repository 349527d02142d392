"""Prefix caching on top of the page allocator: requests' page hash chains and hit counters (no jax)."""

from __future__ import annotations

from cbjax.cache.allocator import PageAllocator
from cbjax.cache.page_hash import ROOT_HASH, chain_hashes
from cbjax.core.request import Request

# A synthetic prompt's pages are keyed base + page index, with base the 64-bit hash of
# (seed, vocabulary, page size) moved to [2**64, 2**65) and shifted past any page index: each
# stream has its own run of keys, none a content hash (those lie in [-2**63, 2**63)), and
# consecutive pages get consecutive keys, which the prefix index's dict keeps in nearby slots.
_INDEX_BITS = 24
_MASK64 = (1 << 64) - 1


class PrefixCache:
    """Matches and registers requests' full pages in the allocator's prefix index.

    A page is identified by its chained hash, so only pages whose token ids are all known can
    be matched or registered: prompt pages always, pages of generated tokens only when the
    executor materializes tokens (the JAX engine; the simulator has no ids for them). A request
    with neither prompt ids nor a synthetic prompt to draw them from (a length-only request
    built by hand) has no known page: it shares nothing.
    """

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._chains: dict[Request, list[int]] = {}  # hashes of the request's known full pages
        self.prompt_tokens_admitted = 0  # over first admissions
        self.prompt_tokens_hit = 0  # of those, found in the cache
        self.tokens_hit = 0  # found in the cache at every admission, readmissions included
        # Name pages of synthetic prompts by their seed (see `_chain`). Off where the executor
        # reads token ids: a prompt built from another request's ids (a session's next turn)
        # must find that request's pages by content.
        self.synthetic_keys = True
        # The host tier (`cbjax.cache.host_tier.HostTier`) beneath the device pool, or None.
        self.tier = None

    def _chain(self, req: Request) -> list[int]:
        """Chained hashes of the request's full pages whose token ids are known (memoized).

        A page wholly inside a synthetic prompt is named by (seed, vocabulary, page index)
        rather than by hashing drawn ids (see `_INDEX_BITS`): seeded draws of one seed agree on
        their common prefix, so two such pages hold equal ids exactly when their keys are equal
        (up to the same 64-bit collision odds as content hashes), and a long simulated trace
        never draws its prompts. Later pages chain content hashes from the last synthetic key. Used only
        while `synthetic_keys` holds (set before the first request arrives).

        A session's turn that another follows (`more_turns`) generates, in the simulator, the
        continuation of its seeded stream: the next turn's prompt is that stream up to past
        this turn's output (`cbjax.engine.followups`). Its pages of generated tokens are then
        known too, and named by the same keys."""
        chain = self._chains.setdefault(req, [])
        synthetic = req.synthetic_prompt
        if req.prompt_token_ids is None and synthetic is None:
            return chain
        ps = self.page_size
        known = self._known(req)
        if (len(chain) + 1) * ps > known:
            return chain
        lo = len(chain)
        if synthetic is not None and self.synthetic_keys:
            seed, vocab = synthetic
            inside = (known if req.more_turns else req.prompt_len) // ps
            base = ((hash((seed, vocab, ps)) & _MASK64) | (1 << 64)) << _INDEX_BITS
            chain.extend(range(base + lo, base + inside))
            lo = max(lo, inside)
        hi = known // ps
        if hi > lo:
            ids = req.prompt_ids(keep=False)
            if hi * ps > req.prompt_len:
                ids = ids + req.output_token_ids
            chain.extend(chain_hashes(chain[-1] if chain else ROOT_HASH, ids[lo * ps : hi * ps], ps))
        return chain

    def match(self, req: Request) -> list[int]:
        """Cached pages holding the request's leading tokens, short of the page of its last
        token: that token is always prefilled, so the prefill yields the next one."""
        return self.allocator.match(self._chain(req)[: (req.num_tokens - 1) // self.page_size])

    def match_host(self, req: Request, num_device: int) -> list[int]:
        """Host pages of the tier continuing the request's `num_device` cached device pages
        (`match`), short of the page of its last token as `match` is."""
        return self.tier.match(self._chain(req)[: (req.num_tokens - 1) // self.page_size], num_device)

    def loaded(self, req: Request, device: list[int], hosts: list[int], table: list[int]) -> None:
        """`req`, just allocated `table` on its `device` pages, loads `hosts` (pinned) into the
        pages after them, which hold its chain's next pages from now on."""
        k, n = len(device), len(hosts)
        if n:
            self.tier.load(req, hosts, table[k : k + n])
            self.allocator.register(req.request_id, self._chain(req), k + n)
        self.tier.admitted(req, device, n)

    def prefetch(self, req: Request, room: int) -> int:
        """Start loading the waiting request's host pages into new cached device pages (at most
        `room`; all or none); how many. A page its chain has on the device ends the run."""
        device = self.match(req)
        hosts = self.match_host(req, len(device))
        if not hosts:
            return 0
        hashes = self._chain(req)[len(device) : len(device) + len(hosts)]
        on_device = next((i for i, h in enumerate(hashes) if self.allocator.match([h])), len(hashes))
        hosts, hashes = hosts[:on_device], hashes[:on_device]
        if not hosts or len(hosts) > room:
            return 0
        self.tier.pin(hosts)
        self.tier.load(req, hosts, self.allocator.cache_pages(hashes), prefetch=True)
        return len(hosts)

    def admitted(self, req: Request, num_hit: int) -> None:
        """Count an admission that reuses `num_hit` cached tokens. Call before it is scheduled."""
        self.tokens_hit += num_hit
        if req.scheduled_s is None:  # first admission
            self.prompt_tokens_admitted += req.prompt_len
            self.prompt_tokens_hit += num_hit

    def register(self, req: Request) -> None:
        """Register the request's computed full pages whose token ids are known. Called for every
        row of every step: it returns at once when no full page is both computed and known
        beyond those already offered (most decode steps; every step of a simulated decode, whose
        token ids are unknown), the loop's host time per row."""
        offered = self.allocator.num_hashed(req.request_id)
        full = req.num_computed // self.page_size
        if full <= offered or self._known(req) // self.page_size <= offered:
            return
        self.allocator.register(req.request_id, self._chain(req), full)
        if self.tier is not None:
            self.tier.tag(self.allocator.page_tables[req.request_id][offered:full], req.session_id)

    def _known(self, req: Request) -> int:
        """Leading tokens of the request whose ids are known (see `_chain`)."""
        if req.more_turns and self.synthetic_keys and req.synthetic_prompt is not None:
            return req.prompt_len + req.num_generated
        return req.prompt_len + len(req.output_token_ids)

    def learns_pages(self, req: Request) -> bool:
        """Whether the request's decode steps make the token ids of its new pages known, in the
        simulator: a session's turn that another follows (see `_known`), whose full pages then
        register as they fill."""
        return req.more_turns and self.synthetic_keys and req.synthetic_prompt is not None

    def forget(self, req: Request) -> None:
        self._chains.pop(req, None)
        if self.tier is not None:
            self.tier.turn_ended(req)

    def clear(self) -> None:
        self._chains.clear()
        if self.tier is not None:
            self.tier.clear_requests()

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found in the cache at requests' first admission over the prompt
        tokens of all admitted requests. A readmission after a preemption is left out, so a
        request re-finding its own pages does not count (it is in `tokens_hit`)."""
        admitted = self.prompt_tokens_admitted
        return self.prompt_tokens_hit / admitted if admitted else 0.0
