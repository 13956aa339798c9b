"""The config meets the registries, where a run is built: the names a registry holds (an engine,
a scenario, a data set, a model, an algorithm) are checked and the algorithm's parameters
validated once into its typed ``Params`` (:func:`settle`); and the reference of every key, the
algorithms' included, that ``stocfl config`` prints and the docs render.

:mod:`stocfl.config` (the schema, below every registry) checks each section's own keys;
:func:`load`, :func:`apply` and :func:`validate` here are its functions followed by :func:`settle`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from stocfl import config as schema
from stocfl.algorithms import ALGORITHMS
from stocfl.client.models import MODELS
from stocfl.config import Config, one_line
from stocfl.data.datasets import DATASETS
from stocfl.data.scenarios import SCENARIOS
from stocfl.errors import UserError
from stocfl.executors import ENGINES


def _choice(key: str, value: str, names, what: str) -> None:
    if value not in names:
        raise UserError(f"config: {key}: unknown {what} {value!r}; choose one of {', '.join(names)}")


def settle(cfg: Config) -> Config:
    """``cfg`` with its registry names checked and ``[algorithm]`` validated into the
    algorithm's ``Params`` (:attr:`Config.params`), in one line naming the key on failure; a
    config settled before keeps its ``Params``."""
    _choice("run.engine", cfg.run.engine, ENGINES, "engine")
    _choice("scenario.name", cfg.scenario.name, SCENARIOS, "scenario")
    _choice("scenario.dataset", cfg.scenario.dataset, DATASETS, "data set")
    _choice("model.name", cfg.model.name, ("auto", *MODELS), "model")
    name = cfg.algorithm["name"]
    if name not in ALGORITHMS:
        raise UserError(f"config: algorithm.name: unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
    if cfg.settled:
        return cfg
    cls = ALGORITHMS[name]
    try:
        params = cls.Params.model_validate({k: v for k, v in cfg.algorithm.items() if k != "name"})
    except ValidationError as err:
        e = err.errors()[0]
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(["name", *(f.alias or k for k, f in cls.Params.model_fields.items())])
            raise UserError(
                f"config: unknown key 'algorithm.{e['loc'][0]}' for {name}; allowed keys: {allowed}"
            ) from None
        raise UserError(one_line(err, ("algorithm",))) from None
    cfg.settle_params(params)
    return cfg


def load(path: str | Path | None = None, overrides: list[str] = (), data_dir: str | None = None) -> Config:
    """A TOML config (a path or a packaged config's name; None: the defaults) with ``--set``
    overrides, validated and settled (:func:`stocfl.config.load`, then :func:`settle`)."""
    return settle(schema.load(path, overrides, data_dir))


def apply(raw: dict[str, Any], overrides: list[str] = (), data_dir: str | None = None) -> Config:
    """:func:`stocfl.config.apply`, then :func:`settle`."""
    return settle(schema.apply(raw, overrides, data_dir))


def validate(raw: dict[str, Any]) -> Config:
    """:func:`stocfl.config.validate`, then :func:`settle`."""
    return settle(schema.validate(raw))


def _choices(f) -> str:
    """The values a Literal field takes, as ' (one of: a, b)'; '' for other fields."""
    from typing import get_args, get_origin

    ann = f.annotation
    args = get_args(ann) if get_origin(ann) is Literal else ()  # a float or 'auto' says so in its text
    return f" (one of: {', '.join(map(str, args))})" if args else ""


def _toml(value) -> str:
    """A default as it is written in a TOML config (true, "auto", 0.01)."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def reference() -> list[tuple[str, str, str, str]]:
    """Every key as (section, key, default as TOML, meaning): the configuration reference that
    ``stocfl config`` prints and the docs render."""
    entries: list[tuple[str, str, str, str]] = []
    for section, field in Config.model_fields.items():
        if section == "algorithm":
            continue
        for key, f in field.annotation.model_fields.items():
            extra = f"; now: {', '.join(SCENARIOS)}" if (section, key) == ("scenario", "name") else _choices(f)
            entries.append((section, key, _toml(f.default), f"{f.description}{extra}"))
    entries.append(("algorithm", "name", '"fedavg"', f"one of: {', '.join(ALGORITHMS)}"))
    for name, cls in ALGORITHMS.items():
        for key, f in cls.Params.model_fields.items():
            entries.append(("algorithm", f.alias or key, _toml(f.default), f"({name}) {f.description}{_choices(f)}"))
    return entries


def describe() -> str:
    """Every key with its default and meaning, in aligned columns (``stocfl config``)."""
    entries = reference()
    kw = max(len(e[1]) for e in entries)
    vw = max(len(e[2]) for e in entries)
    lines, section = [], None
    for sec, key, default, meaning in entries:
        if sec != section:
            lines.append(f"[{sec}]")
            section = sec
        lines.append(f"  {key:<{kw}} = {default:<{vw}}  # {meaning}")
    return "\n".join(lines)
