"""What to launch: a placement (where) and training knobs (how), as chosen by the planner.

Pure data. The store keeps one per attempt; the launchers read it; the agent turns
the knobs into the run's environment (see ``orchestrator.contract.Env``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TrainingKnobs:
    """Memory-driven training settings. The global batch never changes across
    replans: micro_batch * grad_accum * data-parallel ranks stays equal to it."""

    micro_batch: int
    grad_accum: int = 1
    activation_checkpoint_every: int = 0
    """0 = off; N = checkpoint every Nth transformer block; 1 = every block."""

    def __post_init__(self) -> None:
        if self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {self.micro_batch}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.activation_checkpoint_every < 0:
            raise ValueError("activation_checkpoint_every must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Placement:
    """One concrete choice of hardware for every node of an attempt."""

    cloud: str
    """SkyPilot cloud name in lower case (aws, gcp, azure, kubernetes) or ``local``."""
    region: str
    instance_type: str
    accelerator: str | None
    accelerator_count: int
    num_nodes: int
    spot: bool
    zone: str | None = None
    gpu_memory_gib: float | None = None
    price_per_node_hour: float | None = None
    """Spot price when spot, on-demand price otherwise, USD per node-hour."""
    knobs: TrainingKnobs | None = None
    reasons: tuple[str, ...] = field(default=())
    """Why the planner chose it (human-readable), shown by ``skyresume plan``."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["reasons"] = list(self.reasons)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Placement:
        d = dict(d)
        knobs = d.pop("knobs", None)
        reasons = tuple(d.pop("reasons", ()) or ())
        return cls(**d, knobs=TrainingKnobs(**knobs) if knobs else None, reasons=reasons)
