"""One bounded cache for the analysis' pure functions: the same reference gradients, spans and kink
analyses are asked for by several judges of one case (and by a property, its clip bound and its fuzz
recipe), so each function keeps its last results by key. A value is shared: callers must not modify
it. Least recently used first out, at a fixed size (the values are tensors of a run's size). Safe to
share between threads (the gate judges in one and explores in another): the bookkeeping is locked,
a value is computed outside the lock (two threads asking for one key at once may both compute it;
the values are equal, the last one kept)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


class Memo(Generic[V]):
    """``get(key, compute)``: the cached value of ``key``, else ``compute()`` stored under it; at most
    ``size`` values, the least recently used dropped first."""

    def __init__(self, size: int):
        self.size = size
        self._values: "OrderedDict[Hashable, V]" = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, compute: Callable[[], V]) -> V:
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
        value = compute()
        with self._lock:
            self._values[key] = value
            while len(self._values) > self.size:
                self._values.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._values)


__all__ = ["Memo"]
