"""Flower as a transport for stocfl's client tasks (Message API, flwr >= 1.41).

Registers the ``flower-sim`` engine; Flower itself is imported only when it runs."""

from stocfl.errors import UserError
from stocfl.executors import Engine, register_engine


def _simulate(*args, **kwargs):
    try:
        from stocfl.flower.engine import simulate
    except ImportError:
        raise UserError("run.engine = flower-sim needs Flower: pip install 'flwr[simulation]>=1.41,<1.43'") from None
    return simulate(*args, **kwargs)


register_engine(Engine("flower-sim", "tasks sent as Flower messages on Flower's simulation engine", launch=_simulate))
