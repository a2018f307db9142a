"""The pieces under Run: the resumable sampler, the control file, reseeding on a
world-size change, the cross-replica reference check and the choice of checkpoint."""

from __future__ import annotations

import os

import pytest

from training.control import ControlFile
from training.data import ResumableSampler
from training.monitors import detect_reference_divergence
from training.resume import (
    CheckpointUnusable,
    RankCandidates,
    ResumeMismatch,
    choose_checkpoint,
)
from training.rng import derived_seed


def _global(world: int, steps: int, start: int = 0) -> list[list[int]]:
    """Each step's global batch, assembled from every rank's share."""
    ranks = [ResumableSampler(10, 4, seed=1, rank=r, world_size=world) for r in range(world)]
    for s in ranks:
        s.consumed = start
    out = []
    for _ in range(steps):
        out.append([i for s in ranks for i in s.indices()])
        for s in ranks:
            s.advance()
    return out


def test_sampler_position_means_the_same_samples_on_any_world_size():
    four = _global(4, 6)
    assert _global(2, 6) == _global(1, 6) == four
    # Resume at step 3 on two ranks: exactly the rest of the four-rank run.
    assert _global(2, 3, start=3 * 4) == four[3:]
    # Every epoch (10 samples) is a permutation; epochs differ.
    flat = [i for b in four for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]


def test_sampler_refuses_a_state_from_another_dataset_or_batch():
    s = ResumableSampler(10, 4, seed=1, rank=0, world_size=2)
    s.advance()
    state = s.state_dict()
    t = ResumableSampler(10, 4, seed=1, rank=1, world_size=2)
    t.load_state_dict(state)
    assert t.consumed == 4
    with pytest.raises(ValueError, match="global_batch was 4 when saved, now 8"):
        ResumableSampler(10, 8, seed=1, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="not divisible by 3 ranks"):
        ResumableSampler(10, 4, rank=0, world_size=3)


def test_control_file_is_reread_only_when_it_changes_and_bad_content_keeps_the_value(
    tmp_path, capsys
):
    path = tmp_path / "control.json"
    c = ControlFile(str(path))
    assert c.poll() is None  # not written yet
    path.write_text('{"checkpoint_every": 40}')
    assert c.poll() == 40
    path.write_text('{"checkpoint_every": 0}')
    os.utime(path, ns=(1, 2 * 10**18))
    assert c.poll() == 40 and "must be a positive integer" in capsys.readouterr().err
    path.write_text('{"checkpoint_ev')  # half-written
    os.utime(path, ns=(1, 3 * 10**18))
    assert c.poll() == 40 and "not valid JSON" in capsys.readouterr().err
    path.write_text('{"checkpoint_every": 25}')
    os.utime(path, ns=(1, 4 * 10**18))
    assert c.poll() == 25
    assert ControlFile(None).poll() is None


def test_reseed_after_a_world_size_change_is_deterministic_and_per_rank():
    assert derived_seed(0, 100, 1) == derived_seed(0, 100, 1)
    seeds = {derived_seed(0, 100, r) for r in range(8)} | {derived_seed(0, 101, 0)}
    assert len(seeds) == 9 and all(0 <= s < 2**63 for s in seeds)


def test_a_replica_whose_reference_loss_differs_is_named():
    assert detect_reference_divergence(5, [2.5, 2.5, 2.5, 2.5]) is None
    f = detect_reference_divergence(5, [2.5, 2.5, 2.7, 2.5])
    assert f is not None and "rank 2: 2.7" in f.evidence and "rank 0" not in f.evidence
    both = detect_reference_divergence(5, [2.5, 2.6])  # two ranks: no majority
    assert both is not None and "rank 0" in both.evidence and "rank 1" in both.evidence
    nan = detect_reference_divergence(5, [2.5, float("nan"), 2.5])
    assert nan is not None and "rank 1: nan" in nan.evidence


D = {s: f"{s:064x}" for s in (4, 8, 12)}


def _v(rank: int, *steps: int, error: str | None = None) -> RankCandidates:
    return RankCandidates(rank, tuple((s, D[s]) for s in steps), error)


def test_the_newest_checkpoint_every_rank_has_is_chosen():
    # Node 0 committed 12 locally but node 1 only has what was staged (8).
    assert choose_checkpoint([_v(0, 4, 8, 12), _v(1, 8, 4)], explicit=False) == (8, D[8])
    assert choose_checkpoint([_v(0), _v(1)], explicit=False) is None


def test_checkpoints_on_some_ranks_only_never_become_a_fresh_start():
    with pytest.raises(ResumeMismatch, match=r"ranks 0 at step 12.*ranks 1 at step none"):
        choose_checkpoint([_v(0, 12), _v(1)], explicit=False)
    with pytest.raises(ResumeMismatch, match=r"no checkpoint is on every rank's disk"):
        choose_checkpoint([_v(0, 12), _v(1, 8)], explicit=False)


def test_an_explicit_path_must_be_the_same_checkpoint_on_every_rank():
    assert choose_checkpoint([_v(0, 8), _v(1, 8)], explicit=True) == (8, D[8])
    with pytest.raises(ResumeMismatch, match=r"ranks 1 at step 4"):
        choose_checkpoint([_v(0, 8), _v(1, 4)], explicit=True)
    with pytest.raises(CheckpointUnusable, match="ranks 1 found no usable checkpoint"):
        choose_checkpoint([_v(0, 8), _v(1)], explicit=True)
    with pytest.raises(CheckpointUnusable, match="rank 0: staging failed"):
        choose_checkpoint([_v(0, error="staging failed"), _v(1, 8)], explicit=False)
