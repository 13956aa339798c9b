"""The one exception type users see: a problem with their input, told in one line."""

import re
from collections import Counter
from collections.abc import Hashable, Sequence

# characters that would break the one line: line breaks, other controls, lone surrogates
_BREAKING = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


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

    The command line prints it as one line and exits with code 2. A message quotes what the
    user gave, which may hold line breaks or other control characters: they are written as
    escapes (``\\n``, ``\\x00``), so that the message stays one line whatever it quotes.
    """

    def __init__(self, message: object = "", *args: object):
        text = str(message)
        super().__init__(_BREAKING.sub(lambda m: ascii(m.group())[1:-1], text), *args)


class InUse(UserError):
    """A run directory another process holds (:func:`stocfl.storage.exclusive`): a runner that
    shares its runs with other processes (the benchmark's shards) leaves that run to its holder."""
