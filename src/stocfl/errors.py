"""The one exception type users see: a problem with their input, told in one line."""

from collections import Counter
from collections.abc import Hashable, Sequence


def first_repeated(items: Sequence[Hashable]) -> int | None:
    """The index of the first item that appears more than once (None: all distinct), for
    inputs where a repeat would be counted twice (seeds, clients, algorithms)."""
    counts = Counter(items)
    return next((k for k, x in enumerate(items) if counts[x] > 1), None)


class UserError(Exception):
    """Bad input (config, data, a client's reply). The message names the problem and the fix.

    The command line prints it as one line and exits with code 2.
    """
