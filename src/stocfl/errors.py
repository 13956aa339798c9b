"""The one exception type users see: a problem with their input, told in one line."""

from collections import Counter
from collections.abc import Hashable, Sequence


def first_repeated(items: Sequence[Hashable]) -> int | None:
    """The index of the first item that appears more than once (None: all distinct), for
    inputs where a repeat would be counted twice (seeds, clients, algorithms)."""
    counts = Counter(items)
    return next((k for k, x in enumerate(items) if counts[x] > 1), None)


def refuse_builtin(register: str, name: str, builtin: bool) -> None:
    """A user's registration may not replace a built-in: its results would be reported under
    the built-in's name (a "fedavg" row that is not FedAvg)."""
    if builtin:
        raise UserError(
            f"{register}: {name!r} is built in; register yours under another name (a built-in keeps "
            f"its meaning in every config and table)"
        )


class UserError(Exception):
    """Bad input (config, data, a client's reply). The message names the problem and the fix.

    The command line prints it as one line and exits with code 2.
    """
