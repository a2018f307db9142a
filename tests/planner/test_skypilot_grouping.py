"""The SkyPilot launcher's node grouping (``SKYRESUME_SKYPILOT_GROUPING=node``: one
single-node cluster per node, orchestrator/launchers/skypilot_grouping.py) against
the fake SDK of test_skypilot_requests: what it submits for a fresh launch, a join
beside survivors, a restart and a release, and that its SDK calls are counted.

(Here rather than under tests/launchers: the fake SDK and the ``sky`` fixture with
its offline catalog live in this package.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.contract import Env
from orchestrator.launchers.base import LaunchHandle, LaunchPhase
from orchestrator.launchers.skypilot import SkyPilotLauncher
from orchestrator.launchers.skypilot_grouping import (
    CountingSDK,
    SkyPilotNodeLauncher,
    decode,
    launcher_for,
    node_cluster_name,
    read_call_log,
)
from tests.planner.test_skypilot_requests import A2, IMAGE, FakeSky, Handle, request

pytestmark = pytest.mark.filterwarnings("ignore::Warning:sky")

N0, N1 = "sr-j-7-a1-n0", "sr-j-7-a1-n1"


class _Zoned(Handle):
    def __init__(self, pairs: list[tuple[str, str | None]], zone: str) -> None:
        super().__init__(pairs)
        self.launched_resources = type("R", (), {"zone": zone})()


@pytest.fixture
def fake(sky) -> FakeSky:  # type: ignore[no-untyped-def]
    return FakeSky(sky)


@pytest.fixture
def nodes(fake: FakeSky) -> SkyPilotNodeLauncher:
    return SkyPilotNodeLauncher(
        sdk=fake, image_id=IMAGE, poll_timeout_s=2.0, submit_timeout_s=2.0, job_poll_s=0
    )


def envs_of(fake: FakeSky, cluster: str) -> dict[str, str]:
    import yaml

    (r,) = [r for r in fake.requests.values() if r["name"] == "sky.launch"
            and r["cluster_name"] == cluster]  # fmt: skip
    doc = list(yaml.safe_load_all(json.loads(r["body"])["task"]))[-1]
    return {str(k): str(v) for k, v in doc["envs"].items()}


def up(fake: FakeSky, rid: str, cluster: str, ip: str, zone: str = "us-central1-a") -> None:
    fake.clusters[cluster] = "UP"
    fake.cluster_jobs[cluster] = {1: "RUNNING"}
    fake.finish(rid, (1, _Zoned([(ip, None)], zone)))


def test_a_fresh_launch_is_node_0_first_then_its_peers_told_its_address_and_zone(nodes, fake):
    handle = nodes.launch(request())
    assert [kw["cluster_name"] for _, kw in fake.submitted("launch")] == [N0]
    assert handle.node_ids == ("j-7-a1-n0", "j-7-a1-n1") and handle.cluster_name == f"{N0}+1"
    env0 = envs_of(fake, N0)
    assert env0[Env.NODE_RANK_BASE] == "0" and env0[Env.NNODES] == "2"
    assert Env.MASTER_ADDR not in env0  # node 0 is the rendezvous itself
    assert nodes.progress(handle).phase is LaunchPhase.PROVISIONING
    assert len(fake.submitted("launch")) == 1  # its peer waits for its address
    ((_, cluster0, rid0),) = decode(replace(handle, node_ids=("j-7-a1-n0",)))
    assert cluster0 == N0
    up(fake, rid0, N0, "10.0.0.5", zone="us-central1-b")
    assert nodes.progress(handle).phase is LaunchPhase.PROVISIONING
    assert [kw["cluster_name"] for _, kw in fake.submitted("launch")] == [N0, N1]
    env1 = envs_of(fake, N1)
    assert (env1[Env.NODE_RANK_BASE], env1[Env.NNODES], env1[Env.MASTER_ADDR]) == (
        "1", "2", "10.0.0.5",
    )  # fmt: skip
    (rid1,) = [r for r, v in fake.requests.items() if v["cluster_name"] == N1]
    assert "us-central1-b" in json.loads(fake.requests[rid1]["body"])["task"]
    up(fake, rid1, N1, "10.0.0.9")
    p = nodes.progress(handle)
    assert (p.phase, p.hosts) == (LaunchPhase.UP, ("10.0.0.5", "10.0.0.9"))
    assert len(fake.submitted("launch")) == 2  # nothing submitted twice


def test_a_join_beside_a_survivor_launches_one_node_and_restarts_the_survivor_alone(nodes, fake):
    kept = LaunchHandle(N0, "skypilot", ("j-7-a1-n0",), ("10.0.0.5",),
                        json.dumps([["j-7-a1-n0", N0, "r0"], ["j-7-a1-n1", N1, "r1"]]))  # fmt: skip
    fake.clusters[N0] = "UP"
    fake.cluster_jobs[N0] = {1: "RUNNING"}
    group = {Env.NNODES: "2", Env.MASTER_ADDR: "10.0.0.5"}
    req = request(attempt=2)
    restart_req = replace(req, placement=replace(A2, num_nodes=1),
                          env={**group, Env.NODE_RANK_BASE: "0"})  # fmt: skip
    h = nodes.restart(kept, restart_req)
    ((_, kw),) = fake.submitted("exec")
    assert kw == {"cluster_name": N0}  # only the survivor's own cluster
    assert [c[1] for c in fake.submitted("cancel")] == [N0]
    (exec_rid,) = [r for r, v in fake.requests.items() if v["name"] == "sky.exec"]
    assert decode(h) == [("j-7-a2-n0", N0, exec_rid)]  # the survivor, now rank 0 of attempt 2
    fresh = replace(req, placement=replace(A2, num_nodes=1), node_rank_base=1,
                    env={**group, Env.NODE_RANK_BASE: "1"})  # fmt: skip
    j = nodes.launch(fresh)
    ((_, kw2),) = fake.submitted("launch")
    assert kw2["cluster_name"] == node_cluster_name("j-7", 2, 0, 1) == "sr-j-7-a2-n1"
    assert j.node_ids == ("j-7-a2-n1",)
    env = envs_of(fake, "sr-j-7-a2-n1")
    assert (env[Env.NODE_RANK_BASE], env[Env.MASTER_ADDR]) == ("1", "10.0.0.5")
    assert not fake.submitted("down")  # nothing of the survivor is given back


def test_a_release_downs_the_lost_nodes_cluster_only(nodes, fake):
    entries = [["j-7-a1-n0", N0, "r0"], ["j-7-a1-n1", N1, "r1"]]
    fake.clusters[N0] = fake.clusters[N1] = "UP"
    whole = LaunchHandle(N0, "skypilot", ("j-7-a1-n0", "j-7-a1-n1"), (), json.dumps(entries))
    nodes.down(replace(whole, node_ids=("j-7-a1-n1",)))  # what the reconciler's release passes
    assert [c[1] for c in fake.submitted("down")] == [N1]
    nodes.down(whole)  # giving the attempt back: both (N1's down is under way already)
    assert [c[1] for c in fake.submitted("down")] == [N1, N0]
    assert not nodes.confirm_down(whole).gone


def test_status_is_up_only_when_every_nodes_cluster_is(nodes, fake):
    entries = [["a", N0, "r0"], ["b", N1, "r1"]]
    h = LaunchHandle(N0, "skypilot", ("a", "b"), (), json.dumps(entries))
    fake.clusters[N0] = "UP"
    st = nodes.status(h)
    assert st.state.value == "unknown" and st.nodes_up == ("a",)
    fake.clusters[N1] = "UP"
    nodes._records = None
    assert nodes.status(h).state.value == "up"


def test_the_grouping_setting_picks_the_launcher_and_its_abilities():
    class S:
        skypilot_grouping = "node"
        skypilot_image_id = ""

    assert type(launcher_for(S())) is SkyPilotNodeLauncher
    S.skypilot_grouping = "attempt"
    a = launcher_for(S())
    assert type(a) is SkyPilotLauncher and a.abilities.refills_clusters
    b = SkyPilotNodeLauncher.abilities
    assert b.keeps_survivors and b.releases_single_nodes and not b.refills_clusters
    S.skypilot_grouping = "rack"
    with pytest.raises(ValueError, match="attempt, node"):
        launcher_for(S())


def test_every_sdk_call_is_counted_into_the_call_log(fake, tmp_path: Path):
    log = tmp_path / "calls.jsonl"
    counted = CountingSDK(fake, log)
    launcher = SkyPilotNodeLauncher(sdk=counted, image_id=IMAGE, poll_timeout_s=2.0,
                                    submit_timeout_s=2.0)  # fmt: skip
    launcher.launch(request())
    calls = read_call_log(log)
    assert calls == counted.counts
    assert calls["sky.launch"] == 1 and calls["sky.api_info"] == 1
    assert sum(calls.values()) == len(fake.calls)


def test_the_peers_go_out_once_node_0s_request_succeeded_even_if_its_job_is_not_read(nodes, fake):
    """Found on the emulated AWS under load: node 0's agent ran, but job_status did not
    answer within its bound, so its peer was never submitted. The address is in the
    launch's result; the job's status is not needed for it."""
    handle = nodes.launch(request())
    ((_, _, rid0), _) = decode(handle)
    fake.clusters[N0] = "UP"  # no job status: job_status answers None for job 1
    fake.finish(rid0, (1, _Zoned([("10.0.0.5", None)], "us-central1-a")))
    assert nodes.progress(handle).phase is not LaunchPhase.UP
    assert [kw["cluster_name"] for _, kw in fake.submitted("launch")] == [N0, N1]
    assert envs_of(fake, N1)[Env.MASTER_ADDR] == "10.0.0.5"


def test_a_standby_asked_for_again_is_one_new_cluster_ranked_past_the_given_back_one(nodes, fake):
    """``LaunchSpare`` on the node grouping: attempt 2 trains on nodes 0 and 1, its
    first standby (node 2) was given back; the second try is node 3's own cluster,
    told the group's rendezvous, and nothing of the group is touched."""
    group = {Env.NNODES: "4", Env.MASTER_ADDR: "10.0.0.5", Env.STANDBY: "1"}
    spare = replace(request(attempt=2), placement=replace(A2, num_nodes=1), node_rank_base=3,
                    env={**group, Env.NODE_RANK_BASE: "3"})  # fmt: skip
    h = nodes.launch(spare)
    ((_, kw),) = fake.submitted("launch")
    assert kw["cluster_name"] == node_cluster_name("j-7", 2, 0, 3) == "sr-j-7-a2-n3"
    assert h.node_ids == ("j-7-a2-n3",)
    env = envs_of(fake, "sr-j-7-a2-n3")
    assert (env[Env.NODE_RANK_BASE], env[Env.MASTER_ADDR], env[Env.STANDBY]) == (
        "3", "10.0.0.5", "1",
    )  # fmt: skip
    assert not fake.submitted("exec") and not fake.submitted("down")
