"""coat-train: the training product built on coat_models. Modules: ``cli`` (``coat-train``),
``jobs`` (what a run trains: model, data, tasks), ``options`` (its parser: the standard
library only), ``trainer`` (``Trainer``, ``TrainConfig``),
``tasks`` (what differs between model kinds),
``data`` / ``vl_data``, ``presets``, ``memory`` (the memory breakdown), ``report``, ``outdir``
(the output directory: its lock, its checks, resume points), ``args`` (the parser of
coat-train and the benchmarks). The integration does not import it, and
nothing is imported here: ``import coat_models`` stays light.
"""


def main() -> int:
    """The ``coat-train`` console script: ``cli.main``, imported here so that a Ctrl-C during
    the seconds its imports (torch, transformers) take ends the command with one line and
    status 130, as one during training does, instead of a traceback (or the error a library
    wrapped it in); a SIGINT ignored at the start (a background job) stays ignored. At the
    interpreter's exit, signals are ignored: one landing in the second or so of teardown
    after a reported run turned its status into 130 or 143, with no word."""
    import atexit
    import signal
    import sys
    import threading

    from .options import build_parser, versions  # (the standard library only)

    # The command line is parsed before the imports: --help, --version and a mistyped
    # option answer at once, not after the seconds of importing torch (cli.main parses it
    # again, the same way).
    try:
        try:
            args = build_parser().parse_args()
        except SystemExit as e:  # --help (0), or a bad command line (2) the parser printed
            sys.stdout.flush()
            return e.code
        if args.version:
            print(versions(), flush=True)
            return 0
    except BrokenPipeError:  # (coat-train --version | head -1): no traceback, as cat does
        _quiet_stdout()
        return 0
    received = []

    def interrupted(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    own = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    before = signal.signal(signal.SIGINT, interrupted) if own else None
    try:
        from .cli import main as cli_main
    except BaseException as e:
        if not (received or isinstance(e, KeyboardInterrupt)):
            raise
        from .args import env_rank  # (the standard library only)

        if env_rank() == 0:  # under torchrun every rank gets the Ctrl-C: rank 0 says it
            print("\ncoat-train: interrupted while starting", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        if own:
            signal.signal(signal.SIGINT, before)
    atexit.register(_ignore_signals)  # (runs once however often main is called)
    return cli_main()


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: its reader has gone, and the interpreter's flush at exit
    would print a BrokenPipeError."""
    import os
    import sys

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _ignore_signals() -> None:
    import signal

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
