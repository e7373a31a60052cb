"""The paged KV cache: a pool of fixed-size pages, per-request page tables, and prefix reuse.

Prefix caching keys each full page of prompt tokens by a chained hash (the page's tokens and the hash of the
page before it), so equal hashes mean equal prefixes. Pages carry reference counts; a page nobody uses stays
cached and is evicted least-recently-freed first.

A page becomes findable only once a forward has written its K/V. Until then its hash is pending, claimed by the
request that will write it, and a request whose prompt needs a pending page waits (`waits_for_prefix`) rather than
compute the same K/V again: the n copies of one prompt, sent together, share its pages from their first step. They
do not map the pending pages at admission instead, because nothing guarantees the K/V are there when a copy reads
them: the writer's prefill may span several steps, or the writer may be preempted or aborted before its forward.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool):
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.page_hash: list[int | None] = [None] * num_pages
        self.cached_pages: dict[int, int] = {}  # hash -> page
        self.free_uncached: deque[int] = deque(range(num_pages))  # reused first
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.pending: dict[int, str] = {}  # hash -> id of the admitted request that will write that page
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- pool -------------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def pages_for(self, num_tokens: int) -> int:
        """The pages a sequence of num_tokens takes."""
        return -(-num_tokens // self.page_size)

    def holds(self, num_tokens: int) -> bool:
        """Whether the pool holds a sequence of num_tokens (one without pages, which caches nothing, holds any)."""
        return not self.num_pages or self.pages_for(num_tokens) <= self.num_pages

    def pages_needed(self, req: "Request", num_slots: int) -> int:
        return max(0, self.pages_for(num_slots) - len(req.page_table))

    def can_allocate(self, req: "Request", num_slots: int) -> bool:
        return self.pages_needed(req, num_slots) <= self.num_free_pages

    def allocate(self, req: "Request", num_slots: int) -> None:
        """Extend the request's page table to cover `num_slots` logical slots."""
        for _ in range(self.pages_needed(req, num_slots)):
            req.page_table.append(self._take_free_page())

    def free(self, req: "Request") -> None:
        self._drop_claims(req)
        # Freed back to front, so that a prefix's first pages are evicted last.
        for page in reversed(req.page_table):
            if page >= 0:
                self._release(page)
        req.page_table = []

    def keep_pages(self, req: "Request", kept, num_context_pages: int) -> None:
        """Page retention: of the request's first num_context_pages pages keep those at the indices `kept` and
        release the rest, which become holes (-1) in its page table; later pages keep their logical places."""
        keep = set(int(i) for i in kept)
        for index in range(num_context_pages):
            page = req.page_table[index]
            if index not in keep and page >= 0:
                self._release(page)
                req.page_table[index] = -1
                req.num_dropped_pages += 1
        req.retention_pending = False

    def _release(self, page: int) -> None:
        """One reference fewer; a page nobody holds any more is free (and stays findable if it is a prefix)."""
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            if self.page_hash[page] is None:
                self.free_uncached.append(page)
            else:
                self.free_cached[page] = None

    def _take_free_page(self) -> int:
        if self.free_uncached:
            page = self.free_uncached.popleft()
        else:
            page, _ = self.free_cached.popitem(last=False)
            del self.cached_pages[self.page_hash[page]]
            self.page_hash[page] = None
        self.ref_counts[page] = 1
        return page

    # ---- prefix reuse -----------------------------------------------------------------------------------
    def _prefix_hashes(self, req: "Request") -> list[int]:
        # Only pages inside the prompt's first P-1 tokens: the last prompt token is always recomputed, since
        # its hidden state predicts the first generated token of shifted models. The prompt never changes, so
        # the hashes are computed once per request.
        if req.prefix_hashes is None:
            tokens = req.tokens[: req.num_prompt_tokens - 1].tolist()
            # An adapter changes every K/V, so the chain's seed is the adapter: pages never cross adapters.
            hashes, prev = [], 0 if req.params.lora_name is None else hash(("lora", req.params.lora_name))
            for i in range(len(tokens) // self.page_size):
                prev = hash((prev, tuple(tokens[i * self.page_size:(i + 1) * self.page_size])))
                hashes.append(prev)
            req.prefix_hashes = hashes
        return req.prefix_hashes

    def allocate_prefix(self, req: "Request") -> int:
        """At admission: map the request's leading prompt pages to cached ones. Returns tokens hit."""
        if not self.enable_prefix_caching:
            return 0
        hashes = self._prefix_hashes(req)
        for h in hashes:
            page = self.cached_pages.get(h)
            if page is None:
                break
            if self.ref_counts[page] == 0:
                self.free_cached.pop(page)
            self.ref_counts[page] += 1
            req.page_table.append(page)
        return len(req.page_table) * self.page_size

    def waits_for_prefix(self, req: "Request") -> bool:
        """Whether a prompt page the request would compute is being written by a running request: it is then
        better admitted after that request's next forward, when the page is findable."""
        if not self.enable_prefix_caching or not self.pending:
            return False
        return any(h in self.pending and h not in self.cached_pages for h in self._prefix_hashes(req))

    def record_prefix_lookup(self, req: "Request") -> None:
        """At an admission that went ahead: count its lookup in the hit ratio, and claim the prompt pages it will
        write and no one has."""
        if self.enable_prefix_caching:
            hashes = self._prefix_hashes(req)
            self.prefix_queried_tokens += len(hashes) * self.page_size
            self.prefix_hit_tokens += req.num_prefix_hit
            for h in hashes[req.num_prefix_hit // self.page_size:]:
                if h not in self.cached_pages:
                    self.pending.setdefault(h, req.request_id)

    def _drop_claims(self, req: "Request") -> None:
        for h in req.prefix_hashes or ():
            if self.pending.get(h) == req.request_id:
                del self.pending[h]

    def register_prefix(self, req: "Request") -> None:
        """After a forward stored prompt pages: make their full pages findable by later requests."""
        if not self.enable_prefix_caching:
            return
        hashes = self._prefix_hashes(req)
        written = min(len(hashes), req.num_cached // self.page_size, len(req.page_table))
        if written <= req.num_registered_pages:
            return
        for i in range(written):
            page, h = req.page_table[i], hashes[i]
            if page >= 0 and self.page_hash[page] is None and h not in self.cached_pages:
                self.page_hash[page] = h
                self.cached_pages[h] = page
            if self.pending.get(h) == req.request_id:
                del self.pending[h]
        req.num_registered_pages = written
