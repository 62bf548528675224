"""The step transaction: an undo journal, so that every operation of the software layer is all or nothing.

Every change to the allocator, the block tables, the prefix index and the
cached-free LRUs goes through a few journaled primitives of one :class:`Transaction`
(shared by all of them): :meth:`~Transaction.set` (array elements; the old values are
gathered first, vectorised), :meth:`~Transaction.attr` and :meth:`~Transaction.count`
(attributes and counters), and :meth:`~Transaction.undo` (a closure that undoes a
dict, list or LRU change, or unmaps chunks mapped inside the transaction). Each is
recorded *before* the change it undoes, and each undo is harmless when its change did
not happen, so an exception between the two loses nothing.

:meth:`Transaction.run` runs one operation (a step, or one building-block call) with
the journal open; nested calls join the open one. On success the journal is dropped;
on any exception (``KeyboardInterrupt`` included) it is replayed backwards, with SIGINT
deferred (:func:`deferred_sigint`) so that a second Ctrl-C cannot cut the rollback
short, and the exception goes on. While it is open :attr:`Transaction.moves` is a list
when the caller makes tier copies (a step, a swap): eviction then offloads to the host
tier, and every tier copy is recorded there in order. Outside a transaction the
primitives just change things (direct allocator calls, construction).
"""

import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, TypeVar

import numpy as np

T = TypeVar("T")


class Transaction:
    """The undo journal of one cache's software layer (see the module docstring).

    Attributes
    ----------
    moves : list of (int, int) or None
        While a list (inside a transaction run with ``moves=True``): eviction offloads, and every tier copy
        (src, dst) is recorded there in order.
    """

    def __init__(self) -> None:
        self._journal: Optional[List[Any]] = None  # a list while a transaction is open
        self.moves: Optional[List[Any]] = None  # while a list: offload on eviction, record every tier copy in order

    @property
    def open(self) -> bool:
        """Whether a transaction is open."""
        return self._journal is not None

    def run(self, operation: Callable[[], T], moves: bool = False) -> T:
        """``operation()`` as one transaction: all of its changes, or (on any exception) none.

        Parameters
        ----------
        operation : callable
            Takes no arguments; its result is returned.
        moves : bool
            Whether the caller makes the operation's tier copies (:attr:`moves`).
            Ignored when a transaction is open already: the operation is part of it.

        Returns
        -------
        object
            What ``operation()`` returned.

        Raises
        ------
        BaseException
            Whatever ``operation()`` raised, after every change it made is undone.
        """
        if self._journal is not None:
            return operation()
        self._journal, self.moves = [], [] if moves else None
        try:
            result = operation()
            self._journal = self.moves = None  # the commit: an interrupt before it still rolls back
        except BaseException:
            if self._journal is not None:
                self._rollback()
            raise
        return result

    def _rollback(self):
        with deferred_sigint():
            journal, self._journal, self.moves = self._journal, None, None
            for entry in reversed(journal):
                if type(entry) is tuple:
                    array, index, old = entry
                    array[index] = old
                else:
                    entry()

    def set(self, array: np.ndarray, index: Any, values: Any) -> None:
        """``array[index] = values``, journaled (``index`` any NumPy index, ``values`` what it takes)."""
        if self._journal is not None:
            self._journal.append((array, index, array[index].copy()))
        array[index] = values

    def save(self, array: np.ndarray, index: Any) -> None:
        """Journal ``array[index]`` before the caller changes it in place (``np.add.at`` and the like)."""
        if self._journal is not None:
            self._journal.append((array, index, array[index].copy()))

    def attr(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, journaled."""
        if self._journal is not None:
            self._journal.append(_SetAttr(obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def count(self, obj: Any, name: str, n: int) -> None:
        """Add ``n`` to the counter ``obj.name``, journaled."""
        self.attr(obj, name, getattr(obj, name) + n)

    def undo(self, function: Callable[[], Any]) -> None:
        """Record ``function`` (no arguments) to run on rollback; call it before the change it undoes."""
        if self._journal is not None:
            self._journal.append(function)


class _SetAttr:
    __slots__ = ("obj", "name", "value")

    def __init__(self, obj, name, value):
        self.obj, self.name, self.value = obj, name, value

    def __call__(self):
        setattr(self.obj, self.name, self.value)


@contextmanager
def deferred_sigint() -> Iterator[None]:
    """SIGINT held back while the block runs (main thread only; elsewhere signals do not arrive), then
    delivered once to the handler it would have met."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # no Python handler to restore (installed outside Python): nothing to defer
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)
