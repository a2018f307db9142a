"""A restart in place or a refill whose cluster read SkyPilot did not answer is asked
again, never a refused verb. Found on the emulated AWS (issue 19, a transport error
in a rank): the restart's ``sky.status`` timed out once on a loaded machine ("sky.get
did not answer within 5 s"), the launcher raised a plain LaunchError, the reconciler
counted the restart in place as failed and launched a fresh cluster instead (about
two minutes of SkyPilot provisioning for a read that would have answered on the next
tick). Now the read's failure is SubmitUncertain: nothing was submitted, no failure
is recorded, and the next tick asks again with the same try. On the fake SDK of
test_skypilot_requests.py."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.launchers.base import LaunchHandle, LaunchRequest, SubmitUncertain
from tests.planner.test_skypilot_requests import A2, CLUSTER, FakeSky, lost_a_node, sky_launcher

pytestmark = pytest.mark.filterwarnings("ignore::Warning:sky")

PREVIOUS = LaunchHandle(CLUSTER, "skypilot", ("j-7-a1-n0", "j-7-a1-n1"), ("h0", "h1"), "r0")


class Unanswered(FakeSky):
    """``sky.status`` / ``sky.cancel`` time out (the connection to the API server) while
    ``unanswered`` names them; every other call answers."""

    def __init__(self, sky: Any) -> None:
        super().__init__(sky)
        self.unanswered: set[str] = set()

    def status(self, cluster_names: list[str] | None = None, **kw: Any) -> str:
        if "status" in self.unanswered:
            self.calls.append(("status", tuple(cluster_names or ()), kw))
            raise TimeoutError("sky.get did not answer within 5 s")
        return super().status(cluster_names, **kw)

    def cancel(self, cluster_name: str, all: bool = False, **kw: Any) -> str:
        if "cancel" in self.unanswered:
            self.calls.append(("cancel", cluster_name, {"all": all, **kw}))
            raise ConnectionError("the API server reset the connection")
        return super().cancel(cluster_name, all=all, **kw)


@pytest.fixture
def fake(sky: Any) -> Unanswered:
    return Unanswered(sky)


def request() -> LaunchRequest:
    return LaunchRequest(job_id="j-7", attempt=2, placement=A2, command="python train.py")


# A refill's forced refresh (bounded by submit_timeout_s, 30 s, inside the reconciler's
# transaction) stays a LaunchError: asked again every tick, it held SQLite's write lock
# 30 s a tick on the emulated AWS and the API timed out. Its cancel is asked again.
@pytest.mark.parametrize(
    "verb, unanswered", [("restart", "status"), ("restart", "cancel"), ("refill", "cancel")]
)
def test_an_unanswered_read_is_asked_again_and_the_same_try_then_submitted(
    fake: Unanswered, verb: str, unanswered: str
) -> None:
    launcher = sky_launcher(fake, poll_timeout_s=10.0, submit_timeout_s=10.0, status_ttl_s=0)
    if verb == "refill":
        lost_a_node(fake)
    else:
        fake.clusters[CLUSTER] = "UP"
    fake.unanswered = {unanswered}
    with pytest.raises(SubmitUncertain, match=r"nothing submitted|sky\.cancel"):
        getattr(launcher, verb)(PREVIOUS, request())
    kind = "launch" if verb == "refill" else "exec"
    assert fake.submitted(kind) == []  # nothing was submitted
    fake.unanswered = set()
    if verb == "refill":
        lost_a_node(fake)
    handle = getattr(launcher, verb)(PREVIOUS, request())
    (submitted,) = fake.submitted(kind)
    assert handle.cluster_name == CLUSTER and submitted[1]["cluster_name"] == CLUSTER
