"""The agent's side of a warm shrink (issue 20): a ``regroup`` command moves the agent
into the next attempt and writes its node's membership where the waiting ranks read
it; a command it cannot honour moves nothing."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from orchestrator.agent import ranks as rk
from orchestrator.agent import stage as st
from orchestrator.agent.main import Agent, parse_args
from orchestrator.contract import MEMBERSHIP_KEY, Env, Membership


def agent(tmp_path: Path, nproc: int = 2) -> Agent:
    cfg = parse_args(
        [
            "--job-id", "j", "--attempt", "1", "--node-id", "j-a1-n1", "--node-rank", "1",
            "--nnodes", "3", "--nproc-per-node", str(nproc), "--local-dir", str(tmp_path),
            "--service-url", "http://127.0.0.1:9", "--", "python", "x.py",
        ]
    )  # fmt: skip
    a = Agent(cfg, token="tok-a1", environ={"PATH": "/bin", Env.FULL_WORLD_SIZE: "6"})
    a.ranks = [rk.Rank(rank=2 + i, local_rank=i, pid=1000 + i) for i in range(nproc)]
    return a


def membership(**kw: object) -> dict[str, object]:
    m = Membership(2, 4, 0, 2, 2, "10.0.0.3", 29602, 40)  # this node first of 2
    return {**m.to_doc(), **kw}


def regroup(**kw: object) -> dict[str, object]:
    return {"attempt": 2, "agent_token": "tok-a2", "membership": membership(), **kw}


def test_a_regroup_moves_the_agent_and_writes_the_membership(tmp_path):
    a = agent(tmp_path)
    try:
        a.board.ingest(b'{"type": "regroup", "rank": 2, "generation": 0}')
        assert a.carry(regroup())
        assert (a.cfg.attempt, a.cfg.node_rank, a.cfg.nnodes) == (2, 0, 2)
        assert a.cfg.master_addr == "10.0.0.3"
        assert [r.rank for r in a.ranks] == [0, 1]  # their global ranks in the new group
        assert a.client is not None and a.client.prefix.endswith("/attempts/2/nodes/j-a1-n1")
        assert a.board.snapshot(2).regrouping is None  # the old attempt's word is dropped
        doc = json.loads(a.cfg.control_file.read_text())[MEMBERSHIP_KEY]
        assert Membership.from_doc(doc) == Membership.from_doc(membership())
    finally:
        a.listener.stop()


def test_a_carried_agent_downloads_while_it_registers_and_reports_only_once_registered(
    tmp_path, monkeypatch
):
    a = agent(tmp_path)
    order: list[tuple[str, bool]] = []
    staged = tmp_path / "staged" / "step_40"

    def stage(env: Any, node_disk: Path) -> st.StageOutcome:
        order.append(("download", a._registered.is_set()))
        # The heartbeat thread registers in the new attempt meanwhile.
        threading.Timer(0.05, a._registered.set).start()
        return st.StageOutcome(True, 40, "staged", 10, 0.01, "s3://b/ck/step_40", str(staged))

    def report(kind: Any, key: str, **fields: Any) -> None:
        order.append((str(kind), a._registered.is_set()))

    monkeypatch.setattr(st, "stage_for_ranks", stage)
    monkeypatch.setattr(a, "report", report)
    try:
        assert a.carry(regroup(stage_from="s3://b/ck/step_40", resume_from="{node_disk}/s"))
        assert order == [("download", False), ("staged", True)]
        doc = json.loads(a.cfg.control_file.read_text())[MEMBERSHIP_KEY]
        assert Membership.from_doc(doc).resume_from == str(staged)
    finally:
        a.listener.stop()


def test_a_regroup_it_cannot_honour_moves_nothing(tmp_path):
    a = agent(tmp_path)
    try:
        assert not a.carry(regroup(attempt=1))  # not after the agent's own attempt
        assert not a.carry(regroup(agent_token=None))
        assert not a.carry(regroup(membership=membership(node_rank=5)))
        a.ranks[1].exited = True  # a rank gave up waiting: nothing warm to carry
        assert not a.carry(regroup())
        assert a.cfg.attempt == 1 and not a.cfg.control_file.exists()
    finally:
        a.listener.stop()


def test_elastic_ranks_wait_for_a_membership_and_others_do_not(tmp_path):
    a = agent(tmp_path)
    try:
        assert a.rank_env()[Env.REGROUP_TIMEOUT_S] == "180"
        a.environ.pop(Env.FULL_WORLD_SIZE)
        assert Env.REGROUP_TIMEOUT_S not in a.rank_env()
    finally:
        a.listener.stop()
