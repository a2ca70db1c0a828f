"""coldsnapd: the control-node daemon of ColdSnap."""

__version__ = "0.1.0"
