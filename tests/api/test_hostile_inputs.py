"""Hostile input, through the real app on SQLite and PostgreSQL: every one is a 4xx
that names what is wrong, nothing of it is stored, and the routes that read what was
stored keep answering 200 (each case below was a 500 once, some of them for good)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from testkit import job_spec, module_client

from orchestrator.api.limits import BODY_LIMIT, REPORT_BODY_LIMIT
from orchestrator.store.models import Attempt


def add_attempt(app, job_id: str, number: int = 1) -> None:  # type: ignore[no-untyped-def]
    with app.state.sessionmaker.begin() as s:
        s.add(
            Attempt(
                job_id=job_id, number=number, cloud="local", region="local",
                instance_type="cpu", num_nodes=1, spot=True, knobs={},
                started_at=datetime.now(UTC), state="running", launcher="local",
            )
        )  # fmt: skip


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One app per database for the whole module (a migrated database per test would
    cost more than the cases); each test makes its own job, so none sees another's."""
    yield from module_client(request, tmp_path_factory, "hostile")


def job_total(client) -> int:  # type: ignore[no-untyped-def]
    return int(client.get("/v1/jobs").json()["total"])


@pytest.fixture
def job(client) -> str:
    r = client.post("/v1/jobs", json=job_spec())
    assert r.status_code == 201, r.text
    add_attempt(client.app, r.json()["id"])
    return r.json()["id"]


def raw(client, url: str, text: str, ctype: str = "application/json"):  # type: ignore[no-untyped-def]
    """POST a body as these exact bytes (json= would escape or refuse what we test)."""
    return client.post(url, content=text.encode("utf-8"), headers={"content-type": ctype})


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def event_json(extra: str) -> str:
    return '{"idempotency_key": "k", "kind": "x", ' + extra + "}"


HOSTILE_EVENTS = [
    pytest.param(
        event_json('"rank": 18446744073709551616'), "rank: the integer", id="rank-65-bits"
    ),
    pytest.param(event_json('"rank": 2147483648'), "less than or equal", id="rank-over-int32"),
    pytest.param(event_json('"message": "a\\u0000b"'), "message: NUL", id="nul-message"),
    pytest.param(event_json('"details": {"k\\u0000": 1}'), "NUL", id="nul-key"),
    pytest.param(event_json('"message": "tr\\udce4in"'), "unpaired surrogate", id="lone-surrogate"),
    pytest.param(
        event_json('"details": {"loss": NaN}'), "details.loss: nan is not a finite", id="nan"
    ),
    pytest.param(event_json('"details": {"x": Infinity}'), "not a finite number", id="infinity"),
    pytest.param(
        event_json('"details": {"n": 1' + "0" * 30 + "}"), "beyond 64 bits", id="int-10e30"
    ),
    pytest.param(event_json('"details": ' + nested(40)), "nested deeper than 32", id="nested-40"),
    pytest.param(event_json('"details": ' + nested(5000)), "nested too deeply", id="nested-5000"),
    pytest.param(event_json('"node_id": "../../etc"'), "node_id", id="node-id-traversal"),
    pytest.param(event_json('"node_id": "a..b"'), "no path traversal", id="node-id-dotdot"),
    pytest.param(
        event_json('"occurred_at": "9999-12-31T23:00:00-05:00"'),
        "outside the years",
        id="year-10000",
    ),
    pytest.param(event_json('"colour": "red"'), "extra", id="unknown-field"),
]


def each(cases, check) -> None:  # type: ignore[no-untyped-def]
    """Run ``check(*case.values)`` for every case (one app per database keeps the
    default run short); all failures are reported, each under its case id."""
    failed = []
    for case in cases:
        try:
            check(*case.values)
        except AssertionError as e:
            failed.append(f"{case.id}: {e}")
    assert not failed, "\n".join(failed)


def test_a_hostile_event_is_a_4xx_naming_it_and_the_event_lists_stay_readable(client, job):
    def check(body: str, names: str) -> None:
        r = raw(client, f"/v1/jobs/{job}/events", body)
        assert r.status_code in (400, 422), r.text[:300]
        assert names in r.text, r.text[:300]
        listed = client.get(f"/v1/jobs/{job}/events")
        assert listed.status_code == 200 and listed.json()["items"] == []
        assert client.get("/v1/events", params={"limit": 1000}).status_code == 200

    each(HOSTILE_EVENTS, check)


LIST_BOUNDS = [
    pytest.param("/v1/jobs?offset=9223372036854775808", 422, id="offset-2**63"),
    pytest.param("/v1/jobs?offset=2147483647", 200, id="offset-int32-max"),
    pytest.param("/v1/jobs?limit=100000000000000000000", 422, id="limit-huge"),
    pytest.param("/v1/events?after=9223372036854775807", 200, id="cursor-int64-max"),
    pytest.param("/v1/events?after=9223372036854775808", 422, id="cursor-2**63"),
    pytest.param("/v1/jobs/j%00x", 422, id="nul-in-path"),
    pytest.param("/v1/jobs?status=%00", 422, id="nul-in-query"),
    pytest.param("/v1/jobs/JOB/events?after=-1", 422, id="negative-cursor"),
]


def test_list_bounds_are_422_or_an_empty_page_never_a_500(client, job):
    def check(url: str, status: int) -> None:
        r = client.get(url.replace("JOB", job))
        assert r.status_code == status, r.text[:300]
        if status == 422:
            assert r.json()["detail"]

    each(LIST_BOUNDS, check)


def test_non_ascii_commands_are_stored_and_come_back_unchanged(client):
    command = "python träin.py --tag 日本語 --emoji 🚀"
    by_json = client.post(
        "/v1/jobs", json=job_spec(task={"template": "gpt-cpu", "command": command})
    )
    assert by_json.status_code == 201, by_json.text
    doc = job_spec(name="yaml-job", task={"template": "gpt-cpu", "command": command})
    import yaml

    by_yaml = raw(client, "/v1/jobs", yaml.safe_dump(doc, allow_unicode=True), "application/yaml")
    assert by_yaml.status_code == 201, by_yaml.text
    for r in (by_json, by_yaml):
        got = client.get(f"/v1/jobs/{r.json()['id']}")
        assert got.status_code == 200 and got.json()["spec"]["task"]["command"] == command
    assert client.get("/v1/jobs").status_code == 200


HOSTILE_SPECS = [
    pytest.param(
        json.dumps(job_spec(checkpoint={"uri": "file:///../../etc"})),
        "checkpoint.uri",
        "'..'",
        id="checkpoint-uri-traversal",
    ),
    pytest.param(
        json.dumps(job_spec(checkpoint={"uri": "s3://bucket/a/../../b"})),
        "checkpoint.uri",
        "no path traversal",
        id="s3-uri-traversal",
    ),
    pytest.param(
        json.dumps(job_spec(task={"template": "../../../etc/passwd", "command": "c"})),
        "task.template",
        "not a template name",
        id="template-traversal",
    ),
    pytest.param(
        json.dumps(job_spec(task={"skypilot_yaml": "tasks/../../secret.yaml"})),
        "task.skypilot_yaml",
        "no path traversal",
        id="skypilot-yaml-traversal",
    ),
    pytest.param(
        json.dumps(job_spec(restarts={"heartbeat_timeout_s": 1.0})).replace("1.0", "Infinity"),
        "",
        "not a finite number",
        id="infinity-timeout",
    ),
    pytest.param(
        json.dumps(job_spec(restarts={"grace_period_s": 1e300})),
        "restarts.grace_period_s",
        "less than or equal",
        id="huge-grace",
    ),
    pytest.param(
        json.dumps(job_spec(checkpoint={"uri": "file:///c", "every_steps": 10**30})),
        "",
        "beyond 64 bits",
        id="every-steps-10e30",
    ),
    pytest.param(
        json.dumps(
            job_spec(
                model={
                    "parameters": 10**18,
                    "layers": 2,
                    "hidden_size": 8,
                    "heads": 2,
                    "seq_len": 8,
                    "global_batch": 8,
                    "micro_batch": 1,
                }
            )
        ),
        "model.parameters",
        "less than or equal",
        id="parameters-10e18",
    ),
    pytest.param(
        json.dumps(job_spec(task={"template": "gpt-cpu", "command": "a\x00b"})),
        "",
        "task.command: NUL",
        id="nul-command",
    ),
    pytest.param(
        json.dumps(job_spec(num_node=3)),
        "num_node",
        "unknown field",
        id="unknown-key-named",
    ),
]


def test_a_hostile_job_spec_is_422_naming_the_field_and_nothing_is_stored(client):
    def check(body: str, loc: str, msg: str) -> None:
        before = job_total(client)
        r = raw(client, "/v1/jobs", body)
        assert r.status_code == 422, r.text[:300]
        detail = r.json()["detail"]
        assert any(loc in ".".join(map(str, d["loc"])) and msg in d["msg"] for d in detail), detail
        assert job_total(client) == before

    each(HOSTILE_SPECS, check)


BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: [*c,*c,*c,*c,*c,*c,*c,*c,*c]
"""


HOSTILE_YAML = [
    pytest.param(BILLION_LAUGHS, "YAML aliases (*a) are not allowed", id="billion-laughs"),
    pytest.param(
        "a: " + "[" * 5000 + "]" * 5000, "YAML nested deeper than 32 levels", id="deep-yaml"
    ),
    pytest.param("name: !!python/object:os.system x", "unreadable YAML", id="python-tag"),
]


def test_hostile_yaml_is_refused_with_a_clear_error(client):
    def check(text: str, msg: str) -> None:
        r = raw(client, "/v1/jobs", text, "application/yaml")
        assert r.status_code == 422, r.text[:300]
        assert msg in r.text, r.text[:300]

    each(HOSTILE_YAML, check)


def test_bodies_over_their_limit_are_413_naming_it_and_never_read(client, job):
    big = "x" * (BODY_LIMIT + 1)
    r = raw(client, f"/v1/jobs/{job}/events", event_json(f'"message": "{big}"'))
    assert r.status_code == 413 and f"{BODY_LIMIT} bytes" in r.json()["detail"]
    assert len(r.content) < 1000
    report = '{"key": "k", "kind": "anomaly", "rank": 0, "finding": "loss_spike", "detail": "'
    r = raw(client, f"/v1/jobs/{job}/attempts/1/nodes/n0/reports", report + big * 4 + '"}')
    assert r.status_code == 413 and f"{REPORT_BODY_LIMIT} bytes" in r.json()["detail"]


def test_a_chunked_body_over_the_limit_is_413_too(client, job):
    def chunks():  # no Content-Length: the limit is counted as the body is read
        yield b'{"idempotency_key": "k", "kind": "x", "message": "'
        for _ in range(BODY_LIMIT // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    r = client.post(
        f"/v1/jobs/{job}/events", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413, r.text
    assert "limit" in r.json()["detail"]


def test_a_422_never_echoes_a_large_input_back(client, job):
    big = "y" * (BODY_LIMIT // 2)  # under the body limit, over the message's 65536
    r = raw(client, f"/v1/jobs/{job}/events", event_json(f'"message": "{big}"'))
    assert r.status_code == 422
    assert len(r.content) < 2000, len(r.content)
    assert "characters, cut" in r.text and "at most 65536 characters" in r.text


def report_url(job: str, attempt: int | str = 1) -> str:
    return f"/v1/jobs/{job}/attempts/{attempt}/nodes/n0/reports"


HOSTILE_REPORTS = [
    pytest.param(1, {"step": 10**30}, "step: the integer", id="step-10e30"),
    pytest.param(1, {"step": 2**31}, "less than or equal", id="step-over-int32"),
    pytest.param(2**63, {"step": 1}, "less than or equal", id="attempt-2**63"),
    pytest.param(1, {"step": 1, "path": "/d/\x00"}, "NUL", id="nul-path"),
    pytest.param(1, {"step": 1, "blocking_s": float("inf")}, "finite", id="inf-blocking"),
]


def test_a_hostile_report_is_422_every_time_it_is_retried(client, job):
    def check(attempt: int, body: dict[str, Any], names: str) -> None:
        doc = {"key": "ckpt", "kind": "checkpoint", **body}
        text = json.dumps(doc)  # allow_nan: Infinity goes out as an agent's json.dumps does
        for _ in range(2):  # an agent's outbox retries what answered 5xx: this never does
            r = raw(client, report_url(job, attempt), text)
            assert r.status_code == 422, r.text[:300]
            assert names in r.text, r.text[:300]
        assert client.get(f"/v1/jobs/{job}/events").json()["items"] == []

    each(HOSTILE_REPORTS, check)


def test_a_deeply_nested_report_detail_is_refused(client, job):
    text = (
        '{"key": "n", "kind": "anomaly", "rank": 0, "finding": "loss_spike", "detail": '
        + nested(100)
        + "}"
    )
    r = raw(client, report_url(job), text)
    assert r.status_code == 422 and "nested deeper than 32" in r.text


def test_shell_and_html_in_names_are_stored_as_text_and_shown_escaped(client, job):
    evil = "$(rm -rf /); `reboot` <script>alert(1)</script> && echo pwned"
    r = client.post(
        "/v1/jobs",
        json=job_spec(name="evil-cmd", task={"template": "gpt-cpu", "command": evil}),
    )
    assert r.status_code == 201 and r.json()["spec"]["task"]["command"] == evil
    e = client.post(
        f"/v1/jobs/{job}/events",
        json={"idempotency_key": "e", "kind": "note", "message": evil, "node_id": "n0"},
    )
    assert e.status_code == 201 and e.json()["message"] == evil
    login = client.post(
        "/dashboard/login", data={"token": client.app.state.token}, follow_redirects=False
    )
    assert login.status_code == 303
    page = client.get(f"/dashboard/jobs/{job}")
    assert page.status_code == 200
    assert "<script>alert(1)</script>" not in page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
