"""The command-line parser of ``coat-train`` and of the benchmark scripts: errors are one line
on stderr with exit status 2, and option types that check a value's range as it is parsed.

    p = OneLineParser(prog="coat-train")
    p.add_argument("--steps", type=int_in(1))
    p.add_argument("--lr", type=float_in(0, exclusive=True))
    p.parse_args(["--steps", "0"])
    # stderr: coat-train: error: argument --steps: must be an integer >= 1, got '0'
    # then SystemExit(2)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
import sys
from collections.abc import Callable
from typing import NoReturn

PROG = "coat-train"


class UsageError(ValueError):
    """Bad command line; the message says what to change."""


class RankUsageError(UsageError):
    """Bad input that some ranks only see (e.g. a local rank without a GPU): each of them
    says it, naming its rank, where a ``UsageError`` is said once, by rank 0."""


# argparse's messages that name no valid input: the help lists it.
_SEE_HELP = ("unrecognized arguments", "the following arguments are required", "expected one")


def env_rank() -> int:
    """torchrun's ``RANK`` of this process: read where torchrun's ``WORLD_SIZE`` makes it one
    of several processes and the rank is one of them; 0 otherwise (a ``RANK`` left in the
    shell by something else made a lone run silent: only rank 0 prints and writes the
    report)."""
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if rank.isdigit() and world.isdigit() and int(rank) < int(world):
        return int(rank)
    return 0


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit 2: argparse's own
    print the whole usage block first (20 lines for coat-train), burying the line that says
    what is wrong. ``--help`` prints the usage as before. Subparsers are of this class too.
    Options are not abbreviated (argparse's default took ``--step 5`` for ``--steps 5`` without
    a word, and a later option sharing a prefix would change what an old command means)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if any(s in message for s in _SEE_HELP):
            message += f" (see {self.prog} --help)"
        # Under torchrun every rank parses the same command line: rank 0 alone says what is
        # wrong, as for coat-train's other errors. A RANK that is not torchrun's prints too.
        if env_rank() == 0:
            print(f"{self.prog}: error: {message}".replace("\n", " "), file=sys.stderr)
        self.exit(2)


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


@dataclasses.dataclass(frozen=True)
class Range:
    """The values an option (or a config field) takes: an integer or a finite number from
    ``low`` (excluded with ``open_low``) up to ``high`` (None: no bound; excluded with
    ``open_high``). ``why`` follows the range in the error, e.g. ``" (this machine's
    CPUs)"``. One rule for the parser (``parse``, an argparse ``type``) and for a config's
    ``__post_init__`` (``error``)."""

    low: float
    high: float | None = None
    integer: bool = True
    open_low: bool = False
    open_high: bool = False
    why: str = ""

    def describe(self) -> str:
        what = "an integer" if self.integer else "a finite number"
        if self.high is None:
            return f"{what} {'>' if self.open_low else '>='} {_num(self.low)}{self.why}"
        low, high = "(" if self.open_low else "[", ")" if self.open_high else "]"
        return f"{what} in {low}{_num(self.low)}, {_num(self.high)}{high}{self.why}"

    def error(self, value) -> str | None:
        """``"must be ..."`` when ``value`` is outside (nan and inf are outside) or not a
        number (a string, a bool), else None."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return f"must be {self.describe()}"
        ok = (self.low < value if self.open_low else self.low <= value) and (
            self.high is None or (value < self.high if self.open_high else value <= self.high)
        )
        if self.integer:
            ok = ok and isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = ok and math.isfinite(value)
        return None if ok else f"must be {self.describe()}"

    def parse(self, text: str):
        """argparse ``type``: ``text`` as an int (or float) in the range, else an error."""
        kind = int if self.integer else float
        try:
            value = kind(text)
        except ValueError:  # (argparse said "invalid int value: 'ten'", naming no valid one)
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}") from None
        message = self.error(value)
        if message:
            raise argparse.ArgumentTypeError(f"{message}, got {text!r}")
        return value


def int_in(low: int, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low`` (and <= ``high``)."""
    return Range(low, high, why=why).parse


def float_in(low: float, high: float | None = None, *, exclusive: bool = False):
    """An argparse ``type``: a finite number >= ``low`` and <= ``high`` (> and < with
    ``exclusive``)."""
    return Range(low, high, integer=False, open_low=exclusive, open_high=exclusive).parse


def int_list(low: int = 1) -> Callable[[str], list[int]]:
    """An argparse ``type``: comma-separated integers, each >= ``low`` (e.g. ``1,2,4``)."""
    each = Range(low)

    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or any(each.error(v) for v in values):
            raise argparse.ArgumentTypeError(
                f"must be comma-separated integers >= {low}, e.g. 1,2,4, got {text!r}"
            )
        return values

    return parse


def name_list(choices) -> Callable[[str], list[str]]:
    """An argparse ``type``: comma-separated names, each one of ``choices``, none twice (e.g.
    ``bf16,coat``): a misspelt one is refused, not run as something else."""
    choices = tuple(choices)

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if not names or bad or len(set(names)) != len(names):
            what = f"unknown {', '.join(bad)}" if bad else f"got {text!r}"
            raise argparse.ArgumentTypeError(
                f"{what}: must be comma-separated names of {', '.join(choices)}, each once"
            )
        return names

    return parse


def writable_file(path: str | None, what: str) -> str | None:
    """``path`` (None passes) when a file can be written there, checked before a long run
    that would only then write its results; else a ``UsageError`` naming ``what`` (the option
    or variable that gave it). Creates nothing."""
    if not path:  # (unset or empty: no file is written)
        return None
    p = os.path.abspath(path)
    folder = os.path.dirname(p)
    if os.path.isdir(p):
        raise UsageError(f"{what} {path} is a directory: pass a file name")
    if not os.path.isdir(folder):
        raise UsageError(f"{what} {path}: no folder {folder}: create it or pass another path")
    if not os.access(folder, os.W_OK | os.X_OK) or (
        os.path.exists(p) and not os.access(p, os.W_OK)
    ):
        raise UsageError(f"{what} {path}: not writable here: pass another path")
    return path
