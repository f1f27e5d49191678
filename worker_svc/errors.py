"""Errors shared by the worker's runners and its gRPC service (no torch here)."""


class PlanError(ValueError):
    """A plan that does not fit the worker's state (gap in steps, other epoch, unknown sequence)."""
