"""The algorithm registry: config name -> class."""

from __future__ import annotations

from stocfl.algorithms.base import Algorithm, Context, Params, Placement
from stocfl.algorithms.cfl import CFL
from stocfl.algorithms.cflgp import CFLGP
from stocfl.algorithms.clove import CLoVE
from stocfl.algorithms.ditto import Ditto
from stocfl.algorithms.fedavg import FedAvg
from stocfl.algorithms.fedccfa import FedCCFA
from stocfl.algorithms.fedem import FedEM
from stocfl.algorithms.fedprox import FedProx
from stocfl.algorithms.fedrc import FedRC
from stocfl.algorithms.fedsoft import FedSoft
from stocfl.algorithms.fesem import FeSEM
from stocfl.algorithms.flhc import FLHC
from stocfl.algorithms.flux import FLUX
from stocfl.algorithms.ifca import IFCA
from stocfl.algorithms.pacfl import PACFL
from stocfl.algorithms.srfca import SRFCA
from stocfl.algorithms.stocfl.algorithm import StoCFL
from stocfl.errors import UserError, refuse_builtin

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        FedProx,
        StoCFL,
        Ditto,
        IFCA,
        CFL,
        FLHC,
        FeSEM,
        FedEM,
        FedRC,
        FedSoft,
        PACFL,
        CLoVE,
        FLUX,
        CFLGP,
        SRFCA,
        FedCCFA,
    )
}
BUILTIN_ALGORITHMS = frozenset(ALGORITHMS)


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Make an algorithm usable by its ``name`` (``algorithm.name``) in this process; usable as a
    class decorator. Its ``Params`` (a :class:`~stocfl.algorithms.base.Params` model) are its
    config keys."""
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise UserError(f"register_algorithm: {cls!r} is not a subclass of stocfl.algorithms.Algorithm")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise UserError(f"register_algorithm: {cls.__name__}.name must be an identifier, e.g. 'my_algorithm'")
    refuse_builtin("register_algorithm", name, name in BUILTIN_ALGORITHMS and ALGORITHMS[name] is not cls)
    ALGORITHMS[name] = cls
    return cls


def algorithm_class(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise UserError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}") from None


__all__ = [
    "ALGORITHMS",
    "CFL",
    "CFLGP",
    "CLoVE",
    "FLHC",
    "FedCCFA",
    "FLUX",
    "IFCA",
    "PACFL",
    "SRFCA",
    "Algorithm",
    "Context",
    "Ditto",
    "FeSEM",
    "FedAvg",
    "FedEM",
    "FedRC",
    "FedSoft",
    "FedProx",
    "Params",
    "Placement",
    "StoCFL",
    "algorithm_class",
    "register_algorithm",
]
