"""skyresume's in-job training library (imports torch).

The public surface is ``Run`` (see ``training.run``), ``RunConfig``, ``RunExit``
and ``ResumableSampler``; the modules below it (checkpoint, resume, signals,
progress, monitors, knobs, rng, control) can be used on their own.
"""

from training.data import ResumableSampler
from training.run import Run, RunConfig, RunExit

__all__ = ["ResumableSampler", "Run", "RunConfig", "RunExit"]
