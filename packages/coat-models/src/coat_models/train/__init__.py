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
    status 130, as one during training does, instead of a traceback."""
    import signal
    import sys

    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        from .args import env_rank  # (the standard library only)

        if env_rank() == 0:  # under torchrun every rank gets the Ctrl-C: rank 0 says it
            print("\ncoat-train: interrupted while starting", file=sys.stderr)
        return 128 + signal.SIGINT
    return cli_main()
