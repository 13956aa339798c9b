"""``stocfl export``: a run's models out, as PyTorch ``state_dict``s in safetensors.

Each found cluster's model (``cluster_N.safetensors``, N numbered as in clusters.csv) and the
global model (``global.safetensors``), at the run's last checkpoint, with ``models.json``
saying which file is which, who uses it, and the model to load it into; where clients predict
with a mixture of the cluster models (FedEM), ``mixtures`` gives each client's weights::

    import torch, stocfl
    module = stocfl.load_model("runs/a", cluster=0)       # the run's nn.Module, cluster 0's weights
    # or by hand, into the module the run trained:
    from safetensors.torch import load_file
    module.load_state_dict(load_file("runs/a/export/cluster_0.safetensors"))
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as to_bytes

from stocfl.client.mixture import Mixture
from stocfl.client.models import build_module
from stocfl.errors import UserError
from stocfl.experiment import metrics
from stocfl.experiment.loop import Experiment, client_models_in_parts
from stocfl.storage import formats
from stocfl.storage.files import exclusive, write_atomic

INDEX = "models.json"


def export_models(
    run_dir: str | Path,
    out: str | Path | None = None,
    data_dir: str | None = None,
    federation=None,
    module=None,
    loss=None,
) -> Path:
    """Write the models of the run in ``run_dir`` into ``out`` (default ``run_dir/export``) and
    return ``out``. A run on data or a model given in Python is opened with the same ones."""
    run_dir = Path(run_dir)
    with exclusive(run_dir) if run_dir.is_dir() else contextlib.nullcontext():  # no run writes while we read
        return _export(run_dir, out, data_dir, federation, module, loss)


def _export(run_dir: Path, out, data_dir, federation, module, loss) -> Path:
    exp = Experiment.open(run_dir, data_dir, federation=federation, module=module, loss=loss)
    out = Path(out) if out is not None else run_dir / "export"
    algorithm, model, fed = exp.algorithm, exp.model, exp.fed
    labels = algorithm.cluster_labels()
    models = algorithm.cluster_models()
    number = metrics.cluster_numbers(labels, models)
    entries: list[dict[str, Any]] = [{"file": "global.safetensors", "model": "global"}]  # global_accuracy's model
    weights = {"global.safetensors": algorithm.global_model()}
    for k, n in sorted(number.items(), key=lambda kv: kv[1]):
        if k not in models:
            continue
        members = np.flatnonzero(labels == k)
        name = f"cluster_{n}.safetensors"
        entry = {
            "file": name,
            "model": "cluster",
            "cluster": n,
            "id": k,
            "members": len(members),
            "clients": members.tolist(),
        }
        if fed.groups is not None and len(members):
            entry["true_groups"] = " ".join(f"{g}:{c}" for g, c in enumerate(np.bincount(fed.groups[members])) if c)
        entries.append(entry)
        weights[name] = models[k]
    out.mkdir(parents=True, exist_ok=True)
    for stale in _exported_files(out) - set(weights):  # an earlier export's clusters, numbered otherwise
        (out / stale).unlink(missing_ok=True)
    for name, w in weights.items():
        meta = {"stocfl": json.dumps({"run": str(run_dir.resolve()), "round": exp.round, "file": name})}
        write_atomic(out / name, to_bytes({n: t.contiguous() for n, t in model.state_dict(w).items()}, metadata=meta))
    cfg = exp.cfg
    index = {
        "run": str(run_dir.resolve()),
        "algorithm": cfg.algorithm["name"],
        "round": exp.round,
        "rounds": cfg.run.rounds,
        "new_client_uses": algorithm.placement,
        "module": None
        if exp.module is not None
        else {
            "name": cfg.model.name,
            "hidden": cfg.model.hidden,
            "input_shape": list(fed.input_shape),
            "n_classes": fed.n_classes,
        },
        "models": entries,
    }
    mixtures = _mixtures(exp, number)
    if mixtures:
        index["mixtures"] = mixtures
        index["mixture_rule"] = "p(y | x) = sum over the client's files of weight * softmax(that model(x))"
    if exp.module is not None:
        index["note"] = "the run's model was given in Python: load each state_dict into that nn.Module"
    formats.write_json(out / INDEX, index)
    return out


def _mixtures(exp: Experiment, number: dict[int, int]) -> dict[str, dict[str, float]]:
    """Client id -> {cluster file: weight} for every participant that predicts with a mixture
    of the cluster models (FedEM), so that the export rebuilds each client's predictor."""
    out: dict[str, dict[str, float]] = {}
    for part, models in client_models_in_parts(exp.algorithm, list(exp.fed.participants), exp.ask):
        for i, m in zip(part, models):
            if isinstance(m, Mixture):
                out[str(i)] = {f"cluster_{number[k]}.safetensors": float(p) for k, p in enumerate(m.weights)}
    return out


def _exported_files(out: Path) -> set[str]:
    """The model files an earlier export into ``out`` listed (none if there is no readable index)."""
    try:
        entries = json.loads((out / INDEX).read_text())["models"]
        return {e["file"] for e in entries if Path(e["file"]).name == e["file"] and e["file"].endswith(".safetensors")}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def load_model(path: str | Path, cluster: int | None = None) -> torch.nn.Module:
    """The run's ``nn.Module`` with the weights of cluster ``cluster`` (numbered as in
    clusters.csv) or, with None, of the global model. ``path``: an export directory, or a run
    directory holding one in ``export/``."""
    path = Path(path)
    if not (path / INDEX).is_file() and (path / "export" / INDEX).is_file():
        path = path / "export"
    if not (path / INDEX).is_file():
        raise UserError(f"{path} holds no exported models ({INDEX}); write them with 'stocfl export RUN_DIR'")
    again = f"write them again with 'stocfl export RUN_DIR --out {path}'"
    try:
        index = json.loads((path / INDEX).read_text())
        spec, entries = index.get("module"), index["models"]
        files = {e.get("cluster"): e["file"] for e in entries} if cluster is not None else {None: "global.safetensors"}
        have = sorted(e["cluster"] for e in entries if e.get("cluster") is not None)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"{path / INDEX} is not an index stocfl export wrote; {again}") from None
    if spec is None:
        raise UserError(f"{path}: the run's model was given in Python; load the state_dict files into that module")
    if cluster not in files:
        raise UserError(
            f"cluster {cluster} is not among the exported models of {path} (clusters: "
            f"{', '.join(map(str, have)) or 'none'}); omit cluster for the global model"
        )
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        module = build_module(spec["name"], tuple(spec["input_shape"]), spec["n_classes"], spec["hidden"])
    except ValueError as err:  # a model registered in the run's process but not in this one
        raise UserError(
            f"{path}: {err}; a model registered with stocfl.register_model must be registered again before loading"
        ) from None
    try:
        module.load_state_dict(load_file(str(path / files[cluster])))
    except (OSError, RuntimeError, ValueError, SafetensorError) as err:  # missing or truncated, or another model
        raise UserError(
            f"{path / files[cluster]}: cannot load it into model {spec['name']!r} ({str(err).splitlines()[0]}); {again}"
        ) from None
    return module.eval()
