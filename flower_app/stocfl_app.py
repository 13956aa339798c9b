"""Entry points of the stocfl Flower app: the ServerApp runs the ordinary stocfl round loop over
Flower messages; each SuperNode's ClientApp serves the client given by its node config
``client-id`` (flower-supernode --node-config "client-id=3")."""

import tomllib
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from stocfl.flower.engine import client_app, deployed_main

server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    deployed_main(grid, context.run_config)


client = client_app(lambda context: tomllib.loads(Path(str(context.run_config["config"])).read_text()))
