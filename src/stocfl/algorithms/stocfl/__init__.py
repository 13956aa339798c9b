"""StoCFL (Zeng et al., 2023): the algorithm, the client representation Psi, the stochastic
clustering and the tau helper."""

from stocfl.algorithms.stocfl.algorithm import StoCFL, StoCFLParams

__all__ = ["StoCFL", "StoCFLParams"]
