"""The algorithm registry: config name -> class."""

from __future__ import annotations

from stocfl.algorithms.base import Algorithm, Context
from stocfl.algorithms.cfl import CFL
from stocfl.algorithms.ditto import Ditto
from stocfl.algorithms.fedavg import FedAvg
from stocfl.algorithms.fesem import FeSEM
from stocfl.algorithms.flhc import FLHC
from stocfl.algorithms.ifca import IFCA
from stocfl.algorithms.fedprox import FedProx
from stocfl.algorithms.stocfl import StoCFL
from stocfl.errors import UserError

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (FedAvg, FedProx, StoCFL, Ditto, IFCA, CFL, FLHC, FeSEM)}


def algorithm_class(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise UserError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}") from None


__all__ = ["ALGORITHMS", "Algorithm", "Context", "algorithm_class"]
