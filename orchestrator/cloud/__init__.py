"""Adapters to cloud systems: metadata (preemption notices) and object storage."""
