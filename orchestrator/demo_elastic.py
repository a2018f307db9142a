"""``skyresume demo --elastic``: an elastic job shrinks onto its survivors and grows
back, on this machine, on embedded defaults.

The service, nodes and S3 store are ``skyresume demo``'s (orchestrator/demo.py); every
local launch waits :data:`PROVISION_DELAY_S` before its nodes boot, as a cloud VM
does. The job is 3 nodes x 1 CPU rank with ``min_nodes: 2``, a global batch of 12 in
micro-batches of 2 (4 samples a rank on 3 ranks, 6 on 2: it splits both ways). Then:

1. past step 25, every process of node 2 SIGKILLed: the 2 survivors restart at once
   as a group of 2 from the last checkpoint (an incident of class ``node_lost`` whose
   SELECT says ``shrink:``), and the replacement launches beside them as a standby
   node, whose agent registers and starts no ranks;
2. once it registered the service records a ``grow`` and opens an ``elastic_grow``
   incident: the ranks save at the next step boundary and the 3 nodes restart as one
   group;
3. training on to the end.

The demo injects the kill and watches. Everything it prints about what happened is
read back from the service (incidents, attempts and events, through the REST API),
and what it expects is checked against those records, never printed in their place.
It exits 0 only when the job succeeded, the node loss shrank the group to 2 nodes, the
standby replacement came, the grow lost no step, every resume validated, and the
attempts trained on 3, then 2, then 3 nodes.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from orchestrator.demo import (
    DemoError,
    DemoService,
    announce,
    api_get,
    api_post,
    console,
    demo_failed,
    incident_step,
    job_spec,
    step_detail,
    wait_for,
    wind_down,
)
from orchestrator.incident_report import incident_table

#: Seconds every local launch provisions before its setup runs (the first one too).
#: The standby replacement takes this plus its setup to register, and the survivors
#: train as a group of 2 all that time: long enough to be seen, short enough that the
#: demo takes a few minutes.
PROVISION_DELAY_S = 20
#: The fewest steps that leave the shrunk group steps to run when the replacement
#: comes (the kill at step 25, about 0.3 s a step on 2 cores, the replacement ~40 s).
MIN_STEPS = 200
NUM_NODES, MIN_NODES = 3, 2
GLOBAL_BATCH, MICRO_BATCH = 12, 2  # 4 samples a rank on 3 ranks, 6 on 2
KILL_AT_STEP = 25
KILLED_NODE = 2  # not node 0: the survivors keep rank 0 and its rendezvous
#: Event kinds the demo prints as the service records them (the elastic decisions,
#: the loss and the grow, a launch refused).
SHOWN_EVENTS = frozenset({"node_lost", "elastic", "grow", "launch_failed", "replanned"})


def elastic_spec(home: Path, steps: int, checkpoint_uri: str | None) -> dict[str, Any]:
    spec = job_spec(home, steps, checkpoint_uri)
    spec["task"]["command"] = (
        f"{sys.executable} -m training.examples.train_gpt --max-steps {steps} "
        f"--global-batch {GLOBAL_BATCH} --micro-batch {MICRO_BATCH} --step-sleep 0.25 "
        f"--save-final {home / 'final_weights.pt'}"
    )
    spec.update(
        name="demo-elastic",
        num_nodes=NUM_NODES,
        min_nodes=MIN_NODES,
        ranks_per_node=1,
        # The weighing (domain/elastic.py) would wait: a replacement that is up in
        # tens of seconds gains the survivors less than the grow back costs. The demo
        # is of the shrink and the grow, so it asks for them; SELECT still prints the
        # figures it weighed.
        elastic={"shrink": "always"},
    )
    return spec


@dataclass(frozen=True)
class Phase:
    """One attempt that trained, as ``GET /v1/jobs/{id}/attempts`` records it."""

    attempt: int
    verb: str
    training: int
    """Nodes whose ranks reported progress."""
    standby: int
    """Nodes registered with no ranks: a shrunk attempt's spare."""
    first_step: int
    """The step its ranks resumed at (0: a fresh start)."""
    last_step: int
    """The highest step its ranks reported."""


def phases(attempts: list[dict[str, Any]]) -> list[Phase]:
    """The attempts whose ranks reported a step, in order."""
    out = []
    for a in attempts:
        steps = [r["step"] for n in a["nodes"] for r in n["ranks"] if r.get("step") is not None]
        if not steps:
            continue
        start = a["validated_step"] if a["validated_step"] is not None else a["resume_step"]
        out.append(
            Phase(
                attempt=a["number"],
                verb=a["launch_verb"],
                # A warm shrink carried some of its nodes on into the next attempt: each
                # node is listed once, where it is now, and named here in ``carried``.
                training=sum(1 for n in a["nodes"] if n["ranks"]) + len(a.get("carried") or []),
                standby=sum(1 for n in a["nodes"] if not n["ranks"]),
                first_step=start or 0,
                last_step=max(steps),
            )
        )
    return out


def seconds_between(earlier: str, later: str) -> float:
    """Seconds between two of the service's timestamps (ISO 8601, any offset)."""
    return (datetime.fromisoformat(later) - datetime.fromisoformat(earlier)).total_seconds()


def elastic_problems(
    job: dict[str, Any],
    incidents: list[dict[str, Any]],
    attempts: list[dict[str, Any]],
    events: list[dict[str, Any]],
    killed_node: str,
) -> list[str]:
    """What the records show went wrong with the shrink and the grow; [] when nothing
    did."""
    problems = []
    if job["status"] != "SUCCEEDED":
        problems.append(f"job ended {job['status']}: {job.get('status_reason')}")
    classes = [i["failure_class"] for i in incidents]
    if classes != ["node_lost", "elastic_grow"]:
        problems.append(f"expected node_lost, elastic_grow; got {classes}")
    lost = next((i for i in incidents if i["failure_class"] == "node_lost"), None)
    if lost is not None:
        if lost["node_id"] != killed_node:
            problems.append(f"the node lost is {lost['node_id']}, not the killed {killed_node}")
        select = step_detail(lost, "select_replacement")
        if not select.startswith("shrink:"):
            problems.append(f"the node loss did not shrink: {select}")
    grow = next((i for i in incidents if i["failure_class"] == "elastic_grow"), None)
    if grow is not None and grow["steps_lost"] != 0:
        problems.append(f"the grow lost {grow['steps_lost']} steps (expected 0)")
    for i in incidents:
        v = incident_step(i, "validate")
        if v is None or v["outcome"] != "ok":
            problems.append(f"incident {i['id']} ({i['failure_class']}) did not validate")
    if not any(e["kind"] == "grow" for e in events):
        problems.append("no grow was recorded: the standby replacement never registered")
    shape = [(p.training, p.standby) for p in phases(attempts)]
    if shape != [(NUM_NODES, 0), (MIN_NODES, NUM_NODES - MIN_NODES), (NUM_NODES, 0)]:
        problems.append(
            f"expected attempts of 3 nodes, 2 nodes + 1 standby, 3 nodes; got (training, "
            f"standby) {shape}"
        )
    return problems


class EventFeed:
    """The job's events as the service records them, each printed once (a cursor)."""

    def __init__(self, http: Any, job: str) -> None:
        self.http, self.job, self.cursor = http, job, 0
        self.seen: list[dict[str, Any]] = []

    def show(self) -> None:
        while True:
            page = api_get(self.http, f"/v1/jobs/{self.job}/events?after={self.cursor}&limit=500")
            for e in page["items"]:
                self.seen.append(e)
                if e["kind"] in SHOWN_EVENTS:
                    console.print(f"  [cyan]event {e['kind']}[/cyan]: {e['message']}")
            self.cursor = page["next_cursor"]
            if len(page["items"]) < 500:
                return

    def watching(self, until: Any) -> Any:
        """``until`` for :func:`orchestrator.demo.wait_for` that prints new events first."""

        def check(*state: Any) -> bool:
            self.show()
            return bool(until(*state))

        return check


def _incident(http: Any, job: str, failure_class: str) -> dict[str, Any]:
    incs = api_get(http, f"/v1/jobs/{job}/incidents")["items"]
    found = [i for i in incs if i["failure_class"] == failure_class]
    if not found:
        raise DemoError(f"no {failure_class} incident was recorded; incidents: "
                        f"{[i['failure_class'] for i in incs]}")  # fmt: skip
    return dict(found[-1])


def _attempt(http: Any, job: str, number: int) -> dict[str, Any]:
    atts = api_get(http, f"/v1/jobs/{job}/attempts")["items"]
    return dict(next(a for a in atts if a["number"] == number))


def _steps(inc: dict[str, Any], *names: str) -> None:
    for name in names:
        console.print(f"  {name}: {step_detail(inc, name)}")


def run_demo(home: Path | None = None, steps: int = MIN_STEPS, timeout_s: float = 900.0) -> int:
    home = Path(home) if home else Path(tempfile.mkdtemp(prefix="skyresume-demo-elastic-"))
    home.mkdir(parents=True, exist_ok=True)
    steps = max(steps, MIN_STEPS)
    deadline = time.monotonic() + timeout_s
    console.print(f"[bold]skyresume demo --elastic[/bold]: state in {home}")
    env = {"SKYRESUME_LOCAL_PROVISION_DELAY_S": str(PROVISION_DELAY_S)}
    svc = DemoService(home, env=env, s3=True)
    job = None
    http = None
    try:
        http = svc.wait_ready()
        announce(svc)
        console.print(f"checkpoints: {svc.checkpoint_uri} (SeaweedFS S3 at {svc.s3.endpoint_url})")
        console.print(f"every launch provisions for {PROVISION_DELAY_S} s before its setup "
                      "(SKYRESUME_LOCAL_PROVISION_DELAY_S), as a cloud VM boots")  # fmt: skip
        job = str(api_post(http, "/v1/jobs", elastic_spec(home, steps, svc.checkpoint_uri))["id"])
        console.print(
            f"submitted job {job}: {NUM_NODES} nodes x 1 CPU rank (gloo), min_nodes {MIN_NODES}, "
            f"global batch {GLOBAL_BATCH} in micro-batches of {MICRO_BATCH}, {steps} steps"
        )
        feed = EventFeed(http, job)

        console.print(f"[bold]1.[/bold] waiting for training to pass step {KILL_AT_STEP}")
        s = wait_for(http, job, f"step {KILL_AT_STEP}", feed.watching(
            lambda st, n, v, step: v is not None and step >= KILL_AT_STEP), deadline)  # fmt: skip
        if s[0] != "RUNNING":
            raise DemoError(f"job is {s[0]} before the kill")
        first = s[1]
        console.print(f"[bold]2.[/bold] node {KILLED_NODE} killed without notice "
                      "(every process, SIGKILL)")  # fmt: skip
        killed = api_post(http, f"/v1/jobs/{job}/chaos",
                          {"action": "kill-node", "node": KILLED_NODE})  # fmt: skip
        s = wait_for(http, job, "the shrunk group's resume", feed.watching(
            lambda st, n, v, step: n > first and v is not None), deadline)  # fmt: skip
        if s[0] != "RUNNING":
            raise DemoError(f"job is {s[0]} after the kill")
        lost = _incident(http, job, "node_lost")
        shrunk = _attempt(http, job, s[1])
        ran = [n for n in shrunk["nodes"] if n["ranks"]]
        resumed = incident_step(lost, "validate") or {}
        if not resumed.get("finished_at"):
            raise DemoError(f"attempt {s[1]} validated, but incident {lost['id']} did not")
        to_step = seconds_between(killed["at"], resumed["finished_at"])
        console.print(f"[bold]the shrink[/bold] (incident {lost['id']}, {lost['failure_class']} "
                      f"of {lost['node_id']}):")  # fmt: skip
        _steps(lost, "select_replacement", "launch", "validate")
        console.print(
            f"  attempt {shrunk['number']} ({shrunk['launch_verb']}): {len(ran)} nodes train "
            f"({', '.join(n['node_id'] for n in ran)}); from the kill to the first shrunk "
            f"step (every rank resumed): {to_step:.1f} s; {lost['steps_lost']} steps lost"
        )

        console.print("[bold]3.[/bold] the replacement provisions beside them as standby; "
                      "the 2 nodes train meanwhile")  # fmt: skip
        s = wait_for(http, job, "the grow", feed.watching(
            lambda st, n, v, step: n > shrunk["number"] and v is not None), deadline)  # fmt: skip
        if s[0] != "RUNNING":
            raise DemoError(f"job is {s[0]} before the group grew back")
        grown = next((e for e in feed.seen if e["kind"] == "grow"), None)
        if grown is None:
            raise DemoError(f"attempt {s[1]} followed the shrunk one, but no grow was recorded")
        spares = [n for n in _attempt(http, job, shrunk["number"])["nodes"] if not n["ranks"]]
        console.print(
            f"  standby {', '.join(n['node_id'] for n in spares) or '(none recorded)'} "
            f"registered with no ranks; the service recorded the grow "
            f"{seconds_between(killed['at'], grown['occurred_at']):.1f} s after the kill, "
            f"{seconds_between(resumed['finished_at'], grown['occurred_at']):.1f} s into the "
            f"shrunk group's training"
        )
        grow = _incident(http, job, "elastic_grow")
        console.print(f"[bold]the grow[/bold] (incident {grow['id']}, {grow['failure_class']}):")
        _steps(grow, "signal", "confirm_checkpoint", "select_replacement", "validate")
        mttr = grow["mttr_s"]
        console.print(f"  MTTR {'-' if mttr is None else f'{mttr:.1f}'} s, "
                      f"{grow['steps_lost']} steps lost")  # fmt: skip

        console.print("[bold]4.[/bold] training on to the end")
        wait_for(http, job, "the end", feed.watching(
            lambda st, n, v, step: st == "SUCCEEDED"), deadline)  # fmt: skip
        feed.show()
        return _report(http, job, svc, home, killed["node_id"], feed.seen)
    except DemoError as e:
        return demo_failed(e, http, job, home)
    finally:
        wind_down(svc, http, job)


def _report(
    http: Any, job: str, svc: DemoService, home: Path, killed: str, events: list[dict[str, Any]]
) -> int:
    j = api_get(http, f"/v1/jobs/{job}")
    incs = api_get(http, f"/v1/jobs/{job}/incidents")["items"]
    atts = api_get(http, f"/v1/jobs/{job}/attempts")["items"]
    console.print(incident_table(incs))
    console.print("phases (the attempts that trained):")
    for p in phases(atts):
        nodes = f"{p.training} nodes" + (f" + {p.standby} standby" if p.standby else "")
        console.print(
            f"  attempt {p.attempt}  {p.verb:15} {nodes:20} steps {p.first_step} -> "
            f"{p.last_step} ({p.last_step - p.first_step} steps)"
        )
    console.print(f"final status: {j['status']} ({j.get('status_reason')})")
    console.print(
        f"dashboard: SKYRESUME_HOME={home} skyresume serve --port {svc.port}, "
        f"then open {svc.url}/dashboard"
    )
    problems = elastic_problems(j, incs, atts, events, killed)
    for problem in problems:
        console.print(f"[red]check failed:[/red] {problem}")
    if problems:
        return 1
    console.print("[green]demo passed[/green]: shrunk to 2 nodes at once, grown back to 3 "
                  "with no step lost, training finished")  # fmt: skip
    return 0
