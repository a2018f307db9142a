"""An incident names the line that decided its class (issue 23): a confident verdict
drains a host or fails a job fast, so the operator must see what it rests on."""

from __future__ import annotations

from test_protocol_store import start_running, world  # noqa: F401 - the fixture

from orchestrator.store.incidents import incidents

OOM = (
    "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
    "GPU 0 has a total capacity of 79.15 GiB of which 1.02 GiB is free."
)


def test_an_incident_names_the_log_line_that_decided_its_class(world) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    w = world
    start_running(w)
    tail = [
        "step 30 loss 2.1",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "train.py", line 88, in <module>',
        OOM,
        "[rank1]:[W1202 01:02:03.000000 ProcessGroupNCCL.cpp:1250] Warning: process group "
        "has NOT been destroyed before we destruct ProcessGroupNCCL.",
    ]
    w.report(1, 0, {"key": "e1", "kind": "rank_exit", "rank": 1, "exit_code": 1,
                    "log_tail": tail})  # fmt: skip
    for _ in range(5):
        w.tick()
        if w.status() == "RECOVERING":
            break
    with w.sm() as s:
        (inc,) = incidents(s, w.job)
    assert inc["failure_class"] == "cuda_oom"
    assert inc["confidence"] > 0.9
    assert inc["decided_by"] == OOM
