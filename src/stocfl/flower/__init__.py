"""Flower as a transport for stocfl's client tasks (Message API, flwr >= 1.41)."""
