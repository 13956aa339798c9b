"""Start a run into a results directory, or open a saved one to continue it: the directory's
files are made or read here, each against the provenance of :mod:`stocfl.experiment.provenance`,
before the round loop (:class:`stocfl.experiment.loop.Experiment`) takes over."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from stocfl.config import Config
from stocfl.data.federation import Federation
from stocfl.errors import UserError
from stocfl.experiment import configure, provenance
from stocfl.experiment.build import pin_data_dir, read_config
from stocfl.experiment.loop import Experiment
from stocfl.experiment.provenance import CHECKPOINT
from stocfl.storage import formats, store
from stocfl.storage.files import exclusive, write_atomic


def refuse_a_run_in(out: Path) -> None:
    if (out / "config.toml").exists():
        raise UserError(f"{out} already holds a run; continue it with 'stocfl resume {out}' or pick another --out")


def check_new_out(out: Path) -> None:
    """A new run goes into a new or empty directory (hidden entries, such as a lock or Flower's
    home, aside): never over a file, a run, or beside other files."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file, not a results directory; pick another --out")
    refuse_a_run_in(out)
    others = sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) if out.is_dir() else []
    if others:
        raise UserError(
            f"{out} holds other files ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); a run goes "
            f"into a new or empty directory: pick another --out"
        )


def create(
    cfg: Config,
    out: str | Path | None,
    executor: Any = None,
    federation: Federation | None = None,
    module: Any = None,
    loss: Any = None,
) -> Experiment:
    """A new run of ``cfg`` into ``out`` (None: everything stays in memory), checkpointed at
    round 0. The data are built before the directory is made: a data error leaves no half-made
    directory."""
    if out is not None and not str(out).strip():
        raise UserError("out = '' names no directory; give a results directory, or None to write nothing")
    out = None if out is None else Path(out)
    if out is not None:
        check_new_out(out)
    if federation is None:
        pin_data_dir(cfg)
    exp = Experiment(cfg, out, executor, federation, module, loss)
    if out is None:
        exp.save_checkpoint()
        return exp
    out.mkdir(parents=True, exist_ok=True)
    with exclusive(out):
        refuse_a_run_in(out)  # another process may have made one meanwhile
        write_atomic(out / "config.toml", formats.to_toml(cfg.to_dict()))
        write_atomic(out / "metrics.jsonl", "")
        exp.save_checkpoint()
    return exp


def open_saved(
    out: str | Path,
    data_dir: str | None = None,
    executor: Any = None,
    federation: Federation | None = None,
    module: Any = None,
    loss: Any = None,
    overrides: list[str] = (),
    read_only: bool = False,
) -> Experiment:
    """A saved run, rebuilt from its config and last checkpoint (and the federation and
    module it was given in Python, if it was). ``overrides`` (``run.rounds=N``,
    ``run.eval_every=K``: keys that change nothing computed so far) are written into its
    config.toml; otherwise nothing on disk changes but, to continue the run, its client stores
    put back to the checkpoint's version. ``read_only``: not even that (the stores are read
    copy-on-write, :func:`stocfl.storage.store.read_only`): what export, assign and a loaded run
    use."""
    out = Path(out)
    path = out / "config.toml"
    if not path.is_file():
        raise UserError(f"{out} holds no run (no config.toml); start one with 'stocfl run --out {out}'")
    # never beside a run in progress: opening a store puts back rows newer than the checkpoint,
    # through the same memory map the running process writes (export, assign, a loaded run)
    with exclusive(out), store.read_only() if read_only else contextlib.nullcontext():
        return _open_saved(out, path, data_dir, executor, federation, module, loss, overrides)


def _open_saved(out, path, data_dir, executor, federation, module, loss, overrides) -> Experiment:
    raw = read_config(out, data_dir)
    if not raw:
        raise UserError(f"{path} is empty; the run's configuration is lost: restore the file or start a new run")
    cfg = configure.validate(raw)
    given = {"federation": federation is not None, "model": module is not None, "loss": loss is not None}
    has_checkpoint = (out / CHECKPOINT).exists()
    if has_checkpoint:  # before anything is built from a config that may not be the run's
        meta = provenance.read_meta(out)
        provenance.check_config(meta, cfg, path)
        provenance.check_given_in_python(meta, out, given)
    if overrides:
        with exclusive(out):
            cfg = provenance.extended(cfg, overrides, meta["round"] if has_checkpoint else 0, out)
    exp = Experiment(cfg, out, executor, federation, module, loss)
    if has_checkpoint:
        provenance.check_given(meta, exp.digests, out, cfg, given["federation"])
        exp.load_checkpoint()
    return exp


def resume(
    out: str | Path,
    data_dir: str | None = None,
    executor: Any = None,
    federation: Federation | None = None,
    module: Any = None,
    loss: Any = None,
    overrides: list[str] = (),
) -> Experiment:
    """A saved run, ready to continue: its metrics must be the ones its checkpoint saw (rows
    after the checkpoint's round, from a kill before the checkpoint, are dropped).
    ``overrides``: as for :func:`open_saved` (``run.rounds=N`` extends a finished run)."""
    out = Path(out)
    if (out / "config.toml").is_file() and not (out / CHECKPOINT).exists():
        raise UserError(
            f"{out} has no checkpoint ({CHECKPOINT}), so there is nothing to continue from; start "
            f"the run again into a new directory"
        )
    with exclusive(out) if out.is_dir() else contextlib.nullcontext():  # not read while another process writes
        exp = open_saved(out, data_dir, executor, federation, module, loss, overrides)
        exp.rows, exp.metrics_chain = provenance.checked_rows(out, exp.round, exp.metrics_chain)
        return exp
