"""The run's time series: the operator loop samples each rank of a live attempt when
its step moved, at most once per period, and never an ended attempt's; the series
read returns the samples with incidents and checkpoints on the same axis."""

from __future__ import annotations

from datetime import timedelta

from goodput_history import LOST_STEPS, JobHistory, at

from orchestrator.store.models import Checkpoint, Node
from orchestrator.store.series import ProgressSampler, job_series


def _steps(s, job_id: str, step: int, loss: float) -> None:  # type: ignore[no-untyped-def]
    for n in s.query(Node).filter_by(job_id=job_id, attempt=2):
        n.progress = {
            "ranks": [
                {"rank": 2 * n.node_rank + k, "step": step, "loss": loss, "grad_norm": 0.5}
                for k in range(2)
            ]
        }
        n.last_heartbeat_at = at(1000 + step)
    s.commit()


def test_a_rank_is_sampled_when_its_step_moved_at_most_once_per_period(sqlite_sessions):
    with sqlite_sessions() as s:
        h = JobHistory(s, "series")
        h.attempt(1, 100, 500, end_reason="node lost", last_step=40)  # ended: never sampled
        h.attempt(2, 600, None, last_step=50)
        h.incident(500, "node_lost", LOST_STEPS, last_step=40, attempt=1)
        s.add(Checkpoint(job_id=h.id, step=50, uri="s3://c/50", status="complete",
                         created_at=at(900)))  # fmt: skip
        s.commit()
        sampler = ProgressSampler(every_s=5.0)
        _steps(s, h.id, 60, 2.0)
        assert sampler.sample(s, now=at(1060)) == 4  # 2 nodes x 2 ranks
        _steps(s, h.id, 62, 1.9)  # 2 s later: inside the period, not sampled
        assert sampler.sample(s, now=at(1062)) == 0
        _steps(s, h.id, 62, 1.9)
        assert sampler.sample(s, now=at(1070)) == 0  # the step did not move
        _steps(s, h.id, 70, 1.5)
        assert sampler.sample(s, now=at(1070)) == 4
        data = job_series(s, h.id)
    assert sorted({p.rank for p in data.points}) == [0, 1, 2, 3]
    assert {p.attempt for p in data.points} == {2}
    assert [p.step for p in data.points if p.rank == 0] == [60, 70]
    assert [p.at for p in data.points if p.rank == 0] == [at(1060), at(1070)]
    kinds = {m.kind: m for m in data.marks}
    assert kinds["incident"].at == at(500) and kinds["incident"].end is not None
    assert kinds["checkpoint"].label == "checkpoint step 50"
    assert kinds["incident"].end - kinds["incident"].at > timedelta(seconds=60)
