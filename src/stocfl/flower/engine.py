"""The ``flower-sim`` engine: the same algorithm code, client tasks sent as Flower messages.

The server side is a ServerApp whose ``main`` runs the ordinary :class:`~stocfl.runner.Experiment`
loop with a :class:`FlowerExecutor`; each client is a SuperNode running a ClientApp that
answers tasks with the in-process sequential executor on its own data. The server never
reads partition ids from Flower: it asks every node once ("query.identify") for the client
id it serves and keys everything by that id.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from stocfl.errors import UserError
from stocfl.flower.codec import MESSAGE_TYPE, BadReply, decode_result, decode_task, encode_result, encode_task
from stocfl.tasks import ClientsDropped, Result, Task

NODE_WAIT_SECONDS = 120.0


class FlowerExecutor:
    """Runs client tasks as Flower messages, one per task, to the node that serves the client."""

    def __init__(self, grid: Grid, node_of: dict[int, int], timeout: float | None = None):
        self.grid, self.node_of, self.timeout = grid, node_of, timeout

    def run(self, tasks: list[Task]) -> list[Result]:
        missing = sorted({t.client for t in tasks} - set(self.node_of))
        if missing:
            raise UserError(f"no Flower node serves client {missing[0]}; start a SuperNode for it")
        msgs = [Message(encode_task(t), dst_node_id=self.node_of[t.client], message_type=MESSAGE_TYPE[type(t)])
                for t in tasks]
        replies = list(self.grid.send_and_receive(msgs, timeout=self.timeout))
        index = {m.metadata.message_id: k for k, m in enumerate(msgs)}  # ids are set when pushed
        out: list[Result | None] = [None] * len(tasks)
        why: dict[int, str] = {}
        for reply in replies:
            k = index.get(reply.metadata.reply_to_message_id)
            if k is None:
                continue
            if reply.has_error():
                why[tasks[k].client] = f"client {tasks[k].client}: {reply.error.reason}"
                continue
            try:
                out[k] = decode_result(tasks[k], reply.content)
            except BadReply as err:
                why[tasks[k].client] = f"client {tasks[k].client} sent a bad reply: {err}"
        for k, r in enumerate(out):
            if r is None and tasks[k].client not in why:
                why[tasks[k].client] = f"client {tasks[k].client}: no reply within the timeout"
        if why:
            raise ClientsDropped(sorted(why), [why[c] for c in sorted(why)])
        return out  # type: ignore[return-value]


def discover(grid: Grid, expected: int) -> dict[int, int]:
    """client id -> node id, asked of every node once."""
    deadline = time.monotonic() + NODE_WAIT_SECONDS
    nodes: list[int] = []
    while time.monotonic() < deadline:
        nodes = list(grid.get_node_ids())
        if len(nodes) >= expected:
            break
        time.sleep(0.2)
    if len(nodes) < expected:
        raise UserError(f"only {len(nodes)} of {expected} Flower nodes connected within {NODE_WAIT_SECONDS:.0f} s")
    replies = grid.send_and_receive([Message(RecordDict(), dst_node_id=n, message_type="query.identify")
                                     for n in nodes])
    return {int(r.content["client"]["client_id"]): r.metadata.src_node_id for r in replies if not r.has_error()}


def client_app(raw_config: dict[str, Any] | Callable[[Context], dict[str, Any]]) -> ClientApp:
    """A ClientApp serving the client whose id is the node's ``partition-id`` (simulation) or
    ``client-id`` (deployment) in its node config. ``raw_config``: the stocfl config, or a
    function that reads it from the run's context (deployment)."""
    app = ClientApp()
    state: dict[str, Any] = {}

    def local(context: Context):
        if "executor" not in state:
            from stocfl import config as config_mod
            from stocfl.executors import SequentialExecutor, set_threads
            from stocfl.models import make_model
            from stocfl.runner import build_federation

            set_threads(1)  # one CPU per client actor
            cfg = config_mod.validate(raw_config(context) if callable(raw_config) else raw_config)
            fed = build_federation(cfg)
            model, _ = make_model(cfg.model.name, fed.input_shape, fed.n_classes, cfg.model.hidden, cfg.run.seed)
            state["executor"] = SequentialExecutor(fed, model)
        nc = context.node_config
        return state["executor"], int(nc["client-id"] if "client-id" in nc else nc["partition-id"])

    def identify(msg: Message, context: Context) -> Message:
        _, me = local(context)
        return Message(RecordDict({"client": ConfigRecord({"client_id": me})}), reply_to=msg)

    def handle(msg: Message, context: Context) -> Message:
        executor, me = local(context)
        task = decode_task(msg.metadata.message_type, msg.content)
        if task.client != me:
            raise ValueError(f"this node serves client {me}, not {task.client}")
        return Message(encode_result(executor.run([task])[0], me), reply_to=msg)

    app.query("identify")(identify)
    app.train()(handle)
    app.evaluate()(handle)
    app.query("represent")(handle)
    app.query("gradient")(handle)
    return app


def _timeout(raw_config: dict[str, Any]) -> float | None:
    return float(raw_config.get("run", {}).get("client_timeout", 0.0)) or None


def server_app(make_experiment: Callable[[FlowerExecutor], Any], n_nodes: int, result: dict,
               timeout: float | None = None) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        executor = FlowerExecutor(grid, discover(grid, n_nodes), timeout)
        result["summary"] = make_experiment(executor).run(progress=result.get("progress", False))

    return app


def deployed_main(grid: Grid, run_config: dict[str, Any]) -> None:
    """The ServerApp body of a deployment: ``run_config`` carries the stocfl config file,
    the results directory and the number of SuperNodes to wait for. An existing results
    directory is resumed."""
    from stocfl import config as config_mod
    from stocfl.runner import Experiment

    import tomllib

    out = Path(str(run_config["out"]))
    resuming = (out / "config.toml").exists()
    raw = tomllib.loads((out / "config.toml" if resuming else Path(str(run_config["config"]))).read_text())
    executor = FlowerExecutor(grid, discover(grid, int(run_config["n-clients"])), _timeout(raw))
    if resuming:
        Experiment.resume(out, executor=executor).run(progress=False)
    else:
        Experiment.create(config_mod.load(str(run_config["config"])), out, executor).run(progress=False)


def simulate(raw_config: dict[str, Any], out: Path, make_experiment: Callable[[FlowerExecutor], Any],
             n_clients: int, progress: bool = False) -> dict[str, Any]:
    """Run an experiment on Flower's simulation engine (Ray), one SuperNode per client, one CPU
    per client actor. FLWR_HOME goes inside the run directory, never the user's home."""
    from flwr.simulation import run_simulation

    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FLWR_HOME", str((out / ".flwr").resolve()))
    result: dict[str, Any] = {"progress": progress}
    run_simulation(server_app(make_experiment, n_clients, result, _timeout(raw_config)), client_app(raw_config),
                   num_supernodes=n_clients,
                   backend_config={"client_resources": {"num_cpus": 1}})
    if "summary" not in result:
        raise UserError(f"the Flower simulation ended without finishing the run; see the log above, resume with "
                        f"'stocfl resume {out}'")
    return result["summary"]
