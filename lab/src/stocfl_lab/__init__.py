"""stocfl's lab: the papers' tables (``stocfl-lab reproduce``) and the benchmarks (``stocfl-lab
bench``), outside the library and built on its public API only."""

__version__ = "0.1.0"
