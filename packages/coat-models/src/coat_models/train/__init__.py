"""coat-train: the training product built on coat_models. Modules: ``cli`` (``coat-train``),
``jobs`` (what a run trains: model, data, tasks), ``trainer`` (``Trainer``, ``TrainConfig``),
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
    wrapped it in). Once the run is reported, signals are ignored: one landing in the second
    or so of interpreter teardown after it turned the run's status into 130 or 143."""
    import signal
    import sys

    received = []

    def interrupted(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, interrupted)
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
        signal.signal(signal.SIGINT, before)
    code = cli_main()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    return code
