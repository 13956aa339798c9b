"""Entry points of the stocfl Flower app: the ServerApp runs the ordinary stocfl round loop over
Flower messages; each SuperNode's ClientApp serves the clients given by its node config
(flower-supernode --node-config "client-id=3", or 'client-ids="0-9"')."""

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from stocfl.flower.engine import client_app, deployed_client_config, deployed_main

server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    deployed_main(grid, context.run_config)


client = client_app(deployed_client_config)
