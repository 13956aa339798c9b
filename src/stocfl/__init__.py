"""stocfl: clustered federated learning (StoCFL and its baselines) on one client-task engine."""

__version__ = "0.1.0"
