"""Ctrl-C, SIGTERM and SIGHUP that a run cannot lose.

Python raises a signal's exception wherever the main thread happens to be. Where that is a
``__del__`` (the memory tracker's saved-tensor records) Python drops it (here without the
"Exception ignored" traceback it would print: the signal is recorded); inside
``torch.save`` its writer turns it into a ``RuntimeError``. So the handlers here also record
the signal, and the training loop calls ``raise_pending`` after every micro-batch and step
(and the CLI before it reports another error): a dropped or disguised interrupt still stops
the run, as an interrupt, at the next micro-batch at the latest.

Python runs its handlers between bytecodes, so a signal cannot stop one long native operation
(a CPU attention over a 100k-token sequence ran on for minutes). A second signal can: the
signals also reach a watchdog thread (``signal.set_wakeup_fd``: the C-level handler writes
each signal's number into a pipe at once, and the Python handler, when it runs, writes a
0 after them), which ends the process when two such signals are in the pipe with no 0
after them for a second. The checkpoints completed before stay.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time

_PENDING: list[type[KeyboardInterrupt]] = []  # the signals received inside ``handled()``
_ANSWER_FD = [-1]  # the running watchdog's pipe: the handler writes a 0 there (-1: none)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler, ``docker stop``, ``kill``) or SIGHUP (the terminal closed):
    stopped as by Ctrl-C, with the steps done logged and the checkpoints kept."""


class HungUp(Terminated):
    """SIGHUP: a ``Terminated`` whose exit status is 128 + SIGHUP."""


# (SIGHUP had ended the process at once, without the steps done logged; under nohup it is
# ignored and stays so.)
_SIGNALS = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: Terminated, signal.SIGHUP: HungUp}


def signal_number(e: KeyboardInterrupt) -> int:
    """The signal that raised ``e`` (SIGINT for a plain ``KeyboardInterrupt``)."""
    return next(sig for sig, kind in reversed(_SIGNALS.items()) if isinstance(e, kind))


def _handler(signum, frame):
    exc = _SIGNALS[signum]
    _PENDING.append(exc)
    if _ANSWER_FD[0] >= 0:  # after the numbers of the signals this run answers
        with contextlib.suppress(OSError):
            os.write(_ANSWER_FD[0], b"\0")
    raise exc


@contextlib.contextmanager
def handled(forced_note: str = "a second signal ({signal}): stopped at once"):
    """SIGINT and SIGTERM raise ``KeyboardInterrupt`` / ``Terminated`` and are recorded, for
    the duration (the previous handlers back afterwards; off the main thread, where Python
    sets no handlers, nothing changes). A signal the process was started ignoring stays
    ignored (``nohup``, a shell's background job: Ctrl-C in the terminal is not for it).
    Two signals that Python's handler has not answered within a second end the process
    (``_Watchdog``: exit status 128 + the signal's number; ``forced_note`` on stderr, its
    ``{signal}`` replaced by the signal's name)."""
    previous = {}
    for sig in _SIGNALS:
        if signal.getsignal(sig) is signal.SIG_IGN:
            continue
        with contextlib.suppress(ValueError):  # a handler can be set in the main thread only
            previous[sig] = signal.signal(sig, _handler)
    _PENDING.clear()
    unraisable = sys.unraisablehook
    sys.unraisablehook = _quiet_if_recorded(unraisable)
    watchdog = _Watchdog.start(set(previous), forced_note) if previous else None
    try:
        yield
    finally:
        try:  # (a signal raised in here must not skip the rest)
            if watchdog is not None:
                watchdog.stop()
        finally:
            sys.unraisablehook = unraisable
            for sig, old in previous.items():
                signal.signal(sig, old)
            _PENDING.clear()


class _Watchdog:
    """Reads the pipe that ``signal.set_wakeup_fd`` writes the received signals' numbers
    into, in a thread of its own, which runs while the main thread is inside a native
    operation that released the GIL (torch's operators do). The Python handler writes a 0
    after them when it runs (one run answers all the deliveries before it, as Python
    merges them). Two of ``signals`` read with no 0 after them for ``GRACE_S``: the main
    thread is stuck, and the process ends. After ``stop`` it ends nothing; the thread closes
    its end of the pipe as it exits."""

    GRACE_S = 1.0

    def __init__(self, read_fd: int, write_fd: int, old_fd: int, signals: set, note: str):
        self.read_fd, self.write_fd, self.old_fd = read_fd, write_fd, old_fd
        self.signals, self.note = {int(s) for s in signals}, note
        self.outer_answer_fd = _ANSWER_FD[0]
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="coat-interrupt", daemon=True)

    @classmethod
    def start(cls, signals: set, note: str) -> _Watchdog | None:
        read_fd, write_fd = os.pipe()
        try:
            os.set_blocking(write_fd, False)  # the C handler must never block on it
            old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):  # off the main thread, or a platform without it
            os.close(read_fd)
            os.close(write_fd)
            return None
        watchdog = cls(read_fd, write_fd, old_fd, signals, note)
        _ANSWER_FD[0] = write_fd
        watchdog.thread.start()
        return watchdog

    def _watch(self) -> None:
        try:
            unanswered, last, deadline = 0, 0, None
            poll = select.poll()  # (select.select refuses fds >= 1024)
            poll.register(self.read_fd, select.POLLIN)
            while True:
                wait = None if deadline is None else max(0, deadline - time.monotonic()) * 1e3
                ready = poll.poll(wait)
                if self.stopped.is_set():
                    return
                if not ready:  # a second with no answer: the main thread is stuck
                    name = signal.Signals(last).name
                    os.write(2, f"\n{self.note.replace('{signal}', name)}\n".encode())
                    os._exit(128 + last)
                data = os.read(self.read_fd, 64)
                if not data:  # stop() closed the write end
                    return
                for byte in data:
                    if byte == 0:  # the handler ran after the signals before it
                        unanswered = 0
                    elif byte in self.signals and signal.getsignal(byte) is _handler:
                        # (a handler set over ours would write no answer: not counted)
                        unanswered, last = unanswered + 1, byte
                if unanswered < 2:
                    deadline = None
                elif deadline is None:
                    deadline = time.monotonic() + self.GRACE_S
        except (OSError, ValueError):
            return
        finally:
            os.close(self.read_fd)

    def stop(self) -> None:
        # Each step in a finally of the one before: a signal raised in one (the handler
        # still runs here) does not skip the others.
        self.stopped.set()
        _ANSWER_FD[0] = self.outer_answer_fd
        try:
            try:
                signal.set_wakeup_fd(self.old_fd)
            except (ValueError, OSError):  # the earlier fd was closed meanwhile: none
                with contextlib.suppress(ValueError, OSError):
                    signal.set_wakeup_fd(-1)
        finally:
            try:
                os.close(self.write_fd)  # the thread reads the end of the pipe and exits
            finally:
                self.thread.join(timeout=5)


def _forget_watchdog_in_child() -> None:
    """In a forked child: its signals' numbers and answers would reach the parent's
    watchdog (the pipe is shared), so the child writes to it no more. (Nothing changes in
    a child forked with no watchdog running.)"""
    if _ANSWER_FD[0] < 0:
        return
    _ANSWER_FD[0] = -1
    with contextlib.suppress(ValueError, OSError):  # (a fork off the main thread: cannot)
        signal.set_wakeup_fd(-1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_watchdog_in_child)


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
