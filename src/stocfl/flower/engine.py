"""Flower as the transport: the same algorithm code, client tasks sent as Flower messages.

The server side is a ServerApp whose ``main`` runs the ordinary :class:`~stocfl.experiment.loop.Experiment`
loop with a :class:`FlowerExecutor`; each SuperNode runs a ClientApp that answers the tasks of
the clients it serves with the in-process sequential executor. :func:`simulate` runs this on
Flower's simulation engine (``flower-sim``); :func:`deployed_main` and
:func:`deployed_client_config` are the bodies of the deployment app (``flower_app/``). The
server never reads partition ids from Flower: it asks every node it has not seen
("query.identify") which clients it serves and keys everything by client id.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from stocfl.client.tasks import ClientsDropped, Reply, Task
from stocfl.errors import UserError
from stocfl.executors.base import check_reply_memory
from stocfl.flower.codec import (
    BadReply,
    client_ids,
    decode_results,
    decode_tasks,
    encode_results,
    encode_tasks,
    message_type,
    message_types,
)

NODE_WAIT_SECONDS = 120.0
POLL_SECONDS = 0.5  # longest pause between pulls (Grid.send_and_receive waits 3 s on a deployment)

log = logging.getLogger(__name__)


class KnownNoise(logging.Filter):
    """Drops the lines Flower prints on every simulated run that say nothing about this run.

    ``run_simulation`` is deprecated in favour of ``flwr run``, which starts the ServerApp in a
    process of its own: that cannot host our in-process driver (the runner, with a federation
    or model given in Python), so flower-sim keeps ``run_simulation`` and drops its banner;
    Ray's actors log "Manually terminating ClientAppActor" each at shutdown, which is the
    normal end. Every other Flower line passes."""

    DROPPED = ("The `run_simulation` function is deprecated", "Manually terminating")

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(d in text for d in self.DROPPED)


def quiet_known_noise() -> None:
    """Install :class:`KnownNoise` on Flower's logger (once per process: the driver and each
    Ray actor) and drop Ray's FutureWarning about accelerator variables, which concerns a
    future default and is printed on every ``ray.init``."""
    import warnings

    flwr_log = logging.getLogger("flwr")
    if not any(isinstance(f, KnownNoise) for f in flwr_log.filters):
        flwr_log.addFilter(KnownNoise())
    warnings.filterwarnings(
        "ignore", message="Tip: In future versions of Ray, Ray will no longer override", category=FutureWarning
    )


def canonical_key(key: bytes) -> bytes:
    """A public key in the form keys are compared in (DER SubjectPublicKeyInfo), from the PEM
    Flower stores or the OpenSSH line ``flwr supernode register`` reads; b"" if it is neither."""
    from cryptography.hazmat.primitives import serialization

    loaders = (serialization.load_pem_public_key, serialization.load_ssh_public_key, serialization.load_der_public_key)
    for load in loaders:
        try:
            return load(key.strip()).public_bytes(
                serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        except (ValueError, TypeError, AttributeError):  # not this form (or not a key at all)
            continue
    return b""


def read_node_keys(path: str, n_clients: int) -> dict[bytes, set[int]]:
    """The binding of clients to SuperNodes by public key, from the TOML file ``path``::

        [[node]]
        key = "/abs/keys/node0.pub"   # the public key file given to 'flwr supernode register'
        clients = "0-9,12"

    every client of the federation (0..n_clients-1) at most once. Anything else is one line."""
    import tomllib

    from stocfl.config import check_nesting

    where = f"run config node-keys={path!r}"
    try:
        text = Path(path).read_text(encoding="utf-8")
        check_nesting(text, where)
        nodes = tomllib.loads(text).get("node")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise UserError(f"{where} cannot be read ({err}); give the absolute path of a TOML file") from None
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, dict) for n in nodes):
        raise UserError(f'{where}: expected [[node]] tables, each with key = "<public key file>" and clients = "0-9"')
    out: dict[bytes, set[int]] = {}
    owner: dict[int, str] = {}
    for k, node in enumerate(nodes, 1):
        name, spec = node.get("key"), node.get("clients")
        if not isinstance(name, str) or not isinstance(spec, str) or set(node) - {"key", "clients"}:
            raise UserError(f'{where}: node {k} needs key = "<public key file>" and clients = "<ids>", nothing else')
        try:
            raw = Path(name).read_bytes()
        except OSError as err:
            raise UserError(f"{where}: node {k}: key {name!r} cannot be read ({err.strerror})") from None
        key = canonical_key(raw)
        if not key:
            raise UserError(f"{where}: node {k}: {name!r} is not a public key (OpenSSH or PEM)")
        if key in out:
            raise UserError(f"{where}: node {k}: key {name!r} is bound twice; bind each key once")
        clients: set[int] = set()
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            try:
                a, b = int(lo), int(hi or lo)
            except ValueError:
                raise UserError(
                    f'{where}: node {k}: clients = {spec!r}: expected ids and ranges, e.g. "0-9,12"'
                ) from None
            if not 0 <= a <= b < n_clients:
                raise UserError(
                    f"{where}: node {k}: clients = {spec!r}: ids must lie in 0..{n_clients - 1}, ranges lo-hi "
                    f"with lo <= hi"
                )
            clients.update(range(a, b + 1))
        twice = sorted(c for c in clients if c in owner)
        if twice:
            raise UserError(f"{where}: client {twice[0]} is bound to {owner[twice[0]]!r} and to {name!r}; bind it once")
        owner.update({c: name for c in clients})
        out[key] = clients
    return out


class FlowerExecutor:
    """Runs client tasks as Flower messages to the nodes that serve the clients: one message per
    node and kind of task (StoCFL's two train tasks of a client travel together, as do the
    tasks of all the clients one SuperNode serves).

    Before every batch of tasks the executor looks at the nodes online: a node that went
    offline no longer serves its client, and a node it has not seen is asked which client it
    serves, so a restarted SuperNode (which comes back with a new node id) serves its client
    again, and the client keeps its cluster. A client without a node, or whose node errs, sends
    a bad reply or misses ``timeout`` seconds, is reported in :class:`~stocfl.client.tasks.ClientsDropped`.
    """

    def __init__(
        self,
        grid: Grid,
        timeout: float | None = None,
        n_clients: int | None = None,
        node_keys: dict[bytes, set[int]] | None = None,
    ):
        self.grid, self.timeout = grid, timeout
        self.n_clients = n_clients  # the federation's clients are 0..n_clients-1 (None: not checked)
        # with SuperNode authentication: each registered public key (DER) -> the clients it serves
        # (read_node_keys); a client is then served by its key's node only, never taken over
        self.node_keys = node_keys
        self.key_of: dict[int, bytes] = {}  # online node id -> its public key (DER), with node_keys
        self.takeovers = 0  # clients handed to another node after theirs failed (without node_keys)
        self.node_of: dict[int, int] = {}  # client id -> node id
        self.seen: set[int] = set()  # online node ids already asked for their client id
        self.refusals: dict[int, str] = {}  # node id -> why it did not say which client it serves
        self.claims: dict[int, list[int]] = {}  # online node id -> the clients it says it serves
        self.refused: set[tuple[int, int]] = set()  # (node, client) claims refused so far
        self.failed: set[int] = set()  # nodes whose last reply did not come or was an error

    def connect(self, expected: int, wait: float = NODE_WAIT_SECONDS, simulated: bool = False) -> FlowerExecutor:
        """Wait until ``expected`` clients each have a node that said who it serves, while the
        nodes make progress: the run gives up after ``wait`` seconds in which no node came
        online or answered (a busy machine starting its nodes slowly is waited for, a
        federation whose nodes will not come is not). ``simulated``: the error speaks of
        Flower's simulation, not of SuperNodes to start."""
        last, progress = time.monotonic(), (-1, -1)
        while True:
            self.refresh(timeout=wait, idle=True)
            if len(self.node_of) >= expected:
                return self
            now = (len(self.seen), len(self.claims) + len(self.refusals))
            if now != progress:
                last, progress = time.monotonic(), now
            # a node that refused is not asked again: with too few others, waiting cannot help
            if time.monotonic() - last >= wait or (
                self.refusals and len(self.node_of) + len(self.refusals) >= expected
            ):
                raise UserError(self._not_connected(expected, wait, simulated))
            time.sleep(POLL_SECONDS)

    def _not_connected(self, expected: int, wait: float, simulated: bool) -> str:
        why = "".join(f"; node {n}: {r}" for n, r in list(self.refusals.items())[:1])
        if simulated:
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            return (
                f"only {len(self.node_of)} of {expected} simulated Flower clients answered, and none more "
                f"for {wait:g} s (load average {load:.1f} on {os.cpu_count()} CPUs): the machine may be too "
                f"busy to start them; run again with --set run.node_wait=<seconds> (now {wait:g}) or fewer "
                f"simulated nodes (run.sim_nodes){why}"
            )
        return (
            f"only {len(self.node_of)} of {expected} Flower clients connected, and none more for {wait:g} s; "
            f'start a SuperNode per client with --node-config "client-id=<i>", or wait longer with '
            f"run.node_wait{why}"
        )

    def refresh(self, timeout: float | None = None, idle: bool = False) -> None:
        """Forget nodes gone offline; ask nodes not seen before which clients they serve.

        A client is served by one node. A second node's claim on it is refused (and logged)
        while the serving node answers; it is kept, and granted (the most recent claim first)
        once the serving node goes offline or stops answering: that is how a restarted
        SuperNode, which comes back with a new node id while its old id may still be listed
        online, gets its client back."""
        if self.node_keys is not None:
            nodes = list(self.grid.get_nodes())
            self.key_of = {int(n.node_id): canonical_key(bytes(n.public_key)) for n in nodes}
            online = set(self.key_of)
        else:
            online = set(self.grid.get_node_ids())
        self.node_of = {c: n for c, n in self.node_of.items() if n in online}
        self.claims = {n: cs for n, cs in self.claims.items() if n in online}
        self.failed &= online
        self.seen &= online
        new = sorted(online - self.seen)
        self.seen |= set(new)  # a node that does not answer now is not asked again
        if new:
            self.identify(new, timeout, idle)
        for node, clients in reversed(list(self.claims.items())):  # the most recent claim first
            for client in clients:
                owner = self.node_of.get(client)
                if owner is None:
                    self.node_of[client] = node
                elif owner != node and owner in self.failed and self.node_keys is None:
                    self.takeovers += 1
                    log.warning(
                        "node %d takes over client %d from node %d, which failed to answer: without "
                        "SuperNode authentication (run config node-keys) any node may claim any client",
                        node,
                        client,
                        owner,
                    )
                    self.node_of[client] = node
                elif owner != node and (node, client) not in self.refused:
                    log.warning("node %d claims client %d, which node %d serves: refused", node, client, owner)
                    self.refused.add((node, client))

    @property
    def refused_claims(self) -> int:
        return len(self.refused)

    def counters(self) -> dict[str, int]:
        """What the run's metrics count of the nodes, so far: clients handed to another node
        after theirs failed (without node-keys), and claims on served clients refused."""
        return {"node_takeovers": self.takeovers, "refused_claims": self.refused_claims}

    def identify(self, new: list[int], timeout: float | None, idle: bool = False) -> None:
        """Ask nodes which clients they serve; their claims go to ``self.claims``."""
        queries = [Message(RecordDict(), dst_node_id=n, message_type="query.identify") for n in new]
        for node, reply in zip(new, self.exchange(queries, timeout or self.timeout or NODE_WAIT_SECONDS, idle)):
            try:
                if reply is None:
                    raise ValueError("no reply")
                if reply.has_error():
                    raise ValueError(reply.error.reason)
                clients = client_ids(reply.content["client"]["client_ids"], "client_ids")
                outside = [c for c in clients if self.n_clients is not None and not 0 <= c < self.n_clients]
                if outside:
                    raise ValueError(
                        f"it claims client ids {outside[:5]} outside the federation's 0..{(self.n_clients or 1) - 1}"
                    )
                if self.node_keys is not None:
                    bound = self.node_keys.get(self.key_of.get(node, b""))
                    if bound is None:
                        raise ValueError("its public key is not one of node-keys")
                    unbound = [c for c in clients if c not in bound]
                    if unbound:
                        raise ValueError(
                            f"it claims clients {unbound[:5]}, which node-keys binds to other keys (its own: "
                            f"{sorted(bound)[:5]})"
                        )
            except (KeyError, TypeError, ValueError) as err:
                self.refusals[node] = str(err) or type(err).__name__
                log.warning(
                    "Flower node %d did not say which clients it serves (%s); it gets no tasks",
                    node,
                    self.refusals[node],
                )
                continue
            self.claims[node] = clients

    def exchange(self, messages: list[Message], timeout: float | None, idle: bool = False) -> list[Message | None]:
        """Push ``messages``; their replies in the same order, None where none came within
        ``timeout`` (``idle``: within ``timeout`` of the previous reply)."""
        ids = list(self.grid.push_messages(messages))
        pending = {i: k for k, i in enumerate(ids) if i is not None}
        out: list[Message | None] = [None] * len(messages)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.01  # simulated clients answer in milliseconds, deployed ones in seconds
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                k = pending.pop(reply.metadata.reply_to_message_id, None)
                if k is not None:
                    out[k] = reply
                    if idle and timeout is not None:
                        deadline = time.monotonic() + timeout
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            time.sleep(pause)
            pause = min(pause * 1.5, POLL_SECONDS)
        return out

    def execute(self, tasks: list[Task]) -> list[Reply]:
        check_reply_memory(tasks)  # the replies all come to this process
        self.refresh()
        why = {
            t.client: f"client {t.client}: no Flower node serves it (SuperNode offline?)"
            for t in tasks
            if t.client not in self.node_of
        }
        if why:  # send nothing: the round is replayed without them
            raise ClientsDropped(sorted(why), [why[c] for c in sorted(why)])
        groups: dict[tuple[int, type], list[int]] = {}  # one message per node and kind of task
        for k, t in enumerate(tasks):
            groups.setdefault((self.node_of[t.client], type(t)), []).append(k)
        msgs = [
            Message(encode_tasks([tasks[k] for k in ks]), dst_node_id=node, message_type=message_type(kind))
            for (node, kind), ks in groups.items()
        ]
        out: list[Reply | None] = [None] * len(tasks)
        for (node, _), ks, reply in zip(groups, groups.values(), self.exchange(msgs, self.timeout)):
            clients = sorted({tasks[k].client for k in ks})
            try:
                if reply is None or reply.has_error():
                    self.failed.add(node)  # its clients may go to a node that claimed them
                    raise BadReply(f"no reply within {self.timeout} s" if reply is None else reply.error.reason)
                self.failed.discard(node)
                for k, result in zip(ks, decode_results([tasks[k] for k in ks], reply.content)):
                    out[k] = result
            except BadReply as err:
                for c in clients:
                    why[c] = f"client {c} (node {node}): {err}"
        if why:
            raise ClientsDropped(sorted(why), [why[c] for c in sorted(why)])
        return out  # type: ignore[return-value]


def served_clients(node_config: dict[str, Any], n_clients: int) -> list[int]:
    """The clients a node serves, from its node config: ``client-ids`` ("0-9,12") or
    ``client-id`` (deployment), else ``partition-id`` i of ``num-partitions`` k (simulation:
    clients i, i+k, i+2k, ... of the ``n_clients``)."""
    if "client-ids" in node_config:
        spec = str(node_config["client-ids"])
        try:
            out: list[int] = []
            for part in spec.split(","):
                lo, _, hi = part.strip().partition("-")
                out += range(int(lo), int(hi or lo) + 1)
        except ValueError:
            raise ValueError(f'node config client-ids={spec!r}: expected ids and ranges, e.g. "0-9,12"') from None
        if not out or min(out) < 0:
            raise ValueError(f"node config client-ids={spec!r}: expected ids >= 0 and ranges lo-hi with lo <= hi")
        mine = sorted(set(out))
    elif "client-id" in node_config:
        mine = [int(node_config["client-id"])]
    elif "partition-id" in node_config:
        k = int(node_config.get("num-partitions", n_clients))
        if k < 1:
            raise ValueError(f"node config num-partitions={k}: expected a number of partitions >= 1")
        mine = list(range(int(node_config["partition-id"]), n_clients, k))
    else:
        raise ValueError(
            'node config names no client: start the SuperNode with --node-config "client-id=<i>" '
            'or "client-ids=<i>-<j>"'
        )
    if not mine or min(mine) < 0 or max(mine) >= n_clients:  # a negative id served no client, without a word
        raise ValueError(f"this node would serve clients {mine}, but the federation has clients 0-{n_clients - 1}")
    return mine


def client_app(raw_config: dict[str, Any] | Callable[[Context], dict[str, Any]]) -> ClientApp:
    """A ClientApp serving the clients named in its node's config (:func:`served_clients`).
    ``raw_config``: the stocfl config, or a function that reads it from the run's context
    (deployment)."""
    app = ClientApp()
    state: dict[str, Any] = {}

    def local(context: Context):
        if "executor" not in state:
            quiet_known_noise()
            from stocfl.executors import SequentialExecutor, set_threads
            from stocfl.experiment import configure
            from stocfl.experiment.build import build_federation, build_model

            set_threads(1)  # one CPU per client actor
            cfg = configure.validate(raw_config(context) if callable(raw_config) else raw_config)
            fed = build_federation(cfg)
            model, _, _ = build_model(cfg, fed)
            state["executor"] = SequentialExecutor(fed, model)
        return state["executor"], served_clients(context.node_config, state["executor"].fed.n_clients)

    def identify(msg: Message, context: Context) -> Message:
        _, mine = local(context)
        return Message(RecordDict({"client": ConfigRecord({"client_ids": mine})}), reply_to=msg)

    def handle(msg: Message, context: Context) -> Message:
        executor, mine = local(context)
        tasks = decode_tasks(msg.metadata.message_type, msg.content)
        strangers = sorted({t.client for t in tasks} - set(mine))
        if strangers:
            raise ValueError(f"this node serves clients {mine}, not {strangers[0]}")
        return Message(encode_results(executor.execute(tasks), [t.client for t in tasks]), reply_to=msg)

    app.query("identify")(identify)
    for kind in message_types():  # every registered task kind: CATEGORY[.ACTION], routed by both
        category, _, action = kind.partition(".")
        register = getattr(app, category)  # app.train, app.evaluate or app.query
        (register(action) if action else register())(handle)
    return app


def _run_key(raw_config: dict[str, Any], key: str) -> float:
    from stocfl.config import RunConfig

    return float(raw_config.get("run", {}).get(key, RunConfig.model_fields[key].default))


def server_app(
    make_experiment: Callable[[FlowerExecutor], Any],
    n_nodes: int,
    result: dict,
    timeout: float | None = None,
    wait: float = NODE_WAIT_SECONDS,
) -> ServerApp:
    """The simulation's ServerApp: the run's one-line errors are kept in ``result["error"]``
    (Flower would log them as a traceback)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            executor = FlowerExecutor(grid, timeout, n_clients=n_nodes).connect(n_nodes, wait, simulated=True)
            result["summary"] = make_experiment(executor).run(progress=result.get("progress", False))
        except UserError as err:
            result["error"] = err

    return app


RUN_CONFIG_HINT = 'flwr run flower_app <superlink> --run-config \'config="/abs/exp.toml" out="/abs/results"\''


def run_config_paths(run_config: dict[str, Any]) -> tuple[Path, Path, int]:
    """``config``, ``out`` and ``n-clients`` of a deployment's run config, checked: absolute
    paths (the apps run in directories of Flower's choosing), ``n-clients`` >= 0."""
    config, out = str(run_config.get("config", "")), str(run_config.get("out", ""))
    resuming = bool(out) and Path(out).is_absolute() and (Path(out) / "config.toml").exists()
    if not out or not Path(out).is_absolute():
        raise UserError(
            f"run config out={out!r}: expected the absolute path of the results directory: {RUN_CONFIG_HINT}"
        )
    if not resuming and (not config or not Path(config).is_absolute() or not Path(config).is_file()):
        raise UserError(
            f"run config config={config!r}: expected the absolute path of a stocfl TOML config on "
            f"every machine: {RUN_CONFIG_HINT}"
        )
    try:
        n = int(run_config.get("n-clients", 0))
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise UserError(
            f"run config n-clients={run_config.get('n-clients')!r}: expected the number of clients to "
            f"wait for (0 = all of the config's scenario)"
        )
    return Path(config), Path(out), n


def deployed_client_config(context: Context) -> dict[str, Any]:
    """A deployed ClientApp's stocfl config: the file ``config`` of the run config, read on the
    SuperNode's own machine (each client builds its data from it)."""
    import tomllib

    from stocfl.config import check_nesting

    path = Path(str(context.run_config.get("config", "")))
    try:
        text = path.read_text(encoding="utf-8")
        check_nesting(text, f"run config config={str(path)!r}")
        return tomllib.loads(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise UserError(
            f"run config config={str(path)!r} cannot be read on this SuperNode ({err}); the stocfl "
            f"config must be at the same absolute path on every machine"
        ) from None


def deployed_main(grid: Grid, run_config: dict[str, Any]) -> None:
    """The ServerApp body of a deployment: ``run_config`` carries the stocfl config file,
    the results directory and the number of clients to wait for (0: every client of the
    scenario). An existing results directory is resumed."""
    from stocfl.experiment import configure
    from stocfl.experiment.build import read_config
    from stocfl.experiment.loop import Experiment

    config, out, n = run_config_paths(run_config)
    resuming = (out / "config.toml").exists()
    cfg = configure.validate(read_config(out)) if resuming else configure.load(str(config))  # before connecting
    n_clients = cfg.scenario.n_clients
    keys = str(run_config.get("node-keys", "") or "")
    if keys and not Path(keys).is_absolute():
        raise UserError(f"run config node-keys={keys!r}: expected the absolute path of a TOML file: {RUN_CONFIG_HINT}")
    bound = read_node_keys(keys, n_clients) if keys else None
    executor = FlowerExecutor(grid, cfg.run.client_timeout or None, n_clients, bound)
    executor.connect(n or n_clients, cfg.run.node_wait)
    (Experiment.resume(out, executor=executor) if resuming else Experiment.create(cfg, out, executor)).run(
        progress=False
    )


def simulate(
    raw_config: dict[str, Any],
    out: Path,
    make_experiment: Callable[[FlowerExecutor], Any],
    n_clients: int,
    progress: bool = False,
) -> dict[str, Any]:
    """Run an experiment on Flower's simulation engine (Ray): one SuperNode per client, or
    ``run.sim_nodes`` SuperNodes sharing the clients; one CPU per ClientApp actor. Flower's
    home (FLWR_HOME, unless set) is a temporary directory, removed at the end: never the
    user's home, nothing left in the run directory."""
    import shutil
    import tempfile

    from flwr.simulation import run_simulation

    quiet_known_noise()
    out.mkdir(parents=True, exist_ok=True)
    home = None if os.environ.get("FLWR_HOME") else tempfile.mkdtemp(prefix="stocfl-flwr-")
    if home is not None:
        os.environ["FLWR_HOME"] = home
    result: dict[str, Any] = {"progress": progress}
    nodes = min(int(raw_config.get("run", {}).get("sim_nodes", 0)) or n_clients, n_clients)
    try:
        run_simulation(
            server_app(
                make_experiment,
                n_clients,
                result,
                _run_key(raw_config, "client_timeout") or None,
                _run_key(raw_config, "node_wait"),
            ),
            client_app(raw_config),
            num_supernodes=nodes,
            backend_config={"client_resources": {"num_cpus": 1}},
        )
    finally:
        if home is not None:
            os.environ.pop("FLWR_HOME", None)
            shutil.rmtree(home, ignore_errors=True)
    if "error" in result:
        raise result["error"]
    if "summary" not in result:
        raise UserError(
            f"the Flower simulation ended without finishing the run; see the log above, resume with "
            f"'stocfl resume {out}'"
        )
    return result["summary"]
