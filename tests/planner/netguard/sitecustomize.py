"""Loaded by every Python process started with this directory on PYTHONPATH (the
CLI subprocesses of tests/planner): refuse any connection or name lookup that is
not loopback, so a test can never reach GitHub, a cloud API or DNS."""

from orchestrator_netguard import install

install()
