"""The cache's one-thread guard: a method run inside the cache's lock, taken without waiting, on an open cache."""

import functools
from typing import Callable

from .errors import ConcurrentUseError, PoolClosedError


def exclusive(method: Callable) -> Callable:
    """``method`` run inside the cache's lock, taken without waiting, on an open cache.

    A second thread that calls in meanwhile gets ConcurrentUseError at once, before it
    reads or changes anything: misuse is a named error, never two tables sharing a block.
    The lock is taken as the first statement inside ``try`` and released only if taken.
    It is reentrant (an ``RLock``), so an interrupt that still lands between taking and
    releasing it (at the ``finally`` line) cannot lock out the thread that was using the
    cache; other threads are refused, as while a call runs.
    """
    name = method.__name__

    @functools.wraps(method)
    def exclusive(self, *args, **kwargs):
        locked = False
        try:
            locked = self._lock.acquire(False)
            if not locked:
                raise ConcurrentUseError(
                    f"cache.{name}() was called while another thread was inside this cache: a PagedKVCache is not "
                    f"thread-safe; call it from one thread, or hold a lock of your own around every call")
            if self.pool.closed:  # the cache's close() closes the pool
                raise PoolClosedError(f"cache.{name}(): this cache was closed; make a new one")
            return method(self, *args, **kwargs)
        finally:
            if locked:
                self._lock.release()
    return exclusive
