"""`FitPool`: reusable items taken whole and given back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class FitPool(Generic[T]):
    """Items taken whole and given back, to be reused (the KV worker's staging buffers, a
    prefill worker's registered bounce buffers): `take` gives the smallest free item that
    fits, else a new one; `give` keeps the largest `max_kept` free ones and `drop`s the rest."""

    def __init__(self, size_of: Callable[[T], int],
                 drop: Callable[[T], None] = lambda _item: None, max_kept: int = 4) -> None:
        self.size_of = size_of
        self.drop = drop
        self.max_kept = max_kept
        self._free: list[T] = []
        self._lock = threading.Lock()

    def take(self, size: int, make: Callable[[], T],
             accepts: Callable[[T], bool] = lambda _item: True) -> T:
        """A free item of at least `size` that `accepts` takes (the smallest), else `make()`."""
        with self._lock:  # (by position: `==` on tensors compares their elements)
            fits = [i for i, item in enumerate(self._free)
                    if self.size_of(item) >= size and accepts(item)]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self.size_of(self._free[i])))
        return make()

    def give(self, item: T) -> None:
        with self._lock:
            self._free.append(item)
            dropped = None
            if len(self._free) > self.max_kept:  # keep the largest
                dropped = self._free.pop(min(range(len(self._free)),
                                             key=lambda i: self.size_of(self._free[i])))
        if dropped is not None:
            self.drop(dropped)

    def close(self) -> None:
        """Drop every free item."""
        with self._lock:
            free, self._free = self._free, []
        for item in free:
            self.drop(item)
