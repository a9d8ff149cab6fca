"""SuffixDecoding's cache (its reference: ``arctic_inference/suffix_decoding/cache.py``,
``SuffixDecodingCache``), with no torch and no model: a *global* suffix tree over the responses
of earlier (and running) generations, evicted first in first out past ``max_cached_requests``,
and a *local* tree per running generation over its prompt and its tokens so far. A draft is the
better scored of the two trees' drafts (the local one on a tie).

hasten adds a bound in tokens (``max_cached_tokens``: responses are evicted, oldest first, while
the global tree holds more), a lock (one pool serves every thread), counters for ``/metrics``,
and a file: the cached responses in order, replayed into a fresh tree on load.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..core.pool import Pool, PoolStats, check_saved
from .suffix_tree import SuffixDraft, SuffixTree


@dataclass
class SuffixGeneration:
    """One generation's place in the pool."""

    key: int
    local: SuffixTree  # its prompt and its tokens since
    fed: int  # tokens of its sequence fed to the trees so far
    cached: bool  # its response is (still) in the global tree


class SuffixPool(Pool):
    kind = "suffix"

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_cached_tokens: int = 1 << 20):
        super().__init__()
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests  # 0: no global tree (the reference's switch)
        self.max_cached_tokens = max_cached_tokens
        self.global_tree = SuffixTree(max_tree_depth)
        self.responses: OrderedDict[int, int] = OrderedDict()  # seq id -> tokens, oldest first
        self.cached_tokens = 0
        self.active: dict[int, SuffixGeneration] = {}
        self.finished = 0
        self._next_key = 0

    # ---- generations (the reference's start_request, add_active_response, stop_request) -------
    def start(self, prompt: list[int], fed: int) -> SuffixGeneration:
        """A generation begins: its prompt into a local tree of its own, and a new response slot
        in the global tree (evicting the oldest past the bounds). ``fed``: tokens of its
        sequence already accounted for (the prompt, for a causal LM)."""
        with self.lock:
            key = self._next_key
            self._next_key += 1
            local = SuffixTree(self.max_tree_depth)
            local.extend(0, prompt)
            request = self.active[key] = SuffixGeneration(key, local, fed, self.max_cached_requests != 0)
            if request.cached:
                self.responses[key] = 0
                self._evict(keep=key)
            return request

    def extend(self, request: SuffixGeneration, tokens: list[int]) -> None:
        """The generation's sequence is now ``tokens``: the new ones go to its local tree and,
        while its response is cached, to the global tree."""
        with self.lock:
            new = tokens[request.fed :]
            if not new:
                return
            request.fed = len(tokens)
            request.local.extend(0, new)
            if request.cached and request.key in self.responses:
                self.global_tree.extend(request.key, new)
                self.responses[request.key] += len(new)
                self.cached_tokens += len(new)
                self._evict(keep=request.key)

    def end(self, request: SuffixGeneration) -> None:
        """The generation ended: its local tree goes, its response stays cached."""
        with self.lock:
            if self.active.pop(request.key, None) is not None:
                self.finished += 1

    def feed(self, tokens: list[int]) -> None:
        """A document to learn as if it were a response (a corpus)."""
        request = self.start([], 0)
        self.extend(request, list(tokens))
        self.end(request)

    def learn(self, output: list[int]) -> None:
        """A finished generation's response, from a generation that drafted from a pool of its own."""
        self.feed(output)

    def _evict(self, keep: int) -> None:
        """Oldest responses out, first in first out, while past either bound (never ``keep``,
        the one just added, as the reference)."""
        while (self.max_cached_requests > 0 and len(self.responses) > self.max_cached_requests) or \
                self.cached_tokens > self.max_cached_tokens:
            oldest = next((seq for seq in self.responses if seq != keep), None)
            if oldest is None:
                break
            self._drop(oldest)

    def _drop(self, seq: int) -> None:
        self.cached_tokens -= self.responses.pop(seq)
        if seq in self.global_tree.seqs:
            self.global_tree.remove(seq)
        request = self.active.get(seq)
        if request is not None:
            request.cached = False

    # ---- drafting -------------------------------------------------------------------------------
    def speculate(self, request: SuffixGeneration, tokens: list[int], max_spec_tokens: int, max_spec_factor: float,
                  max_spec_offset: float, min_token_prob: float, use_tree_spec: bool) -> tuple[SuffixDraft, bool]:
        """The draft after ``tokens`` (the generation's sequence, learned first), and whether it
        came from the global tree. As the reference: the newest ``max_tree_depth`` tokens are
        matched, the local tree's draft kept on a tie."""
        with self.lock:
            self.extend(request, tokens)
            context = tokens[-self.max_tree_depth :]
            local = request.local.speculate(context, max_spec_tokens, max_spec_factor, max_spec_offset,
                                            min_token_prob, use_tree_spec)
            shared = self.global_tree.speculate(context, max_spec_tokens, max_spec_factor, max_spec_offset,
                                                min_token_prob, use_tree_spec)
            return (local, False) if local.score >= shared.score else (shared, True)

    # ---- reporting and files --------------------------------------------------------------------
    def stats(self) -> PoolStats:
        with self.lock:
            return PoolStats(self.cached_tokens, len(self.responses), self.lookups, self.hits)

    def settings_key(self) -> dict:
        return {"max_tree_depth": self.max_tree_depth}

    def to_json(self) -> dict:
        """The cached responses, oldest first (prompts are never saved)."""
        return {"settings": self.settings_key(), "finished": self.finished,
                "responses": [self.global_tree.seqs.get(seq, []) for seq in self.responses]}

    def from_json(self, data: dict) -> None:
        check_saved(data, self.settings_key())
        self.global_tree = SuffixTree(self.max_tree_depth)
        self.responses, self.cached_tokens = OrderedDict(), 0
        for request in self.active.values():
            request.cached = False
        for response in data.get("responses", []):
            key = self._next_key
            self._next_key += 1
            self.responses[key] = 0
            if response:
                self.global_tree.extend(key, [int(t) for t in response])
                self.responses[key] = len(response)
                self.cached_tokens += len(response)
            self._evict(keep=key)
        self.finished = int(data.get("finished", 0))
