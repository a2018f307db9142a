"""skyresume's control plane: service, reconciler, launchers, node agent and CLI."""

__version__ = "0.1.0"
