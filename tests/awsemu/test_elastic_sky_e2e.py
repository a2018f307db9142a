"""Issue 20 on SkyPilot's real provisioner: an elastic job (2 nodes, ``min_nodes: 1``)
through SkyPilot 0.14.1's own API server and AWS provisioner on the emulated AWS, with
the node grouping (``SKYRESUME_SKYPILOT_GROUPING=node``: one single-node cluster per
node, which is what lets the survivor keep training while a replacement is launched
beside it; the attempt grouping refills its one cluster and never shrinks, as
docs/skypilot-grouping.md says).

One job's life: node 1's instance is terminated without a notice; the survivor
restarts on its own cluster (``sky.exec``) and trains alone while a new single-node
cluster is launched as standby; once its agent registered, the group grows back to 2
at a step boundary, both restarted in place; then the cancel leaves nothing behind.

Root only, the node template prepared (``scripts/awsemu-prepare``); ``long``: about
6 minutes here. Run under the shared lock: ``flock /tmp/skyresume-e2e.lock
.venv/bin/pytest tests/awsemu/test_elastic_sky_e2e.py -m long -s``.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import pytest

from orchestrator.awsemu import runtime

TEMPLATE = runtime.default_cache_root() / f"runtime-{runtime.RuntimeSpec().key()}"

pytestmark = [
    pytest.mark.long,
    pytest.mark.e2e,
    pytest.mark.timeout(2400),
    pytest.mark.skipif(os.geteuid() != 0, reason="hosts need root (namespaces, sshd)"),
    pytest.mark.skipif(
        not (TEMPLATE / runtime.TEMPLATE_DIR / runtime.MANIFEST).exists(),
        reason="the node template is not prepared (scripts/awsemu-prepare needs PyPI)",
    ),
]


def _instance_of(loop: Any, cluster: str) -> str:
    pat = re.compile(rf"^{re.escape(cluster)}(-|$)")
    found = [i for i in loop.instances() if any(pat.match(str(v)) for v in i["tags"].values())]
    assert len(found) == 1, [i["tags"] for i in found]
    return str(found[0]["InstanceId"])


@pytest.fixture(scope="module")
def life(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from orchestrator.demo_skypilot import SkyLoop, job_spec, task_yaml, wait_for
    from orchestrator.launchers.skypilot_grouping import node_cluster_name

    home = tmp_path_factory.mktemp("skyelastic")
    loop = SkyLoop(home, env={"SKYRESUME_SKYPILOT_GROUPING": "node"})
    out: dict[str, Any] = {}
    try:
        path = home / "service" / "tasks" / "task.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(task_yaml(s3_endpoint=loop.s3.endpoint_url, keys=loop.keys, steps=5000))
        spec = {**job_spec(path, loop.checkpoint_uri), "min_nodes": 1}
        # SkyPilot's launches on the emulator take about a minute: the weighing would
        # shrink on its own; "always" keeps the test about the shrink, not the guess.
        spec["elastic"] = {"shrink": "always"}
        r = loop.http.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job = out["job"] = str(r.json()["id"])
        wait_for(loop, job, "both nodes registered", lambda st, n, v, step, b: b >= 2, 900)
        s = wait_for(loop, job, "training past step 20",
                     lambda st, n, v, step, b: v is not None and step >= 20, 600)  # fmt: skip
        victim = _instance_of(loop, node_cluster_name(job, 1, 0, 1))
        out["victim"] = victim
        assert loop.emu.front is not None
        t_kill = time.monotonic()
        loop.emu.front.terminate(victim)
        s = wait_for(loop, job, "the shrunk group training",
                     lambda st, n, v, step, b: n > s[1] and v is not None and step > v,
                     900)  # fmt: skip
        out["kill_to_first_shrunk_step_s"] = round(time.monotonic() - t_kill, 1)
        out["shrunk_attempt"] = s[1]

        def grown(st: str, n: int, v: int | None, step: int, b: int) -> bool:
            return n > out["shrunk_attempt"] and v is not None and step > v

        s = wait_for(loop, job, "the group grown back", grown, 900)
        out["kill_to_grown_s"] = round(time.monotonic() - t_kill, 1)
        out["incidents"] = loop.get(f"/v1/jobs/{job}/incidents")["items"]
        out["attempts"] = loop.get(f"/v1/jobs/{job}/attempts")["items"]
        out["events"] = loop.get(f"/v1/jobs/{job}/events?limit=500")["items"]
        r = loop.http.post(f"/v1/jobs/{job}/cancel")
        assert r.status_code < 400, r.text
        wait_for(loop, job, "cancelled", lambda st, n, v, step, b: st == "CANCELLED", 120)
        end = time.monotonic() + 600
        while loop.instances() and time.monotonic() < end:
            time.sleep(2)
        out["instances_left"] = [i["InstanceId"] for i in loop.instances()]
        out["sky_clusters_left"] = loop.sky_status()
        lost = out["incidents"][0] if out["incidents"] else {}
        signal = next((x["detail"] for x in lost.get("steps", []) if x["step"] == "signal"), "")
        out["survivor_held_warm"] = "held warm" in (signal or "")
        figures = {k: v for k, v in out.items() if k not in ("incidents", "attempts", "events")}
        print(f"skypilot elastic figures: {json.dumps(figures)}")
        return out
    finally:
        loop.close()


def _step(inc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in inc["steps"] if s["step"] == name)


def test_a_terminated_node_shrinks_the_group_onto_the_survivor(life: dict[str, Any]) -> None:
    lost = life["incidents"][0]
    assert lost["failure_class"] == "node_lost"
    select = _step(lost, "select_replacement")["detail"]
    assert "train at once as a group of 1" in select, select
    shrunk = next(a for a in life["attempts"] if a["number"] == life["shrunk_attempt"])
    assert shrunk["launch_verb"] == "shrink"


def test_the_replacement_came_as_standby_and_the_group_grew_back_to_two(
    life: dict[str, Any],
) -> None:
    classes = [i["failure_class"] for i in life["incidents"]]
    assert classes == ["node_lost", "elastic_grow"], classes
    grow = life["incidents"][1]
    assert _step(grow, "validate")["outcome"] == "ok"
    assert "restart in place as one group of 2" in _step(grow, "select_replacement")["detail"]
    last = life["attempts"][-1]
    assert len([n for n in last["nodes"] if n["ranks"]]) == 2


def test_the_cancel_leaves_no_instance_and_no_cluster(life: dict[str, Any]) -> None:
    assert life["instances_left"] == []
    assert life["sky_clusters_left"] == []
