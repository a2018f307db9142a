"""Every poller against the metadata simulator over HTTP: notice, none, and each fault."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest

from orchestrator.cloud import metadata as md
from orchestrator.cloud.simulator import MetadataSimulator

PROVIDERS = ["aws", "gcp", "azure"]
KIND = {"aws": "terminate", "gcp": "preempt", "azure": "preempt"}


def poller(sim: MetadataSimulator, provider: str, node: str = "n1", **kw):  # type: ignore[no-untyped-def]
    return md.poller_for(provider, sim.node_url(node), **kw)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_quiet_node_reads_none(sim: MetadataSimulator, provider: str) -> None:
    r = poller(sim, provider).poll()
    assert r.state == "none", r.error
    assert r.notice is None


@pytest.mark.parametrize("provider", PROVIDERS)
def test_scheduled_notice_is_normalized(sim: MetadataSimulator, provider: str) -> None:
    sim.schedule_notice("n1", provider, KIND[provider], 90)
    r = poller(sim, provider).poll()
    assert r.state == "notice", r.error
    assert r.notice is not None
    assert r.notice.provider == provider
    assert r.notice.kind == KIND[provider]
    assert r.notice.deadline is not None
    now = datetime.now(UTC)
    assert now < r.notice.deadline < now + timedelta(seconds=120)
    assert r.notice.raw


@pytest.mark.parametrize("provider", PROVIDERS)
def test_notice_on_another_node_is_not_seen(sim: MetadataSimulator, provider: str) -> None:
    sim.schedule_notice("other", provider, KIND[provider], 60)
    assert poller(sim, provider, "n1").poll().state == "none"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_cleared_notice_reads_none_again(sim: MetadataSimulator, provider: str) -> None:
    p = poller(sim, provider)
    sim.schedule_notice("n1", provider, KIND[provider], 60)
    assert p.poll().state == "notice"
    sim.clear_notice("n1")
    assert p.poll().state == "none"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_5xx_reads_unknown_never_none(sim: MetadataSimulator, provider: str) -> None:
    sim.set_faults("n1", errors_5xx=100)
    r = poller(sim, provider).poll()
    assert r.state == "unknown"
    assert "503" in r.error


@pytest.mark.parametrize("provider", PROVIDERS)
def test_garbage_body_reads_unknown(sim: MetadataSimulator, provider: str) -> None:
    sim.set_faults("n1", garbage=True)
    r = poller(sim, provider).poll()
    assert r.state == "unknown"
    assert r.error


@pytest.mark.parametrize("provider", PROVIDERS)
def test_unreachable_endpoint_reads_unknown(provider: str) -> None:
    # Port 9 on loopback: nothing listens, the connection is refused.
    r = md.poller_for(provider, "http://127.0.0.1:9", timeout=0.5).poll()
    assert r.state == "unknown"
    assert "127.0.0.1:9" in r.error


@pytest.mark.parametrize("provider", PROVIDERS)
def test_wrong_provider_format_reads_unknown(sim: MetadataSimulator, provider: str) -> None:
    # A poller pointed at a path tree that answers 404 for everything it asks.
    r = md.poller_for(provider, sim.url + "/nothing-here", timeout=0.5).poll()
    assert r.state == "unknown"


def test_aws_rebalance_recommendation_is_an_early_warning(sim: MetadataSimulator) -> None:
    sim.schedule_notice("n1", "aws", "rebalance", 300)
    r = poller(sim, "aws").poll()
    assert r.state == "notice"
    assert r.notice is not None and r.notice.kind == md.NoticeKind.rebalance
    assert r.notice.deadline is None


def test_aws_token_is_reused_until_near_expiry(sim: MetadataSimulator) -> None:
    now = [1000.0]
    p = poller(sim, "aws", token_ttl=100, refresh_margin=10, clock=lambda: now[0])
    for _ in range(3):
        assert p.poll().state == "none"
    assert sim.snapshot("n1")["counts"]["PUT /latest/api/token"] == 1
    now[0] += 95  # inside the refresh margin: a new token before the old one lapses
    assert p.poll().state == "none"
    counts = sim.snapshot("n1")["counts"]
    assert counts["PUT /latest/api/token"] == 2


def test_aws_revoked_token_is_refreshed_after_401(sim: MetadataSimulator) -> None:
    p = poller(sim, "aws")
    assert p.poll().state == "none"
    sim.set_faults("n1", revoke_tokens=True)
    sim.schedule_notice("n1", "aws", "stop", 120)
    r = p.poll()
    assert r.state == "notice", r.error
    assert r.notice is not None and r.notice.kind == md.NoticeKind.stop
    assert sim.snapshot("n1")["counts"]["PUT /latest/api/token"] == 2


def test_gcp_maintenance_event_is_a_notice(sim: MetadataSimulator) -> None:
    sim.schedule_notice("n1", "gcp", "maintenance", 60)
    r = poller(sim, "gcp").poll()
    assert r.state == "notice"
    assert r.notice is not None and r.notice.kind == md.NoticeKind.maintenance
    assert r.notice.raw == "TERMINATE_ON_HOST_MAINTENANCE"


def test_gcp_wait_for_change_returns_when_preempted(sim: MetadataSimulator) -> None:
    p = poller(sim, "gcp")
    assert p.poll().state == "none"
    assert p.last_etag
    timer = threading.Timer(0.3, sim.schedule_notice, ("n1", "gcp", "preempt", 30))
    timer.start()
    try:
        r = p.wait(timeout_s=30)
    finally:
        timer.cancel()
    assert r.state == "notice", r.error
    assert r.notice is not None and r.notice.kind == md.NoticeKind.preempt


def test_gcp_wait_with_stale_etag_answers_at_once(sim: MetadataSimulator) -> None:
    p = poller(sim, "gcp")
    assert p.poll().state == "none"
    sim.schedule_notice("n1", "gcp", "preempt", 30)
    # The etag the poller holds is for FALSE; the server has TRUE, so no waiting.
    assert p.wait(timeout_s=30).state == "notice"


def test_gcp_response_without_flavor_header_is_unknown(sim: MetadataSimulator) -> None:
    sim.set_faults("n1", garbage=True)
    r = poller(sim, "gcp").poll()
    assert r.state == "unknown"
    assert "Metadata-Flavor" in r.error


def test_azure_slow_first_call_succeeds_with_the_longer_first_timeout(
    sim: MetadataSimulator,
) -> None:
    sim.set_faults("n1", slow_first_call_s=1.0)
    p = poller(sim, "azure", timeout=0.2, first_timeout=10)
    assert p.poll().state == "none"
    assert p.poll().state == "none"  # later calls are fast and use the short timeout


def test_azure_slow_first_call_past_the_timeout_is_unknown(sim: MetadataSimulator) -> None:
    sim.set_faults("n1", slow_first_call_s=1.0)
    r = poller(sim, "azure", timeout=0.2, first_timeout=0.2).poll()
    assert r.state == "unknown"
    assert "timed out" in r.error


@pytest.mark.parametrize("kind", ["terminate", "reboot", "redeploy", "freeze"])
def test_azure_event_types_map_to_kinds(sim: MetadataSimulator, kind: str) -> None:
    sim.schedule_notice("n1", "azure", kind, 60)
    p = poller(sim, "azure")
    r = p.poll()
    assert r.state == "notice"
    assert r.notice is not None and r.notice.kind == kind
    assert isinstance(p.document_incarnation, int)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_detect_provider_recognizes_each_format(provider: str) -> None:
    with MetadataSimulator(providers=(provider,)) as only:
        assert md.detect_provider(only.node_url("n1")) == provider


def test_single_provider_simulator_serves_nothing_else() -> None:
    with MetadataSimulator(providers=("azure",)) as only:
        assert md.poller_for("aws", only.node_url("n1")).poll().state == "unknown"
        assert md.poller_for("azure", only.node_url("n1")).poll().state == "none"


def test_detect_provider_finds_nothing_on_a_dead_endpoint() -> None:
    assert md.detect_provider("http://127.0.0.1:9", timeout=0.3) is None


def test_unknown_provider_name_is_refused() -> None:
    with pytest.raises(ValueError, match="oracle"):
        md.poller_for("oracle")


@pytest.mark.parametrize(
    "provider, kind, raw, ends",
    [
        ("aws", "terminate", {}, True),
        ("aws", "stop", {}, True),
        ("aws", "rebalance", {}, False),  # an early warning; nothing is scheduled yet
        ("gcp", "preempt", "TRUE", True),
        ("gcp", "maintenance", "TERMINATE_ON_HOST_MAINTENANCE", True),  # spot and GPU VMs
        ("gcp", "maintenance", "MIGRATE_ON_HOST_MAINTENANCE", False),  # live migration
        ("azure", "preempt", {}, True),
        ("azure", "redeploy", {}, True),
        ("azure", "freeze", {}, False),  # a pause of seconds, memory kept
    ],
)
def test_a_notice_says_whether_the_vm_ends(provider: str, kind: str, raw: object, ends: bool):
    notice = md.Notice(md.Provider(provider), md.NoticeKind(kind), None, raw)
    assert notice.ends_vm is ends


@pytest.mark.parametrize("provider", list(md.Provider))
def test_every_provider_has_an_endpoint_its_kinds_and_a_reclaim_that_ends_the_vm(provider):
    # The tables keyed by provider are written beside the pollers; one that missed a
    # provider would be a KeyError on the node, or chaos that sends a kind never parsed.
    assert provider in md.DEFAULT_ENDPOINTS
    reclaim = md.RECLAIM_KIND[provider]
    assert reclaim in md.NOTICE_KINDS[provider]
    assert md.Notice(provider, reclaim, None, {}).ends_vm


def test_every_provider_is_a_cloud_a_spec_may_name():
    from orchestrator.contract import CLOUDS

    assert set(md.PROVIDERS) <= set(CLOUDS)
