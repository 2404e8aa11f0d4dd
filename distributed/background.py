"""One call run on a daemon thread while the caller goes on; its result (or its error) on demand."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class InBackground:
    """Start ``fn(*args)`` on a daemon thread at once; :meth:`result` waits for it.

    :meth:`result` returns what ``fn`` returned or raises what it raised, in the caller's thread.
    The thread is a daemon: a caller that fails before asking for the result leaves it behind
    instead of hanging the process's exit on a call that may be waiting on a peer.
    """

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True, name=fn.__name__)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self._value = fn(*args)
        except BaseException as exc:  # handed to the caller by result()
            self._error = exc

    def failed(self) -> BaseException | None:
        """The error ``fn`` raised if it has already ended with one; never waits."""
        return None if self._thread.is_alive() else self._error

    def wait(self, timeout_s: float | None) -> bool:
        """Whether ``fn`` has ended, after waiting at most ``timeout_s`` (None: until it ends)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
