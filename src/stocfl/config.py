"""The run configuration: six sections, every key validated, documented and defaulted here.

A config is TOML with the sections ``[run]``, ``[scenario]``, ``[model]``, ``[train]``,
``[aggregation]`` and ``[algorithm]``; command-line overrides use dotted keys (``--set
run.rounds=5``). Every error becomes one :class:`~stocfl.errors.UserError` line naming the key and
what it must be.

This module sits at the bottom of the package and knows no registry: names that a registry
holds (an engine, a scenario, a data set, a model, an algorithm) and the algorithm's own
parameters are checked where the run is built, by :func:`stocfl.experiment.configure.settle`,
which validates ``[algorithm]`` once into the algorithm's typed ``Params`` (:attr:`Config.params`).
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from stocfl.bounds import MAX_COUNT, MAX_EPOCHS, MAX_HIDDEN, MAX_LR, MAX_WEIGHT
from stocfl.errors import UserError


class Section(BaseModel):
    """Strict: unknown keys are errors, a string is never read as a number, no inf or NaN."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)


class RunConfig(Section):
    rounds: int = Field(20, ge=1, le=MAX_COUNT, description="communication rounds T")
    sample_rate: float = Field(0.1, gt=0, le=1, description="fraction of clients sampled per round; m = ceil(rate * N)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seeds data split, model init, sampling and local SGD")
    eval_every: int = Field(1, ge=1, le=MAX_COUNT, description="evaluate all clients every k rounds (and at the end)")
    eval_rounds: list[int] = Field(
        [],
        description="rounds evaluated besides every eval_every-th and the last, increasing (the rounds a table "
        "reads, with a sparser eval_every for its curves)",
    )
    target_accuracy: float = Field(
        0.0,
        ge=0,
        le=1,
        description="each evaluation records the share of clients whose own accuracy reaches it (clients_at_target; "
        "FL+HC's 'clients reaching the target'); 0 = not recorded",
    )
    engine: str = Field(
        "auto",
        description="executor of client tasks: sequential, parallel (the sequential loop in one worker process "
        "per thread, one thread each), batched, lowrank (exact low-rank training of a dense first layer); auto picks "
        "one by a cost model; flower-sim sends them as Flower messages (simulation "
        "engine); or a registered engine",
    )
    threads: int = Field(0, ge=0, le=1024, description="torch threads; 0 = the free cores of this machine")
    device: str = Field(
        "auto",
        description="where client work runs: auto (cuda when present, else cpu), cpu, cuda, cuda:N or mps; "
        "the server's state stays on the cpu",
    )
    client_timeout: float = Field(
        0.0,
        ge=0,
        le=7 * 86400,
        description="Flower engines: seconds to wait for the replies to one task list; clients that "
        "miss it are dropped from the round (0 = wait without limit)",
    )
    chunk_size: int = Field(
        0, ge=0, le=MAX_COUNT, description="clients per batched computation (batched engine); 0 = from a memory budget"
    )
    factored_replies: bool = Field(
        False,
        description="lowrank engine: each trained reply kept as its low-rank factors (first layer "
        "alpha W_0 + beta C + A^T X), on the device it trained on, and averaged from them in one product, never "
        "formed as a dense model unless the algorithm reads it; the same training, aggregates that differ in the "
        "last bits (another order of float32 sums)",
    )
    store_ram: int = Field(
        2048,
        ge=0,
        le=2**30,
        description="MiB a per-client store (Ditto's personal models, FeSEM's local ones) may take in memory; "
        "a larger one is a file mapped from the run directory (its rows read and written as clients are sampled)",
    )
    tensorboard: bool = Field(
        False,
        description="also write each round's figures as TensorBoard scalars into DIR/tensorboard (needs "
        "pip install 'stocfl[tensorboard]')",
    )
    sim_nodes: int = Field(
        0,
        ge=0,
        le=MAX_COUNT,
        description="flower-sim: simulated SuperNodes, node i serving clients i, i+k, i+2k, ... "
        "(one message per node and kind of task); 0 = one SuperNode per client",
    )
    node_wait: float = Field(
        120.0,
        gt=0,
        le=7 * 86400,
        description="Flower engines: before round 1, seconds to wait for the next client node to say "
        "which clients it serves; the wait starts again at each node that answers, so a busy machine "
        "that is still starting its nodes is waited for",
    )

    @field_validator("device")
    @classmethod
    def _device_name(cls, v):
        from stocfl.devices import DEVICE

        if not DEVICE.match(v):
            raise ValueError(f"unknown device {v!r}; choose auto, cpu, cuda, cuda:N or mps")
        return v

    def evaluates(self, t: int) -> bool:
        """Whether round ``t`` ends with an evaluation: every eval_every-th, the last, and eval_rounds."""
        return t % self.eval_every == 0 or t == self.rounds or t in self.eval_rounds


class ScenarioConfig(Section):
    name: str = Field("rotated", description="non-IID scenario: one of the built-ins or a registered one")
    dataset: str = Field("digits", description="source data set (digits needs no files) or a registered one")
    data_dir: str = Field("", description="directory of the data sets; empty = $STOCFL_DATA_DIR (digits needs none)")
    n_clients: int = Field(40, ge=1, le=MAX_COUNT, description="number of clients N (writers: number of writers)")
    samples_per_client: int = Field(
        30,
        ge=1,
        le=MAX_COUNT,
        description="train samples per client |D| (dirichlet, quantity: the mean; writers: a cap)",
    )
    test_per_client: int = Field(
        0,
        ge=0,
        le=MAX_COUNT,
        description="test samples per client; 0 = an equal share of the group's test pool, at most |D|",
    )
    alpha: float = Field(
        0.5,
        ge=1e-3,
        le=1e6,
        description="Dirichlet concentration: over labels (dirichlet), over groups (*_mixture), over sizes (quantity)",
    )
    severity: int = Field(3, ge=1, le=5, description="corruption severity 1..5 (corrupted, corrupted_mixture)")
    validation: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="tuning: this fraction of each client's train samples is held out and used as its test data "
        "(the test data unused); 0 = off",
    )
    holdout: float = Field(
        0.0, ge=0, lt=1, description="fraction of clients kept out of training and placed as new clients at the end"
    )
    present_at_start: float = Field(
        1.0,
        gt=0,
        le=1,
        description="share of the training clients present from round 1 (drawn by the seed); the rest join "
        "at join_rounds",
    )
    join_rounds: list[int] = Field(
        [], description="rounds (>= 2) at which the clients not present at the start join, in equal parts"
    )
    leave: float = Field(0.0, ge=0, lt=1, description="share of the clients present at the start that leave")
    leave_rounds: list[int] = Field([], description="rounds (>= 2) at which the leaving clients go, in equal parts")
    drift: str = Field(
        "",
        description="clients whose data change concept during the run: sudden, incremental or recurrent "
        "('' = none; rotated, shifted, label_swap, permuted_labels, corrupted)",
    )
    drift_rounds: list[int] = Field(
        [], description="rounds (>= 2) of the changes: sudden one, incremental one per part, recurrent away/back"
    )
    drift_share: float = Field(0.5, gt=0, le=1, description="share of each group's clients whose data drift")
    drift_notice: bool = Field(
        True, description="clients tell the server when their data changed (methods with one-off summaries redo them)"
    )

    @field_validator("data_dir")
    @classmethod
    def _usable_path(cls, v):
        if "\x00" in v:
            raise ValueError("a path may not hold a NUL character")
        return v


class ModelConfig(Section):
    name: str = Field(
        "auto",
        description="auto = digits_mlp on digits, mlp on 28x28 data, cifar_cnn on CIFAR-10; or a registered model",
    )
    hidden: int = Field(200, ge=1, le=MAX_HIDDEN, description="hidden width of the mlp (the paper's MNIST model: 2048)")


class TrainConfig(Section):
    epochs: int = Field(2, ge=1, le=MAX_EPOCHS, description="local epochs E")
    batch_size: int = Field(10, ge=0, le=MAX_COUNT, description="local batch size B; 0 = full batch")
    lr: float = Field(0.1, gt=0, le=MAX_LR, description="local learning rate eta")
    optimizer: Literal["sgd", "adam"] = Field(
        "sgd", description="local optimizer (torch.optim.SGD or Adam semantics), fresh state in every local training"
    )
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd: momentum (no dampening, no Nesterov)")
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT, description="L2 weight decay added to the gradient")
    betas: list[float] = Field([0.9, 0.999], description="adam: [beta1, beta2], each in [0, 1)")
    local_bn: bool = Field(
        False,
        description="FedBN: every BatchNorm layer's weights and statistics stay with the client (needs a model "
        "with BatchNorm)",
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, v):
        if len(v) != 2 or not all(0 <= b < 1 for b in v):
            raise ValueError("expected [beta1, beta2], each in [0, 1)")
        return v


RULES: tuple[str, ...] = ("mean", "clip", "median", "trimmed_mean")  # stocfl.algorithms.aggregation's rules


class AggregationConfig(Section):
    rule: Literal[RULES] = Field(
        "mean",
        description="how the server combines trained models: mean (weighted by |D_i|), clip (updates "
        "clipped to clip_norm, then the weighted mean), median or trimmed_mean (coordinate-wise, unweighted)",
    )
    clip_norm: float = Field(
        0.0,
        ge=0,
        le=MAX_WEIGHT,
        description="clip: largest update norm; 0 = the median update norm of each aggregation",
    )
    trim: float = Field(0.1, ge=0, lt=0.5, description="trimmed_mean: fraction of values dropped at each end")


class Config(Section):
    run: RunConfig = RunConfig()
    scenario: ScenarioConfig = ScenarioConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    aggregation: AggregationConfig = AggregationConfig()
    algorithm: dict[str, Any] = Field(default_factory=lambda: {"name": "fedavg"})  # as given: name and parameters
    _params: Any = PrivateAttr(default=None)  # the algorithm's Params, once settled
    _settled_for: Any = PrivateAttr(default=None)  # the [algorithm] they were validated from

    @property
    def params(self) -> Any:
        """The algorithm's validated parameters (its ``Params``), set where the run is built
        (:func:`stocfl.experiment.configure.settle`); refused once ``[algorithm]`` has changed."""
        if not self.settled:
            raise UserError(
                "config: its [algorithm] is not checked yet (or changed since); pass the config through "
                "stocfl.experiment.configure.settle (stocfl.as_config does) before using it"
            )
        return self._params

    @property
    def settled(self) -> bool:
        return self._params is not None and self._settled_for == self.algorithm

    def settle_params(self, params: Any) -> None:
        """Keep ``params``, validated from the current ``[algorithm]`` (by ``settle``)."""
        self._params, self._settled_for = params, copy.deepcopy(self.algorithm)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config, every default filled in, the algorithm's included (what a run saves)."""
        out = self.model_dump(mode="json")
        out["algorithm"] = {"name": self.algorithm["name"], **self.params.model_dump(mode="json", by_alias=True)}
        return out


def one_line(err: ValidationError, prefix: tuple = ()) -> str:
    e = err.errors()[0]
    loc = prefix + tuple(str(p) for p in e["loc"])
    if len(e["loc"]) > 1 and re.fullmatch(
        r"int|float|str|bool|none|(literal|list|dict|function-\w+)\[.*\]", str(e["loc"][-1])
    ):
        # a key of several types (tau: a number or "auto"): pydantic names each type tried; say them together
        members = [x for x in err.errors() if x["loc"][:-1] == e["loc"][:-1]]
        wants = [
            x["ctx"]["expected"].replace("'", '"')
            if x["type"] == "literal_error"
            else _house_style(x).removeprefix("expected ")
            for x in members
        ]
        return f"config: {'.'.join(loc[:-1])}: expected {' or '.join(wants)} (got {e.get('input')!r})"
    key = ".".join(loc)
    if e["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        return f"config: unknown key '{key}'" + (f"; allowed keys here: {', '.join(allowed)}" if allowed else "")
    got = e.get("input")
    if e["type"] == "value_error" and "error" in e.get("ctx", {}):
        msg = str(e["ctx"]["error"])
        if isinstance(got, str) and repr(got) in msg:  # the validator's message names the value already
            return f"config: {key}: {msg.rstrip('.')}"
    else:
        msg = _house_style(e)
    return f"config: {key}: {msg.rstrip('.')} (got {got!r})"


_BOUNDS = {
    "greater_than_equal": ("ge", ">="),
    "less_than_equal": ("le", "<="),
    "greater_than": ("gt", ">"),
    "less_than": ("lt", "<"),
}
_EXPECTED = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "string": "a string",
    "list": "a list",
    "dict": "a table",
    "model": "a table",
    "tuple": "a list",
}


def _house_style(e: dict[str, Any]) -> str:
    """pydantic's error as the rest of stocfl says things: 'expected an integer', 'must be >= 1'."""
    kind, ctx = e["type"], e.get("ctx", {})
    if kind in _BOUNDS:
        name, op = _BOUNDS[kind]
        return f"must be {op} {ctx.get(name)}"
    if kind == "literal_error":
        return f"expected one of {ctx.get('expected', '')}".replace("'", "")
    base = kind.split("_")[0]
    if base in _EXPECTED and kind.endswith(("_type", "_parsing")):
        return f"expected {_EXPECTED[base]}"
    return e["msg"]


def _allowed_keys(section: tuple) -> list[str]:
    if not section:
        return list(Config.model_fields)
    if section[0] == "algorithm":
        return []
    field = Config.model_fields.get(section[0])
    return list(field.annotation.model_fields) if field is not None and len(section) == 1 else []


def validate(raw: dict[str, Any]) -> Config:
    """Validate a raw nested dict into a :class:`Config` (one-line UserError on failure): every
    section's keys; of ``[algorithm]`` only that its name is a string (its parameters are the
    algorithm's, checked by :func:`stocfl.experiment.configure.settle`)."""
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise UserError(one_line(err)) from None
    algo = dict(cfg.algorithm)
    name = algo.get("name", "fedavg")
    if not isinstance(name, str):
        raise UserError(f"config: algorithm.name: expected a string, the name of an algorithm (got {name!r})")
    cfg.algorithm = {"name": name, **{k: v for k, v in algo.items() if k != "name"}}
    check_schedule(cfg)
    check_drift(cfg)
    check_eval_rounds(cfg)
    return cfg


def check_eval_rounds(cfg: Config) -> None:
    """``run.eval_rounds`` increasing, each once, each in 1..run.rounds."""
    check_rounds("run.eval_rounds", cfg.run.eval_rounds, 1, cfg.run.rounds)


def check_rounds(key: str, rounds: list[int], first: int, last: int, why: str = "") -> None:
    """A list of rounds increasing, each once, each in ``first..run.rounds`` (= ``last``)."""
    if any(b <= a for a, b in zip(rounds, rounds[1:])):
        raise UserError(f"config: {key}: expected increasing rounds, each once (got {rounds!r})")
    if rounds and not first <= rounds[0] <= rounds[-1] <= last:
        raise UserError(f"config: {key}: every round must be in {first}..run.rounds = {last}{why} (got {rounds!r})")


def check_schedule(cfg: Config) -> None:
    """``[scenario]``'s schedule keys hold together: a share below 1 (or above 0) with its rounds
    and rounds only with it, each list increasing, every round in 2..run.rounds."""
    s, rounds = cfg.scenario, cfg.run.rounds
    for share, key, moving, what in (
        (s.present_at_start < 1, "join_rounds", s.join_rounds, "present_at_start < 1"),
        (s.leave > 0, "leave_rounds", s.leave_rounds, "leave > 0"),
    ):
        if share and not moving:
            raise UserError(f"config: scenario.{key}: {what} needs the rounds at which they move (got [])")
        if moving and not share:
            raise UserError(
                f"config: scenario.{key}: rounds given but nobody moves; set scenario."
                f"{what.split()[0]} ({what}) or drop {key} (got {moving!r})"
            )
        check_rounds(f"scenario.{key}", moving, 2, rounds, " (round 1 is the start)")


DRIFT_PATTERNS = ("sudden", "incremental", "recurrent")  # stocfl.data.drift


def check_pattern(pattern: str, rounds: list[int], share: float, where: str) -> None:
    """One line naming what is wrong with a drift pattern's rounds, else nothing."""
    need = {"sudden": "exactly one round", "incremental": "two rounds or more", "recurrent": "two rounds or more"}
    if pattern not in DRIFT_PATTERNS:
        raise UserError(
            f"config: {where}.drift = {pattern!r}: choose one of {', '.join(DRIFT_PATTERNS)} (or '' for none)"
        )
    count_ok = len(rounds) == 1 if pattern == "sudden" else len(rounds) >= 2
    if not count_ok:
        raise UserError(f"config: {where}.drift_rounds: drift = {pattern!r} needs {need[pattern]} (got {rounds!r})")
    if any(b <= a for a, b in zip(rounds, rounds[1:])):
        raise UserError(f"config: {where}.drift_rounds: expected increasing rounds, each once (got {rounds!r})")
    if not 0 < share <= 1:
        raise UserError(f"config: {where}.drift_share = {share!r}: expected a share in (0, 1]")


def check_drift(cfg: Config) -> None:
    """``[scenario]``'s drift keys hold together: a pattern with its rounds, rounds only with one,
    every round in 2..run.rounds."""
    s = cfg.scenario
    if not s.drift:
        if s.drift_rounds:
            raise UserError(
                f"config: scenario.drift_rounds: rounds given but no drift; set scenario.drift (sudden, "
                f"incremental, recurrent) or drop drift_rounds (got {s.drift_rounds!r})"
            )
        return
    check_pattern(s.drift, s.drift_rounds, s.drift_share, "scenario")
    if not 2 <= s.drift_rounds[0] <= s.drift_rounds[-1] <= cfg.run.rounds:
        raise UserError(
            f"config: scenario.drift_rounds: every round must be in 2..run.rounds = {cfg.run.rounds} (round 1 is "
            f"the start) (got {s.drift_rounds!r})"
        )


MAX_NESTING = 16  # arrays and inline tables inside each other: a config needs 2 (drift_rounds, betas)


def nesting(text: str) -> int:
    """The deepest nesting of TOML arrays and inline tables in ``text``, outside strings and
    comments: read by a scanner that cannot recurse, before the parser (which does)."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            quote = text[i : i + 3] if text[i : i + 3] in ('"""', "'''") else c
            i += len(quote)
            while i < n and text[i : i + len(quote)] != quote:
                i += 2 if (text[i] == "\\" and quote[0] == '"') else 1
            i += len(quote)
            continue
        if c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth = max(0, depth - 1)
        i += 1
    return deepest


def check_nesting(text: str, what: str) -> None:
    """One line, before any parsing, for text nested deeper than :data:`MAX_NESTING` (Python's
    TOML parser recurses per level: a 2 KB file of brackets was a RecursionError)."""
    if nesting(text) > MAX_NESTING:
        raise UserError(f"{what}: arrays or tables nested deeper than {MAX_NESTING} levels; a stocfl config needs 2")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value); the value is read as a TOML value, else as a string."""
    if not isinstance(text, str):
        raise UserError(f"--set {text!r:.80}: expected a string 'dotted.key=value'")
    if "=" not in text:
        raise UserError(f"--set {text!r}: expected dotted.key=value, e.g. --set run.rounds=5")
    key, value = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise UserError(f"--set {text!r}: empty key part; expected dotted.key=value")
    check_nesting(value, f"--set {key.strip()}")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    return parts, parsed


PACKAGED = Path(__file__).resolve().parent / "configs"  # the configs that ship with stocfl: the papers' settings


def packaged() -> dict[str, Path]:
    """The configs that ship with stocfl, by name (``stocfl config --list``)."""
    return {p.stem: p for p in sorted(PACKAGED.glob("*.toml"))}


def describe_packaged() -> str:
    """One line a packaged config: its name and the first line of its opening comment."""
    lines = []
    for name, path in packaged().items():
        words = " ".join(x.lstrip("# ").strip() for x in path.read_text().splitlines()[:6] if x.startswith("#"))
        first = re.split(r"\.\s+(?=[A-Z])", words)[0].rstrip(".")
        lines.append(f"{name:<28} {first if len(first) <= 100 else first[:99] + '...'}")
    return "\n".join(lines)


def resolve(path: str | Path) -> Path:
    """A config file: ``path`` where it is a file, else the packaged config of that name
    (``rotated_mnist_4800x50``, with or without ``.toml`` or a ``configs/`` in front)."""
    p = Path(path)
    if p.is_file():
        return p
    name = p.name.removesuffix(".toml")
    found = packaged()
    if name in found and (p.parent == Path(".") or p.parent.name == "configs"):
        return found[name]
    what = "is a directory" if p.is_dir() else "not found"
    raise UserError(
        f"config file {p} {what}; pass an existing TOML file or the name of a packaged config (stocfl config --list)"
    )


def load(path: str | Path | None = None, overrides: list[str] = (), data_dir: str | None = None) -> Config:
    """Read a TOML config (a path or a packaged config's name; None: the defaults), apply
    ``--set`` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = resolve(path)
        try:
            text = p.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark some editors write
            check_nesting(text, f"config file {p}")
            raw = tomllib.loads(text)
            if not raw:  # an empty file (or comments only) is a mistake more often than a wish for the defaults
                raise UserError(
                    f"config file {p} sets nothing; write its keys (stocfl config lists them), or run without a "
                    f"config for the defaults"
                )
        except tomllib.TOMLDecodeError as err:
            raise UserError(f"config file {p}: not valid TOML ({err}); fix the syntax") from None
        except UnicodeDecodeError:
            raise UserError(f"config file {p}: not UTF-8 text; pass a TOML file") from None
    return apply(raw, overrides, data_dir)


def apply(raw: dict[str, Any], overrides: list[str] = (), data_dir: str | None = None) -> Config:
    """``--set`` overrides applied to a config given as a nested dict (changed in place), then
    validated: what :func:`load` does once it has read the file."""
    given: dict[str, Any] = {}  # algorithm parameters the overrides set, in any order with the name
    for item in overrides:
        parts, value = parse_override(item)
        if parts == ["algorithm", "name"] and raw.get("algorithm", {}).get("name", "fedavg") != value:
            raw["algorithm"] = dict(given)  # another algorithm: the file's parameters were for the old one
        elif parts[0] == "algorithm" and len(parts) == 2:
            given[parts[1]] = value
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {item!r}: {part} is not a section")
        node[parts[-1]] = value
    if data_dir is not None:
        raw.setdefault("scenario", {})["data_dir"] = str(data_dir)
    return validate(raw)
