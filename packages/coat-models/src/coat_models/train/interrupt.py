"""Ctrl-C and SIGTERM that a run cannot lose.

Python raises a signal's exception wherever the main thread happens to be. Where that is a
``__del__`` (the memory tracker's saved-tensor records) Python drops it (here without the
"Exception ignored" traceback it would print: the signal is recorded); inside
``torch.save`` its writer turns it into a ``RuntimeError``. So the handlers here also record
the signal, and the training loop calls ``raise_pending`` after every micro-batch and step
(and the CLI before it reports another error): a dropped or disguised interrupt still stops
the run, as an interrupt, at the next micro-batch at the latest. (A signal cannot stop one
long native operation: Python runs its handlers between bytecodes.)
"""

from __future__ import annotations

import contextlib
import signal
import sys

_PENDING: list[type[KeyboardInterrupt]] = []  # the signals received inside ``handled()``


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler, ``docker stop``, ``kill``): stopped as by Ctrl-C, with the
    steps done logged and the checkpoints kept."""


def _handler(signum, frame):
    exc = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    _PENDING.append(exc)
    raise exc


@contextlib.contextmanager
def handled():
    """SIGINT and SIGTERM raise ``KeyboardInterrupt`` / ``Terminated`` and are recorded, for
    the duration (the previous handlers back afterwards; off the main thread, where Python
    sets no handlers, nothing changes). A signal the process was started ignoring stays
    ignored (``nohup``, a shell's background job: Ctrl-C in the terminal is not for it)."""
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is signal.SIG_IGN:
            continue
        with contextlib.suppress(ValueError):  # a handler can be set in the main thread only
            previous[sig] = signal.signal(sig, _handler)
    _PENDING.clear()
    unraisable = sys.unraisablehook
    sys.unraisablehook = _quiet_if_recorded(unraisable)
    try:
        yield
    finally:
        sys.unraisablehook = unraisable
        for sig, old in previous.items():
            signal.signal(sig, old)
        _PENDING.clear()


def _quiet_if_recorded(hook):
    """``sys.unraisablehook`` that says nothing of a recorded signal's exception raised
    where Python cannot propagate it (a ``__del__``): ``raise_pending`` raises it again.
    Anything else goes to ``hook``."""

    def quiet(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and _PENDING:
            return
        hook(unraisable)

    return quiet


def pending() -> type[KeyboardInterrupt] | None:
    """The exception of the first signal received inside ``handled()``, or None."""
    return _PENDING[0] if _PENDING else None


def raise_pending() -> None:
    """Raise the first received signal's exception again (once it was dropped or disguised
    where it landed); nothing when none was received."""
    exc = pending()
    if exc is not None:
        raise exc
