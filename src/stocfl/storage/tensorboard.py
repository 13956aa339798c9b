"""Each round's numbers as TensorBoard scalars (``run.tensorboard = true``), beside metrics.jsonl."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from stocfl.errors import UserError

# metrics.jsonl keys that are not a figure of the round
SKIPPED = ("round", "dropped_clients")


class Scalars:
    """A TensorBoard event writer for the run in ``out`` (``out/tensorboard``). A resumed run
    starts at ``first_round``: events a killed run wrote past its checkpoint are purged, so each
    round appears once."""

    @staticmethod
    def check(out: Path | None) -> None:
        """Refuse, before a run starts, what would stop it writing scalars."""
        if out is None:
            raise UserError(
                "run.tensorboard = true writes into the results directory; give the run one (--out DIR, "
                "or out= in Python) or set run.tensorboard = false"
            )
        if importlib.util.find_spec("tensorboard") is None:
            raise UserError(
                "run.tensorboard = true needs the tensorboard package: pip install 'stocfl[tensorboard]', "
                "or set run.tensorboard = false"
            )

    def __init__(self, out: Path | None, first_round: int):
        self.check(out)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=first_round)

    def add(self, row: dict[str, Any]) -> None:
        """Every number of a metrics row (lists and text left out), at step ``row['round']``."""
        for key, value in row.items():
            if key in SKIPPED or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(key, value, row["round"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
