"""What ties a results directory to the run that wrote it, so that a resume continues that run
and nothing else: the digests of its config (whole, and without the keys a resume may extend),
the keys added since checkpoints began to store them (with the defaults that keep older digests),
a hash chain over its metrics rows, the digests of the data, model and loss it ran on, and the
checks that compare each of them with what a resume is given. Every mismatch is one
:class:`~stocfl.errors.UserError` line saying what to restore or pass."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stocfl import config as schema
from stocfl.config import Config
from stocfl.errors import UserError
from stocfl.experiment import configure
from stocfl.experiment.build import read_config
from stocfl.storage import checkpoint, formats
from stocfl.storage.files import write_atomic
from stocfl.storage.store import FILE_SUFFIXES

CHECKPOINT = "checkpoint.safetensors"

# The checkpoint's format. 2: it says so, and carries every digest below (and, once the run has
# finished, its summary's); a checkpoint without a "format" is of format 1, written before
# checkpoints declared a format, whose digests are checked where they are present.
FORMAT = 2
DIGESTS = ("config_sha256", "config_core_sha256", "metrics_sha256", "data_sha256")

# Keys a resumed run may change: they change nothing computed in the rounds already done (and
# leave the checkpoint's core digest as it was before they existed).
EXTENDABLE = ("run.rounds", "run.eval_every", "run.tensorboard", "run.node_wait", "run.store_ram")

# Keys added after checkpoints began to store a digest of the whole config, with the default
# that reproduces the behaviour before them.
ADDED_KEYS = {
    "run.tensorboard": False,
    "run.target_accuracy": 0.0,
    "run.eval_rounds": [],
    "algorithm.cluster_start": "global",
    "algorithm.cluster_warmup": 0,
    "algorithm.chain": False,
    "scenario.severity": 3,
    "algorithm.similarity": "updates",
    "scenario.present_at_start": 1.0,
    "scenario.join_rounds": [],
    "scenario.leave": 0.0,
    "scenario.leave_rounds": [],
    "scenario.drift": "",
    "scenario.drift_rounds": [],
    "scenario.drift_share": 0.5,
    "scenario.drift_notice": True,
    "run.node_wait": 120.0,
    "algorithm.quorum": 0.0,
    "algorithm.quorum_tau": 0.35,
    "scenario.validation": 0.0,
    "run.store_ram": 2048,
    "run.factored_replies": False,
}

GIVEN = (("custom_data", "federation"), ("custom_model", "model"), ("custom_loss", "loss"))


def config_digest(cfg: Config, core: bool = False) -> str:
    """SHA-256 of the resolved config, the data directory left out (data may move); ``core``:
    the keys in :data:`EXTENDABLE` left out as well."""
    d = configure.settle(cfg).to_dict()
    d["scenario"] = {k: v for k, v in d["scenario"].items() if k != "data_dir"}
    for key, default in ADDED_KEYS.items():  # at its default, a newer key leaves an older run's digest as it was
        section, name = key.split(".")
        if d[section].get(name) == default:
            d[section].pop(name)
    if core:
        d["run"] = {k: v for k, v in d["run"].items() if f"run.{k}" not in EXTENDABLE}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def metrics_chain(rows: list[dict[str, Any]], start: str | None = None) -> str:
    """A hash chain over metrics rows as written (one JSON line each): the checkpoint stores
    the chain of the rows it saw, so that resume can tell an edited or cut metrics file."""
    h = start or hashlib.sha256(b"stocfl metrics").hexdigest()
    for r in rows:
        h = hashlib.sha256((h + formats.json_line(r)).encode()).hexdigest()
    return h


def digests(fed, model, w0: torch.Tensor, module: Any = None, loss: Any = None) -> dict[str, Any]:
    """What identifies the run's data (built from its config or given in Python), and the
    model and loss given in Python: the sha256 of the data, and of the model's parameter
    names and shapes with w_0 (StoCFL's Psi and FeSEM's start use w_0 in later rounds); a
    loss, which has no digest, by its values on four train samples at w_0."""
    digest = probe = None
    if module is not None:
        layout = [(k, tuple(v.shape), str(v.dtype)) for k, v in module.state_dict().items()]
        digest = hashlib.sha256(repr(layout).encode() + w0.detach().cpu().numpy().tobytes()).hexdigest()
    if loss is not None:
        with torch.no_grad():
            x, y = fed.x_train[:4], fed.y_train[:4]
            probe = [float(v) for v in model.per_sample_loss(model.forward(w0, x), y)]
    return {"data_sha256": fed.digest(), "model_sha256": digest, "loss_probe": probe}


def config_digests(cfg: Config) -> dict[str, str]:
    """The config's two digests a checkpoint stores: of all of it, and of its core (what
    changes the numbers)."""
    return {"config_sha256": config_digest(cfg), "config_core_sha256": config_digest(cfg, core=True)}


def stamp(configs: dict[str, str], chain: str | None, mine: dict[str, Any], given: dict[str, bool]) -> dict[str, Any]:
    """The provenance a checkpoint stores: the config's digests (``configs``, from
    :func:`config_digests`), the metrics chain, the data's digest and, for what was given in
    Python (``given``: federation, model, loss), a flag and its digest."""
    return {
        "format": FORMAT,
        **configs,
        "metrics_sha256": chain,
        "data_sha256": mine["data_sha256"],
        **({"custom_data": True} if given["federation"] else {}),
        **({"custom_model": True, "model_sha256": mine["model_sha256"]} if given["model"] else {}),
        **({"custom_loss": True, "loss_probe": mine["loss_probe"]} if given["loss"] else {}),
    }


def check_format(meta: Any, path: Path) -> dict[str, Any]:
    """``meta`` (a checkpoint's state, read from ``path``) when this version reads its format
    and it carries what its format requires; else one line."""
    fmt = meta.get("format", 1) if isinstance(meta, dict) else None
    if fmt not in (1, FORMAT) or isinstance(fmt, bool):
        raise UserError(
            f"checkpoint {path} is in a format this version of stocfl does not read ({fmt!r}); resume it with "
            f"the version that wrote it, or start a new run"
        )
    missing = [k for k in DIGESTS if fmt >= 2 and not isinstance(meta.get(k), str)]
    if missing:
        raise UserError(
            f"checkpoint {path} lacks {', '.join(missing)}, which its format ({fmt}) carries: it was edited; the "
            f"run cannot resume from it"
        )
    return meta


def read_meta(out: Path) -> dict[str, Any]:
    """The state of ``out``'s checkpoint, its format checked (not its tensors)."""
    return check_format(checkpoint.read_meta(out / CHECKPOINT), out / CHECKPOINT)


def check_config(meta: dict[str, Any], cfg: Config, path: Path) -> None:
    """The config read from ``path`` must be the one the checkpoint (``meta``) was written with."""
    core, stored = meta.get("config_core_sha256"), meta.get("config_sha256")
    if (core is not None and core != config_digest(cfg, core=True)) or (
        core is None and stored is not None and stored != config_digest(cfg)
    ):
        raise UserError(
            f"{path} does not match the run's checkpoint (edited, truncated or corrupt); restore it or start a new run"
        )


def check_given_in_python(meta: dict[str, Any], out: Path, given: dict[str, bool]) -> None:
    """A run started on a federation, model or loss given in Python continues only from Python,
    with them given again."""
    for key, what in GIVEN:
        if meta.get(key) and not given[what]:
            raise UserError(
                f"{out} was run on a {what} given in Python; continue it from Python with "
                f"stocfl.resume({str(out)!r}, {what}=...)"
            )


def check_given(meta: dict[str, Any], mine: dict[str, Any], out: Path | None, cfg: Config, fed_given: bool) -> None:
    """A run continues only on the data it started on, and on the model and loss it was
    given in Python (checkpoints written before these digests are taken as they are)."""
    if meta.get("data_sha256") not in (None, mine["data_sha256"]):
        if fed_given:
            raise UserError(
                f"{out}: the federation given is not the one the run started on (its data, clients "
                f"or classes differ); pass the same Federation to stocfl.resume, or start a new run"
            )
        raise UserError(
            f"{out}: the data built from its config ({cfg.scenario.dataset} in "
            f"{cfg.scenario.data_dir or 'the package'}) differ from the data the run started on; "
            f"point --data-dir at the run's copy of the data set, or start a new run"
        )
    if meta.get("model_sha256") not in (None, mine["model_sha256"]):
        raise UserError(
            f"{out}: the model given is not the one the run started on (its parameters' names, "
            f"shapes or initial weights w_0 differ); pass the same nn.Module, initialised with the "
            f"same seed, to stocfl.resume, or start a new run"
        )
    probe, mine_probe = meta.get("loss_probe"), mine["loss_probe"]
    if probe is not None and mine_probe is not None and not np.allclose(probe, mine_probe, rtol=1e-4, atol=1e-6):
        raise UserError(
            f"{out}: the loss given is not the one the run started on (on the same samples and "
            f"w_0 it gives {mine_probe[0]:.6g}, the run's gave {probe[0]:.6g}); pass the same loss to "
            f"stocfl.resume, or start a new run"
        )


def checked_rows(out: Path, done: int, chain: str | None) -> tuple[list[dict[str, Any]], str]:
    """The metrics rows of the ``done`` rounds a checkpoint saw, and their chain: they must be
    the ones it saw (``chain``; None: a checkpoint from before chains). Rows after its round,
    from a kill before the checkpoint, are dropped from the file."""
    rows = formats.read_jsonl(out / "metrics.jsonl")
    kept = rows[:done]
    if [r.get("round") for r in kept] != list(range(1, done + 1)) or (
        chain is not None and metrics_chain(kept) != chain
    ):
        raise UserError(
            f"{out}/metrics.jsonl does not match the run's checkpoint at round {done} (rows "
            f"missing, edited or corrupt); restore it or start a new run"
        )
    if (out / "metrics.jsonl").read_bytes() != formats.jsonl_bytes(kept):  # any tail: later rows, a cut row, NULs
        formats.write_jsonl(out / "metrics.jsonl", kept)
    return kept, chain if chain is not None else metrics_chain(kept)


def with_extensions(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``raw`` (a config as a dict, changed in place) with ``overrides`` of :data:`EXTENDABLE`
    keys applied; other keys are refused in one line."""
    for item in overrides:
        parts, value = schema.parse_override(item)
        if ".".join(parts) not in EXTENDABLE:
            raise UserError(
                f"resume --set {item!r}: a resumed run may change only {', '.join(EXTENDABLE)}; other "
                f"keys would change what it computed: start a new run with 'stocfl run'"
            )
        raw.setdefault("run", {})[parts[1]] = value
    return raw


def extended(cfg: Config, overrides: list[str], done: int, out: Path) -> Config:
    """``cfg`` with ``overrides`` of :data:`EXTENDABLE` keys applied, written to ``out``'s
    config.toml. Other keys, or fewer rounds than are done, are refused in one line."""
    new = configure.validate(with_extensions(cfg.to_dict(), overrides))
    if new.run.rounds < done:
        raise UserError(
            f"resume --set run.rounds={new.run.rounds}: the run has done {done} rounds already; ask for {done} or more"
        )
    write_atomic(out / "config.toml", formats.to_toml(new.to_dict()))
    return new


def finished_summary(out: Path) -> dict[str, Any] | None:
    """The summary of the run in ``out`` when it has done every round of its config, else None.
    A finished run whose checkpoint was left behind (to carry its results off a machine) is
    still finished: its summary, metrics and clients hold its numbers."""
    try:
        summary = json.loads((out / "summary.json").read_text())
        rounds = read_config(out)["run"]["rounds"]
        meta = read_meta(out) if (out / CHECKPOINT).exists() else {"round": summary.get("rounds_done")}
    except Exception:  # noqa: BLE001 - anything unreadable: not a finished run; resume says what is wrong
        return None
    if any(meta.get(k) for k, _ in GIVEN):
        return None  # run from Python: resume names what it needs
    stored = meta.get("summary_sha256")  # format 1 checkpoints from before it: taken as they are
    if (stored is None and meta.get("format", 1) >= 2) or (
        stored is not None and hashlib.sha256((out / "summary.json").read_bytes()).hexdigest() != stored
    ):
        return None  # edited since the run wrote it: not a finished run's summary (resume writes it anew)
    return summary if summary.get("rounds_done") == summary.get("rounds") == rounds == meta.get("round") else None


# what a run's directory holds only to go on with it: its checkpoint and its client stores'
# files (their rows, journals, snapshots and undo logs); its results files are the rest
STATE_FILES = (CHECKPOINT, *(f"*{suffix}" for suffix in FILE_SUFFIXES))


def shed_state(out: Path) -> int:
    """Remove the state of the finished run in ``out`` (:data:`STATE_FILES`), keeping its config,
    metrics, summary, per-client tables and figures; returns the bytes freed. A finished run
    without its checkpoint is still read as finished (:func:`finished_summary`), so it is reused,
    not run again; a run of personal models would otherwise keep every client's model on disk.
    A run not finished keeps everything: its state is what resumes it."""
    if finished_summary(out) is None:
        return 0
    freed = 0
    for pattern in STATE_FILES:
        for f in out.glob(pattern):
            if f.is_file() and not f.is_symlink():
                freed += f.stat().st_size
                f.unlink()
    return freed
