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
import math
import os
import sys
from collections.abc import Callable
from typing import NoReturn

# argparse's messages that name no valid input: the help lists it.
_SEE_HELP = ("unrecognized arguments", "the following arguments are required", "expected one")


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit 2: argparse's own
    print the whole usage block first (20 lines for coat-train), burying the line that says
    what is wrong. ``--help`` prints the usage as before. Subparsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        if any(s in message for s in _SEE_HELP):
            message += f" (see {self.prog} --help)"
        # Under torchrun every rank parses the same command line: rank 0 alone says what is
        # wrong, as for coat-train's other errors. A RANK that is not torchrun's prints too.
        rank = os.environ.get("RANK", "")
        if not (rank.isdigit() and int(rank) > 0):
            print(f"{self.prog}: error: {message}".replace("\n", " "), file=sys.stderr)
        self.exit(2)


def int_in(low: int, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low`` (and <= ``high``), else an error that says
    the range; ``why`` follows the range in it, e.g. ``" (this machine's CPUs)"``."""
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {bound}{why}, got {text!r}")
        return value

    return parse


def float_in(
    low: float, high: float | None = None, *, exclusive: bool = False
) -> Callable[[str], float]:
    """An argparse ``type``: a finite number >= ``low`` (and <= ``high``; > and < where
    ``exclusive``), else an error that says the range. ``float`` alone takes nan and inf,
    and inf passes any lower bound."""
    if high is None:
        bound = f"finite number {'>' if exclusive else '>='} {low:g}"
    else:
        bound = f"number in {'(' if exclusive else '['}{low:g}, {high:g}{')' if exclusive else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        inside = (low < value if exclusive else low <= value) and (
            high is None or (value < high if exclusive else value <= high)
        )
        if not (math.isfinite(value) and inside):
            raise argparse.ArgumentTypeError(f"must be a {bound}, got {text!r}")
        return value

    return parse
