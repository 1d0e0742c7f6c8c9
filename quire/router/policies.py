"""Which instance serves a request: round robin, least loaded, or cache aware.

An `Instance` is what the router knows of one server: its URL, its load (running + waiting,
polled from its /load endpoint, plus what the router sent it since the last poll) and, for the
cache-aware policy, an approximate prefix tree of the prompts it was sent.

cache_aware is the SGLang router's approach: a request goes to the instance whose tree matches
the longest share of its prompt when that share is above `cache_threshold`, else to the instance
with the smallest tree (the most room in its cache); either way only while load is balanced.
When the most and least loaded instances differ by more than `balance_abs_threshold` requests
and by a factor above `balance_rel_threshold` (both: either alone leaves the choice to the
cache), the least loaded instance takes the request.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_loaded", "cache_aware", "cost_model")


class PrefixTree:
    """A character trie of the prompts sent to one instance, trimmed to `max_chars` characters
    by dropping the least recently used leaves (approximate, as the instance's own cache is)."""

    def __init__(self, max_chars: int = 1 << 20):
        self.max_chars = max_chars
        self.root: dict = {}
        self.size = 0  # characters (nodes) held
        self._last_used: dict[int, float] = {}  # id(node) -> last insert or match through it

    def match(self, text: str) -> int:
        """How many leading characters of `text` the tree holds."""
        node, n = self.root, 0
        for char in text:
            node = node.get(char)
            if node is None:
                break
            n += 1
        return n

    def insert(self, text: str) -> None:
        now = time.monotonic()
        node = self.root
        for char in text:
            child = node.get(char)
            if child is None:
                child = node[char] = {}
                self.size += 1
            self._last_used[id(child)] = now
            node = child
        if self.size > self.max_chars:
            self._evict(self.size - self.max_chars)

    def _evict(self, count: int) -> None:
        """Drops at least `count` characters, oldest leaves first (a leaf's parent may become a
        leaf in turn on a later pass)."""
        while count > 0 and self.size:
            leaves = list(self._leaves(self.root))
            leaves.sort(key=lambda leaf: self._last_used.get(id(leaf[0][leaf[1]]), 0.0))
            for parent, char in leaves[:count]:
                del self._last_used[id(parent[char])]
                del parent[char]
                self.size -= 1
                count -= 1

    def _leaves(self, root: dict):
        """(parent, char) of every leaf, depth first without recursion (prompts are deep)."""
        stack = [root]
        while stack:
            node = stack.pop()
            for char, child in node.items():
                if child:
                    stack.append(child)
                else:
                    yield node, char


@dataclass
class Instance:
    url: str
    role: str  # "prefill", "decode" or "collocated"
    kv_host: str | None = None  # a prefill instance's KV endpoint
    kv_port: int | None = None
    polled_load: int = 0  # running + waiting at the last poll
    sent_since_poll: int = 0
    healthy: bool = True
    tree: PrefixTree = field(default_factory=PrefixTree)

    @property
    def load(self) -> int:
        return self.polled_load + self.sent_since_poll


class Policy:
    def choose(self, instances: list[Instance], text: str, body: dict | None = None) -> Instance:
        """One of `instances` for the request `body` whose prompt text is `text`."""
        raise NotImplementedError

    def relaying(self, instance: Instance, body: dict, tally) -> None:
        """The answer of `instance` to `body` streams through `tally` (a StreamTally) now."""

    def done(self, instance: Instance, body: dict, tally=None, usage: dict | None = None) -> None:
        """`instance` answered `body` (its stream's `tally`, its `usage` report) or failed."""

    def describe(self) -> dict:
        """What the router's /load shows of the policy's state."""
        return {}


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, instances: list[Instance], text: str, body: dict | None = None) -> Instance:
        return instances[next(self._counter) % len(instances)]


class LeastLoaded(Policy):
    def choose(self, instances: list[Instance], text: str, body: dict | None = None) -> Instance:
        return min(instances, key=lambda instance: instance.load)


class CacheAware(Policy):
    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
    ):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def choose(self, instances: list[Instance], text: str, body: dict | None = None) -> Instance:
        loads = [instance.load for instance in instances]
        imbalanced = (
            max(loads) - min(loads) > self.balance_abs_threshold
            and max(loads) > min(loads) * self.balance_rel_threshold
        )
        if imbalanced:
            chosen = min(instances, key=lambda instance: instance.load)
        else:
            key = cache_key(text, body)
            matches = [instance.tree.match(key) for instance in instances]
            best = max(range(len(instances)), key=matches.__getitem__)
            if text and matches[best] / len(key) > self.cache_threshold:
                chosen = instances[best]
            else:
                chosen = min(instances, key=lambda instance: instance.tree.size)
        chosen.tree.insert(cache_key(text, body))
        return chosen


def cache_key(text: str, body: dict | None) -> str:
    """What an instance's prefix cache holds a request's prompt under: its `model` (a LoRA
    adapter's name, or the base model's) and its text. The same prompt under two adapters has
    different K/V, so it shares no cached prefix."""
    model = (body or {}).get("model")
    return text if not isinstance(model, str) else f"{model}\0{text}"


def make_policy(name: str) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "cache_aware":
        return CacheAware()
    if name == "cost_model":
        raise ValueError("policy cost_model needs measured parameters: pass --cost-profile.")
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}.")
