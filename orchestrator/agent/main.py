"""``skyresume-agent``: the node agent. One per node per attempt; protocol in docs/agent.md.

Stdlib only (plus the stdlib-only ``orchestrator.contract`` and
``orchestrator.cloud.metadata``), so it starts fast and the user's environment cannot
break it.

Threads, each of which only *asks* for a stop (``begin_stop`` is the one place that
signals ranks, under a lock, and is idempotent):

* ``metadata``: polls the cloud's notice endpoint from boot; on a notice it SIGTERMs
  every local rank at once *before* any HTTP, then reports ``preemption_notice``;
* ``heartbeat``: registers, then one heartbeat per ``--heartbeat-s`` for the node;
* ``commands``: long-polls the service for commands;
* ``reports``: sends queued reports in order, retrying while the service is away;
* ``progress-udp``: aggregates the ranks' datagrams;
* the main thread supervises: discovers rank pids, watches them exit (50 ms), enforces
  the grace deadline with SIGKILL, and at the end reports and picks the exit code.

A 409 from the service on anything means the attempt was superseded: stop the ranks
(5 s grace) and exit. An unreachable service is retried with backoff while training
goes on: a service restart must not cost a step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import queue
import secrets
import shlex
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from orchestrator import __version__
from orchestrator.agent import evidence as ev
from orchestrator.agent import health as hc
from orchestrator.agent import logtail
from orchestrator.agent import ranks as rk
from orchestrator.agent import stage as st
from orchestrator.agent.client import (
    AgentRefused,
    Answer,
    Busy,
    ServiceClient,
    Superseded,
    Unreachable,
    backoff_delays,
    busy_wait,
    told_interval,
)
from orchestrator.agent.progress import ProgressBoard, ProgressListener, finite
from orchestrator.cloud import metadata as md
from orchestrator.contract import (
    AGENT_PROTOCOL,
    ANOMALY_FINDINGS,
    MEMBERSHIP_KEY,
    CommandType,
    Env,
    ExitCode,
    FaultKind,
    Membership,
    ReportKind,
)
from orchestrator.package import installed_build_id

log = logging.getLogger("skyresume.agent")

TOKEN_ENV = "SKYRESUME_AGENT_TOKEN"
#: Grace for ``stop`` commands and for a superseded attempt (docs/agent.md).
STOP_GRACE_S = 5.0
#: Elastic runs: how long a rank that left its group (a peer lost) waits for the
#: membership a warm shrink hands it (``REGROUP_TIMEOUT_S``) before it exits for a cold
#: restart. It covers the service's detection, SIGNAL, CONFIRM, SELECT and LAUNCH; any
#: remedy other than a warm shrink restarts the node cold well before it.
REGROUP_WAIT_S = 180
#: How long the long-poll for commands waits per request. Short enough that a service
#: shutting down gracefully (which waits for in-flight requests) is not held long.
COMMAND_WAIT_S = 10.0
#: A heartbeat asked for early (``Agent.beat_soon``) goes this long after the ask: the
#: other ranks' datagrams of the same regroup or resume come within it.
EARLY_BEAT_GAP_S = 0.1
#: How long the agent tries to deliver its last reports before it exits anyway.
FINAL_FLUSH_S = 30.0
#: Rank watcher period.
WATCH_S = 0.05

EXIT_OK = 0
EXIT_SAVED = int(ExitCode.PREEMPTED_SAVED)
EXIT_FAILED = 1
EXIT_USAGE = 2
#: A pre-flight health check failed: torchrun was never started (sysexits EX_UNAVAILABLE).
EXIT_HEALTH_CHECK_FAILED = 69
#: The service refused this agent's version or protocol at register: nothing was (or
#: stays) started (sysexits EX_SOFTWARE: the wrong software for this service).
EXIT_AGENT_MISMATCH = 70
#: The checkpoint to resume could not be staged onto the node: torchrun was never started.
EXIT_STAGE_FAILED = int(ExitCode.CHECKPOINT_INVALID)


class UsageError(ValueError):
    """A bad flag; the message names it."""


@dataclass(frozen=True)
class AgentConfig:
    job_id: str
    attempt: int
    node_id: str
    node_rank: int
    nnodes: int
    nproc_per_node: int
    command: tuple[str, ...]
    service_url: str | None = None
    """None: no service (local-only; used by the fan-out benchmark's bare runs)."""
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    provider: str = "none"
    metadata_url: str | None = None
    local_dir: Path = Path(".")
    log_dir: Path = Path(".")
    grace_s: float = 90.0
    heartbeat_s: float = 1.0
    poll_s: float = 1.0
    launcher: str = "torchrun"
    final_flush_s: float = FINAL_FLUSH_S
    notice_action: str = "sigterm"
    """``sigterm``: act on a notice locally, then report. ``report``: only report it and
    wait for the service's command (the service round trip; the fan-out bench's baseline)."""
    health_checks: bool = True
    """Check the node (health.py) before starting torchrun; a failure means no torchrun."""
    expect_gpus: int = 0
    """GPUs the placement declares per node; 0: ranks on CPU (the GPU check is skipped)."""
    min_free_disk_gb: float = hc.DEFAULT_MIN_FREE_DISK_GB
    max_clock_skew_s: float = hc.DEFAULT_MAX_CLOCK_SKEW_S
    store_timeout_s: float = hc.DEFAULT_STORE_TIMEOUT_S
    service_wait_s: float = 5.0
    """How long the health checks wait for the service's first answer (the clock check)."""
    min_allreduce_gbps: float = 0.0
    """All-reduce bus bandwidth across the nodes the job needs before training; 0: none."""
    allreduce_check_port: int | None = None
    standby: bool = False
    """A replacement held ready beside a shrunk group (``Env.STANDBY``): register,
    heartbeat and check the node, start no ranks, ignore stop commands (it has no
    ranks to stop) until the group grows onto it or it is given back."""
    """The check's TCP store port on the master node (default: master port + 1)."""
    ca_pem: str | None = None
    """PEM certificates an ``https://`` service URL is verified against; None: the
    node's trust store."""
    sky_task_id: str | None = None
    """SkyPilot's task id (``SKYPILOT_TASK_ID``, with --from-env): logged, so the agent's
    log can be matched with SkyPilot's."""
    print_config: bool = False
    """Print this configuration as JSON and exit (``--print-config``)."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def control_file(self) -> Path:
        return self.local_dir / "control.json"


def _positive(name: str, value: float) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise UsageError(f"{name} must be a positive number, got {value!r}")
    return value


class NodeEnv:
    """What ``--from-env`` reads: SkyPilot's facts about the node, and the SKYRESUME_*
    values the task templates declare (``Env`` has the SKYRESUME_RUN_* run context).
    A flag given as well wins over its variable."""

    NODE_RANK = "SKYPILOT_NODE_RANK"
    #: One IP per line, node rank order: the first is the rendezvous master.
    NODE_IPS = "SKYPILOT_NODE_IPS"
    NUM_NODES = "SKYPILOT_NUM_NODES"
    #: 0 or unset: CPU nodes, which run RANKS_PER_NODE ranks.
    GPUS_PER_NODE = "SKYPILOT_NUM_GPUS_PER_NODE"
    TASK_ID = "SKYPILOT_TASK_ID"
    #: The user's command as one string, split with shlex (never by a shell).
    COMMAND = "SKYRESUME_COMMAND"
    RANKS_PER_NODE = "SKYRESUME_RANKS_PER_NODE"
    MASTER_PORT = "SKYRESUME_MASTER_PORT"
    PROVIDER = "SKYRESUME_PROVIDER"
    METADATA_URL = "SKYRESUME_METADATA_URL"
    GRACE_S = "SKYRESUME_GRACE_S"
    HEARTBEAT_S = "SKYRESUME_HEARTBEAT_S"
    POLL_S = "SKYRESUME_POLL_S"
    #: The node directory (``~`` allowed), one per attempt and try on SkyPilot: an old
    #: job SkyPilot has not cancelled yet must never share control.json and logs with
    #: the new one (SKYPILOT.md defect 6). Unset: ``~/skyresume/node``.
    NODE_DIR = "SKYRESUME_NODE_DIR"


#: The token in run-context values that names this node's local disk directory.
NODE_DISK_TOKEN = "{node_disk}"


def substitute_node_disk(environ: Mapping[str, str], node_disk: Path) -> dict[str, str]:
    """``environ`` with ``{node_disk}`` in every SKYRESUME_RUN_* value replaced by this
    node's disk directory (the service names paths on a disk it has never seen, such
    as the staged checkpoint ``{node_disk}/staged/step_300``). Other variables are
    left alone: the user's own may hold braces."""
    out = dict(environ)
    for k, v in environ.items():
        if k.startswith("SKYRESUME_RUN_") and NODE_DISK_TOKEN in v:
            out[k] = v.replace(NODE_DISK_TOKEN, str(node_disk))
    return out


def split_command(text: str, *, source: str) -> list[str]:
    """The rank command from one string, split as ``shlex.split`` does: quotes group,
    nothing is expanded (no ``$VAR``, ``$(...)``, globs), nothing runs. Every launcher
    hands the command over this way, so a command means the same everywhere."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise UsageError(f"{source} is not a valid command line ({e}): {text!r}") from None
    if not words:
        raise UsageError(f"{source} is empty: give the command each rank runs")
    return words


def _from_env(
    environ: Mapping[str, str], name: str, kind: Callable[[str], Any], *, empty_is_unset: bool
) -> Any:
    raw = environ.get(name)
    if raw is None or (empty_is_unset and not raw.strip()):
        return None
    try:
        return kind(raw.strip())
    except ValueError:
        raise UsageError(f"${name} must be {kind.__name__}, got {raw!r}") from None


def _number(raw: str) -> float:
    return float(raw)


_number.__name__ = "a number"


def _integer(raw: str) -> int:
    return int(raw)


_integer.__name__ = "an integer"


def _text(raw: str) -> str:
    return raw


_text.__name__ = "text"


def parse_args(argv: list[str], environ: Mapping[str, str] | None = None) -> AgentConfig:
    """Flags, then ``--``, then the command every rank runs (or ``--command STRING``).

    With ``--from-env`` every unset flag comes from the environment SkyPilot and the
    task template give the node (:class:`NodeEnv`, the SKYRESUME_RUN_* run context),
    so a template's run section is one line and nothing about starting the agent is
    written twice."""
    env = os.environ if environ is None else environ
    if "--" in argv:
        i = argv.index("--")
        flags, command = argv[:i], argv[i + 1 :]
    else:
        flags, command = argv, []
    p = argparse.ArgumentParser(
        prog="skyresume-agent",
        description="skyresume node agent: runs one node's ranks and talks to the service.",
        epilog="Everything after -- is the command each rank runs (or --command STRING, "
        "split like shlex.split). "
        f"The service token comes from ${TOKEN_ENV}, never argv.",
    )
    p.add_argument(
        "--from-env",
        action="store_true",
        help="take unset flags from SkyPilot's SKYPILOT_* variables and the template's "
        "SKYRESUME_* ones (the command from $SKYRESUME_COMMAND)",
    )
    p.add_argument("--command", help="the rank command as one string, split like shlex.split")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration as JSON and exit (nothing is started)",
    )
    p.add_argument("--service-url", help="e.g. http://10.0.0.5:8470 (omit: no service)")
    p.add_argument(
        "--ca-bundle",
        help=f"PEM file to verify an https service URL with (with --from-env: ${Env.CA_PEM}, "
        "the PEM text itself); default: the node's trust store",
    )
    p.add_argument("--job-id")
    p.add_argument("--attempt", type=int)
    p.add_argument("--node-id", help="default with --from-env: <job>-a<attempt>-n<node rank>")
    p.add_argument("--node-rank", type=int)
    p.add_argument("--nnodes", type=int)
    p.add_argument("--nproc-per-node", type=int)
    p.add_argument("--master-addr")
    p.add_argument("--master-port", type=int)
    p.add_argument("--provider", choices=[*md.PROVIDERS, "auto", "none"])
    p.add_argument(
        "--metadata-url", help="base URL of the metadata endpoint (default: the real one)"
    )
    p.add_argument(
        "--local-dir", help="the node's local disk directory (--from-env: ~/skyresume/node)"
    )
    p.add_argument("--log-dir", help="rank and agent logs (default: <local-dir>/logs)")
    p.add_argument("--grace-s", type=float, help="SIGTERM -> SIGKILL grace (default 90)")
    p.add_argument("--heartbeat-s", type=float)
    p.add_argument("--poll-s", type=float, help="metadata poll interval")
    p.add_argument("--launcher", default="torchrun", choices=["torchrun", "direct"])
    p.add_argument("--final-flush-s", type=float, default=FINAL_FLUSH_S)
    p.add_argument(
        "--notice-action",
        default="sigterm",
        choices=["sigterm", "report"],
        help="on a notice: SIGTERM the ranks at once (default), or only report it and wait "
        "for the service's command (a baseline for bench/fanout.py)",
    )
    p.add_argument(
        "--health-checks",
        choices=["on", "off"],
        default=env.get(hc.HEALTH_CHECKS_ENV, "on"),
        help=f"check the node before starting torchrun (env ${hc.HEALTH_CHECKS_ENV})",
    )
    p.add_argument(
        "--expect-gpus",
        type=int,
        help="GPUs the placement declares per node; 0 = CPU ranks, no GPU check "
        f"(env ${hc.EXPECT_GPUS_ENV}; --from-env: ${NodeEnv.GPUS_PER_NODE})",
    )
    p.add_argument(
        "--min-free-disk-gb",
        type=float,
        default=hc.env_float(dict(env), hc.MIN_FREE_DISK_GB_ENV, hc.DEFAULT_MIN_FREE_DISK_GB),
        help="free space the checkpoint tier needs (the service's estimate; "
        f"env ${hc.MIN_FREE_DISK_GB_ENV})",
    )
    p.add_argument(
        "--max-clock-skew-s",
        type=float,
        default=hc.env_float(dict(env), hc.MAX_CLOCK_SKEW_S_ENV, hc.DEFAULT_MAX_CLOCK_SKEW_S),
    )
    p.add_argument("--store-timeout-s", type=float, default=hc.DEFAULT_STORE_TIMEOUT_S)
    p.add_argument(
        "--min-allreduce-gbps",
        type=float,
        default=hc.env_float(dict(env), hc.MIN_ALLREDUCE_GBPS_ENV, 0.0),
        help="before torchrun, all-reduce across the nodes and fail below this bus "
        f"bandwidth (GB/s; 0 = no check; env ${hc.MIN_ALLREDUCE_GBPS_ENV})",
    )
    p.add_argument("--allreduce-check-port", type=int, help="default: --master-port + 1")
    a = p.parse_args(flags)

    def pick(flag: Any, name: str, kind: Callable[[str], Any], default: Any = None) -> Any:
        """The flag if given, else (with --from-env) the variable, else the default."""
        if flag is not None:
            return flag
        if a.from_env:
            got = _from_env(env, name, kind, empty_is_unset=True)
            if got is not None:
                return got
        return default

    # --- the command: `-- argv`, --command, or $SKYRESUME_COMMAND -----------------
    if command and a.command is not None:
        raise UsageError("give the command either after -- or as --command, not both")
    if a.command is not None:
        command = split_command(a.command, source="--command")
    elif not command and a.from_env and (env.get(NodeEnv.COMMAND) or "").strip():
        command = split_command(env[NodeEnv.COMMAND], source=f"${NodeEnv.COMMAND}")
    if not command:
        raise UsageError(
            "no command: put the rank command after --, e.g. -- python train.py "
            f"(or --command STRING, or ${NodeEnv.COMMAND} with --from-env)"
        )

    # --- who and where this node is ----------------------------------------------
    job_id = pick(a.job_id, Env.JOB_ID, _text)
    attempt = pick(a.attempt, Env.ATTEMPT, _integer)
    node_rank = pick(a.node_rank, NodeEnv.NODE_RANK, _integer, 0)
    nnodes = pick(a.nnodes, NodeEnv.NUM_NODES, _integer, 1)
    if a.from_env:
        # A launch that holds part of the group (replacements beside kept nodes): the
        # service gives its first rank, the group's size and the rendezvous address.
        if a.node_rank is None:
            node_rank += _from_env(env, Env.NODE_RANK_BASE, _integer, empty_is_unset=True) or 0
        if a.nnodes is None:
            nnodes = _from_env(env, Env.NNODES, _integer, empty_is_unset=True) or nnodes
    gpus = _from_env(env, NodeEnv.GPUS_PER_NODE, _integer, empty_is_unset=True)
    gpus = gpus if a.from_env else None
    expect_gpus = a.expect_gpus
    if expect_gpus is None:
        # The operator's (or image's) explicit expectation wins over the launch's count.
        explicit = (env.get(hc.EXPECT_GPUS_ENV) or "").strip()
        expect_gpus = (
            int(hc.env_float(dict(env), hc.EXPECT_GPUS_ENV, 0))
            if explicit or gpus is None
            else gpus
        )
    nproc = a.nproc_per_node
    if nproc is None:
        # One rank per GPU; CPU nodes (no GPUs) run the job's ranks_per_node.
        nproc = gpus if gpus else pick(None, NodeEnv.RANKS_PER_NODE, _integer, 1)
    master_addr = a.master_addr
    if master_addr is None and a.from_env:
        master_addr = _from_env(env, Env.MASTER_ADDR, _text, empty_is_unset=True)
    if master_addr is None and a.from_env:
        ips = [ip.strip() for ip in (env.get(NodeEnv.NODE_IPS) or "").splitlines() if ip.strip()]
        master_addr = ips[0] if ips else None
    master_addr = master_addr or "127.0.0.1"
    missing = [
        f"--job-id (or ${Env.JOB_ID})" if job_id is None else "",
        f"--attempt (or ${Env.ATTEMPT})" if attempt is None else "",
    ]
    if [m for m in missing if m]:
        how = "" if a.from_env else " (or --from-env)"
        raise UsageError(f"missing {', '.join(m for m in missing if m)}{how}")
    node_id = a.node_id
    if node_id is None:
        if not a.from_env:
            raise UsageError("missing --node-id (with --from-env: <job>-a<attempt>-n<rank>)")
        node_id = f"{job_id}-a{attempt}-n{node_rank}"
    local_dir = a.local_dir
    if local_dir is None:
        if not a.from_env:
            raise UsageError("missing --local-dir (the node's local disk directory)")
        named = (env.get(NodeEnv.NODE_DIR) or "").strip()
        local_dir = named or str(Path.home() / "skyresume" / "node")
    log_dir = a.log_dir
    if log_dir is None and a.local_dir is None and a.from_env:
        named = (env.get(NodeEnv.NODE_DIR) or "").strip()
        log_dir = named + "/logs" if named else str(Path.home() / "skyresume" / "logs")
    master_port = pick(a.master_port, NodeEnv.MASTER_PORT, _integer, 29500)
    provider = pick(a.provider, NodeEnv.PROVIDER, _text, "none")
    if provider not in (*md.PROVIDERS, "auto", "none"):
        raise UsageError(
            f"${NodeEnv.PROVIDER} must be one of {', '.join(md.PROVIDERS)}, auto, none; "
            f"got {provider!r}"
        )
    metadata_url = pick(a.metadata_url, NodeEnv.METADATA_URL, _text)
    service_url = pick(a.service_url, Env.SERVICE_URL, _text)
    grace_s = pick(a.grace_s, NodeEnv.GRACE_S, _number, 90.0)
    heartbeat_s = pick(a.heartbeat_s, NodeEnv.HEARTBEAT_S, _number, 1.0)
    poll_s = pick(a.poll_s, NodeEnv.POLL_S, _number, 1.0)
    task_id = (env.get(NodeEnv.TASK_ID) or None) if a.from_env else None
    standby = a.from_env and (env.get(Env.STANDBY) or "").strip() == "1"

    if attempt < 0:
        raise UsageError(f"--attempt must be >= 0, got {attempt}")
    if nnodes < 1:
        raise UsageError(f"--nnodes must be >= 1, got {nnodes}")
    if nproc < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {nproc}")
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank must be in 0..{nnodes - 1}, got {node_rank}")
    if not 1 <= master_port <= 65535:
        raise UsageError(f"--master-port must be in 1..65535, got {master_port}")
    if expect_gpus < 0:
        raise UsageError(f"--expect-gpus must be >= 0, got {expect_gpus}")
    if not (a.min_free_disk_gb >= 0 and math.isfinite(a.min_free_disk_gb)):
        raise UsageError(f"--min-free-disk-gb must be >= 0, got {a.min_free_disk_gb!r}")
    if not (a.min_allreduce_gbps >= 0 and math.isfinite(a.min_allreduce_gbps)):
        raise UsageError(f"--min-allreduce-gbps must be >= 0, got {a.min_allreduce_gbps!r}")
    check_port = a.allreduce_check_port or master_port + 1
    if not 1 <= check_port <= 65535:
        raise UsageError(f"--allreduce-check-port must be in 1..65535, got {check_port}")
    for flag_name, value in (
        ("--grace-s", grace_s),
        ("--heartbeat-s", heartbeat_s),
        ("--poll-s", poll_s),
        ("--final-flush-s", a.final_flush_s),
        ("--max-clock-skew-s", a.max_clock_skew_s),
        ("--store-timeout-s", a.store_timeout_s),
    ):
        _positive(flag_name, value)
    if service_url is not None and not service_url.startswith(("http://", "https://")):
        raise UsageError(f"--service-url must start with http:// or https://, got {service_url!r}")
    ca_pem = _ca_pem(a.ca_bundle, env if a.from_env else {})
    if metadata_url is not None and not metadata_url.startswith(("http://", "https://")):
        raise UsageError(
            f"--metadata-url must start with http:// or https://, got {metadata_url!r}"
        )
    local = Path(local_dir).expanduser().resolve()
    return AgentConfig(
        job_id=job_id,
        attempt=attempt,
        node_id=node_id,
        node_rank=node_rank,
        nnodes=nnodes,
        nproc_per_node=nproc,
        command=tuple(command),
        service_url=service_url,
        master_addr=master_addr,
        master_port=master_port,
        provider=provider,
        metadata_url=metadata_url,
        local_dir=local,
        log_dir=Path(log_dir).expanduser().resolve() if log_dir else local / "logs",
        grace_s=grace_s,
        heartbeat_s=heartbeat_s,
        poll_s=poll_s,
        launcher=a.launcher,
        final_flush_s=a.final_flush_s,
        notice_action=a.notice_action,
        health_checks=a.health_checks == "on",
        expect_gpus=expect_gpus,
        min_free_disk_gb=a.min_free_disk_gb,
        max_clock_skew_s=a.max_clock_skew_s,
        store_timeout_s=a.store_timeout_s,
        # A standby node has no peers to all-reduce with until the group grows onto it
        # (the grow restarts it in place, and the check runs then).
        min_allreduce_gbps=0.0 if standby else a.min_allreduce_gbps,
        allreduce_check_port=check_port,
        standby=standby,
        ca_pem=ca_pem,
        sky_task_id=task_id,
        print_config=a.print_config,
    )


def _ca_pem(path: str | None, env: Mapping[str, str]) -> str | None:
    """The PEM text of ``--ca-bundle`` or ``$SKYRESUME_RUN_CA_PEM``, checked to hold
    at least one certificate ssl can load (a bad bundle is a usage error at start,
    not a TLS failure on every heartbeat)."""
    if path is not None:
        try:
            pem = Path(path).expanduser().read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--ca-bundle {path}: {getattr(e, 'strerror', None) or e}") from None
        what = f"--ca-bundle {path}"
    else:
        pem = (env.get(Env.CA_PEM) or "").strip()
        what = f"${Env.CA_PEM}"
        if not pem:
            return None
    try:
        ssl.create_default_context(cadata=pem)
    except (ssl.SSLError, ValueError) as e:
        raise UsageError(f"{what} holds no usable PEM certificate: {e}") from None
    return pem


def node_outcome(ranks: list[rk.Rank], stop_reason: str | None) -> tuple[int, str]:
    """The agent's exit code and reason from how its ranks ended.

    0: every rank exited 0. 75: every rank exited 0 or 75 and at least one 75 (they
    saved after a stop, asked here or agreed with a peer node). 1: anything else.
    """
    if not ranks:
        return EXIT_FAILED, f"no rank ever started ({stop_reason or 'launcher exited'})"
    saved = any(r.exit_code == EXIT_SAVED and not r.signal for r in ranks)

    def torn_down(r: rk.Rank) -> bool:
        # torchrun (max-restarts 0) SIGTERMs the remaining workers as soon as one exits
        # 75; one caught in interpreter teardown then dies of that SIGTERM. The save
        # they all took part in is collective and was committed before any rank exited.
        return saved and stop_reason is not None and str(r.signal) in ("SIGTERM", "15")

    bad = [
        r
        for r in ranks
        if (r.signal and not torn_down(r)) or (not r.signal and r.exit_code not in (0, EXIT_SAVED))
    ]
    if not bad:
        if all(r.exit_code == 0 for r in ranks):
            return EXIT_OK, "all ranks exited 0"
        return EXIT_SAVED, f"ranks saved and stopped ({stop_reason or 'a peer asked'})"
    r = min(bad, key=lambda x: x.rank)
    how = f"signal {r.signal}" if r.signal else f"exit code {r.exit_code}"
    if r.exit_code is None and not r.signal:
        how = "unknown status"
    tail = f"; stop: {stop_reason}" if stop_reason else ""
    return EXIT_FAILED, f"rank {r.rank} ended with {how}{tail}"


def write_control_file(path: Path, updates: dict[str, Any]) -> None:
    """Merge ``updates`` into the JSON control file atomically (temp + rename), so a
    rank re-reading it never sees half a file."""
    doc: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        old = json.loads(path.read_text())
        if isinstance(old, dict):
            doc = old
    doc.update(updates)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


#: Statuses that say "not now" rather than "never": retried like a 5xx.
RETRY_STATUSES = frozenset({408, 425, 429})
#: Refused reports the outbox remembers (the newest; older ones are in the log).
MAX_REFUSED = 64


def _refusal_reason(body: Any) -> str:
    """The service's reason, in one short line (a 422's list of errors included)."""
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list):
        parts = []
        for e in detail[:3]:
            if isinstance(e, dict):
                loc = ".".join(str(p) for p in e.get("loc") or [] if p != "body")
                parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
            else:
                parts.append(str(e))
        detail = "; ".join(parts)
    return str(detail)[:500]


@dataclass(frozen=True)
class RefusedReport:
    """A report the service answered with a 4xx: dropped, never sent again."""

    kind: str
    key: str
    status: int
    why: str


@dataclass
class _Outbox:
    """Reports, sent in order by one thread. Each is retried while the service cannot
    take it (unreachable, 5xx, 408/425/429); one it refuses (any other 4xx: the same
    body would be refused again) is logged with the reason, kept in ``refused`` and
    dropped, so it never blocks the reports behind it."""

    q: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)
    pending: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    drained: threading.Condition = field(init=False)
    refused: list[RefusedReport] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drained = threading.Condition(self.lock)

    def put(self, doc: dict[str, Any]) -> None:
        with self.lock:
            self.pending += 1
        self.q.put(doc)

    def done_one(self) -> None:
        with self.lock:
            self.pending -= 1
            self.drained.notify_all()

    def record_refusal(self, doc: dict[str, Any], status: int, body: Any) -> RefusedReport:
        why = _refusal_reason(body)
        r = RefusedReport(str(doc.get("kind")), str(doc.get("key")), status, why)
        with self.lock:
            self.refused = [*self.refused[-(MAX_REFUSED - 1) :], r]
        log.error(
            "report %s (key %s) refused by the service: HTTP %s: %s; dropped, not retried",
            r.kind,
            r.key,
            status,
            why,
        )
        return r

    def wait_drained(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self.lock:
            while self.pending > 0:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.drained.wait(left)
        return True


class Agent:
    def __init__(self, cfg: AgentConfig, *, token: str | None, environ: dict[str, str]) -> None:
        self.cfg = cfg
        self.environ = environ
        self.token = token
        self.client = (
            ServiceClient(
                cfg.service_url,
                token or "",
                job_id=cfg.job_id,
                attempt=cfg.attempt,
                node_id=cfg.node_id,
                ca_pem=cfg.ca_pem,
            )
            if cfg.service_url
            else None
        )
        self.ring: logtail.RingHandler | None = None  # main() installs it
        self.logs = (
            logtail.LogUploader(
                # A short timeout: the exit upload must not hold up a node's exit.
                lambda body: self.client.request("PUT", "/logs", body, timeout=3.0),  # type: ignore[union-attr]
                lambda: logtail.collect(self.ring, self.ranks, self.cfg.log_dir / "torchrun.log"),
                every_s=float(environ.get(logtail.EVERY_ENV) or logtail.EVERY_S),
            )
            if self.client is not None
            else None
        )
        self.board = ProgressBoard(on_event=self._on_datagram)
        self.listener = ProgressListener(self.board)
        self.ranks: list[rk.Rank] = []
        self.torchrun: Any = None  # subprocess.Popen
        self.state = "starting"
        self._lock = threading.RLock()
        self._stop_deadline: float | None = None
        self._stop_reason: str | None = None
        self._killed = False
        self._sigtermed: set[int] = set()
        self._torchrun_sigtermed = False
        self._exit = threading.Event()
        self._registered = threading.Event()
        self._beat_soon = threading.Event()
        """Set: heartbeat at once (``beat_soon``)."""
        self._signal_received: int | None = None
        self.cursor = 0
        self.acked: int | None = None
        self.period_s = cfg.heartbeat_s
        """The heartbeat period: ours, or the longer one the service named (a big fleet)."""
        self.outbox = _Outbox()
        self.superseded: str | None = None
        self._held_logged = False
        self.instance = secrets.token_hex(16)
        """This agent process's random id, sent with every register."""
        self.notice_at: float | None = None
        self.service_date: hc.ServiceDate | None = None
        self._fr_seen: set[str] = set()
        self.staged: st.StageOutcome | None = None
        #: What was found of ``checkpoint.own`` before the ranks started (heartbeats).
        self.own_seen: dict[str, Any] | None = None

    # --- stopping: the one place that signals ranks --------------------------------

    @property
    def stopping(self) -> bool:
        return self._stop_deadline is not None

    def begin_stop(self, reason: str, grace_s: float) -> None:
        """SIGTERM every local rank at once and set the SIGKILL deadline. Calling it
        again only ever brings the deadline closer."""
        with self._lock:
            deadline = time.monotonic() + max(0.0, grace_s)
            first = self._stop_deadline is None
            if not first and deadline >= self._stop_deadline:  # type: ignore[operator]
                return
            self._stop_deadline = deadline
            if first:
                self._stop_reason = reason
                self.state = "stopping"
                self._sigterm_ranks()
        log.warning("stopping (%s): SIGKILL in %.1f s", reason, grace_s)

    def _sigterm_ranks(self) -> None:
        live = [r for r in self.ranks if not r.exited and r.pid not in self._sigtermed]
        for r in live:  # no I/O between the signals: fan-out is one loop of kill(2)
            rk.signal_rank(r, signal.SIGTERM)
        self._sigtermed.update(r.pid for r in live)
        if (
            len(self.ranks) < self.cfg.nproc_per_node
            and self.torchrun is not None
            and not self._torchrun_sigtermed
        ):
            self._torchrun_sigtermed = True
            # Ranks not found yet (torchrun still starting them): torchrun forwards the
            # signal to whatever it started and honours TORCH_ELASTIC_SHUTDOWN_TIMEOUT.
            with contextlib.suppress(ProcessLookupError):
                self.torchrun.send_signal(signal.SIGTERM)

    def _kill_everything(self) -> None:
        for r in self.ranks:
            if not r.exited:
                r.killed_by_agent = True
                rk.signal_rank(r, signal.SIGKILL)
        if self.torchrun is not None and self.torchrun.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.torchrun.kill()

    def on_superseded(self, detail: str) -> None:
        if self.superseded is None:
            self.superseded = detail or "attempt superseded"
            log.warning("the service moved on (409: %s); stopping", detail)
        self.begin_stop(f"superseded: {self.superseded}", STOP_GRACE_S)

    # --- reports ---------------------------------------------------------------------

    def report(self, kind: ReportKind, key: str, **fields: Any) -> None:
        if self.client is None:
            log.info(
                "report %s %s", kind, fields if kind != ReportKind.RANK_EXIT else fields.get("rank")
            )
            return
        self.outbox.put({"key": key[:64], "kind": kind, **fields})

    def _report_loop(self) -> None:
        assert self.client is not None
        delays = self._retry_delays()
        while True:
            doc = self.outbox.q.get()
            if doc is None:
                return
            try:
                while True:
                    try:
                        ans = self.client.report(doc)
                    except Unreachable as e:
                        log.info("report %s: service unreachable (%s); retrying", doc["kind"], e)
                        time.sleep(next(delays))
                        continue
                    except Superseded as e:
                        self.on_superseded(str(e))
                        break
                    delays = self._retry_delays()
                    if ans.status in RETRY_STATUSES:
                        log.info("report %s: HTTP %s; retrying", doc["kind"], ans.status)
                        time.sleep(next(delays))
                        continue
                    if ans.status >= 300:
                        # Refused (422, 404, 413): the same body would be refused again,
                        # and retrying it would block every report behind it.
                        self.outbox.record_refusal(doc, ans.status, ans.body)
                    break
            finally:
                self.outbox.done_one()

    def _on_datagram(self, doc: dict[str, Any]) -> None:
        kind = doc.get("type")
        if kind in ("regroup", "resumed", "progress"):
            # What the service waits on in an elastic shrink (every survivor left the
            # old group; every rank resumed in the new one), and a resumed rank's first
            # step (the board passes on no other progress): heard now, not up to a
            # heartbeat period later.
            self.beat_soon()
            return
        if kind == "checkpoint" and doc.get("rank") == 0 and isinstance(doc.get("step"), int):
            self.report(
                ReportKind.CHECKPOINT,
                f"checkpoint:{doc['step']}",
                step=doc["step"],
                path=_str_or_none(doc.get("path")),
                uploaded_uri=_str_or_none(doc.get("uploaded_uri")),
                blocking_s=finite(doc.get("blocking_s")),
                world_size=doc.get("world_size")
                if isinstance(doc.get("world_size"), int)
                else self.cfg.world_size,
            )
        elif kind == "anomaly":
            finding = ANOMALY_FINDINGS.get(str(doc.get("kind")))
            if finding is None:
                log.warning("rank %s: anomaly of unknown kind %r", doc.get("rank"), doc.get("kind"))
                return
            step = doc.get("step") if isinstance(doc.get("step"), int) else None
            detail = {k: v for k, v in doc.items() if k not in ("type", "rank")}
            self.report(
                ReportKind.ANOMALY,
                f"anomaly:{doc['rank']}:{doc.get('kind')}:{step}",
                rank=doc["rank"],
                finding=finding.value,
                step=step,
                detail=json_safe(detail),
            )

    # --- heartbeat / registration -----------------------------------------------------

    def _rank_rows(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        rows = []
        for r in list(self.ranks):
            p = self.board.snapshot(r.rank)
            ticks = None if r.exited else rk.cpu_ticks(r.pid)
            if ticks is not None and ticks != r.cpu_ticks:
                r.cpu_ticks, r.cpu_moved_at = ticks, now
            idle = None if r.exited or r.cpu_moved_at is None else round(now - r.cpu_moved_at, 3)
            rows.append(
                {
                    "rank": r.rank,
                    "local_rank": r.local_rank,
                    "pid": r.pid,
                    "alive": not r.exited,
                    "step": p.step,
                    "step_time": p.step_time,
                    "loss": p.loss,
                    "grad_norm": p.grad_norm,
                    "max_steps": p.max_steps,
                    "report_age_s": round(now - p.last_seen, 3) if p.last_seen else None,
                    "resumed": p.resumed,
                    "regrouping": p.regrouping,
                    "exit_code": r.exit_code if r.exited else None,
                    "signal": r.signal if r.exited else None,
                    "cpu_idle_s": idle,
                }
            )
        return rows

    #: The service's reason for refusing this agent (set by ``_register``; None: it did not).
    refused: str | None = None

    def _register(self) -> bool:
        """Register (again). :class:`AgentRefused` (this agent is the wrong version or
        protocol for the service) is remembered in ``self.refused`` and raised on: as a
        ``Superseded`` it stops the ranks wherever it is caught, and ``main`` exits
        ``EXIT_AGENT_MISMATCH`` with the service's message."""
        assert self.client is not None
        body = {
            "node_rank": self.cfg.node_rank,
            "hostname": socket.gethostname(),
            "agent_pid": os.getpid(),
            "provider": self.cfg.provider,
            "ranks": [
                {"rank": r.rank, "local_rank": r.local_rank, "pid": r.pid} for r in self.ranks
            ],
            "agent_version": __version__,
            "agent_build": installed_build_id(),
            "protocol": AGENT_PROTOCOL,
            # This process's own id: a register retried after a lost answer is this
            # agent again, not a replay of its spent enrolment token.
            "instance": self.instance,
        }
        sent = time.time()
        try:
            ans = self.client.register(body)
        except AgentRefused as e:
            self.refused = str(e)
            log.error("the service refused this agent: %s", e)
            raise
        self.service_date = hc.ServiceDate(ans.date, sent, time.time())
        if ans.status == 404:
            self.on_superseded(f"the service does not know job {self.cfg.job_id}")
            return False
        if ans.status != 200 or not isinstance(ans.body, dict):
            log.error("register refused: HTTP %s %s", ans.status, ans.body)
            return False
        issued = ans.body.get("agent_token")
        if isinstance(issued, str) and issued:
            # The enrolment token the task carried is spent: everything after this
            # (a register again included) carries the attempt's token, held only here.
            self.client.use_token(issued)
            log.info("enrolled: the service issued this attempt's agent token")
        self.cursor = max(self.cursor, int(ans.body.get("command_cursor") or 0))
        told = ans.body.get("heartbeat_s")  # a big fleet's period, from the first beat on
        self.period_s = told_interval({"interval_s": told}, self.cfg.heartbeat_s, jitter=0.0)
        self._registered.set()
        log.info("registered (command cursor %d)", self.cursor)
        return True

    def _heartbeat_body(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "ranks": self._rank_rows(),
            "last_checkpoint": self.board.last_checkpoint(),
            "acked_command": self.acked,
            **({"own_checkpoint": self.own_seen} if self.own_seen else {}),
        }

    def _retry_delays(self) -> Iterator[float]:
        # Capped low: one request per node per ~2 s is nothing for the service, and a
        # restarted service must see every node again within a couple of heartbeats.
        return backoff_delays(base=0.2, cap=max(2.0, 2 * self.period_s))

    def _heartbeat_loop(self) -> None:
        assert self.client is not None
        delays = self._retry_delays()
        unreachable_since: float | None = None
        while not self._exit.is_set():
            wait = told_interval({"interval_s": self.period_s}, self.cfg.heartbeat_s)
            cuttable = True
            asked = self.cfg.attempt
            self._beat_soon.clear()  # this beat carries whatever asked for one so far
            try:
                if not self._registered.is_set():
                    self._register()
                else:
                    ans: Answer = self.client.heartbeat(self._heartbeat_body())
                    if ans.status == 404:
                        self._registered.clear()
                        continue
                    if ans.status >= 300:
                        log.error("heartbeat refused: HTTP %s %s", ans.status, ans.body)
                    else:  # a fleet too big for our own period: the service's, jittered
                        held = isinstance(ans.body, dict) and ans.body.get("held") is True
                        if held and asked == self.cfg.attempt:
                            self._note_held()
                        wait = told_interval(ans.body, self.cfg.heartbeat_s)
                        told = ans.body.get("interval_s") if isinstance(ans.body, dict) else None
                        self.period_s = told_interval(
                            {"interval_s": told}, self.cfg.heartbeat_s, jitter=0.0
                        )
                if unreachable_since is not None:
                    log.warning(
                        "service reachable again after %.1f s", time.monotonic() - unreachable_since
                    )
                    unreachable_since = None
                delays = self._retry_delays()
            except Superseded as e:
                if self.cfg.attempt != asked:
                    continue  # carried meanwhile: the attempt it spoke for is left behind
                self.on_superseded(str(e))
                return
            except Busy as e:  # back-pressure: the service is up, and asked for fewer
                wait, cuttable = busy_wait(e.retry_after_s), False
                log.info("service busy (%s); next heartbeat in %.1f s", e, wait)
            except Unreachable as e:
                if unreachable_since is None:
                    unreachable_since = time.monotonic()
                    log.warning("service unreachable (%s); training goes on, retrying", e)
                wait, cuttable = next(delays), False
            if cuttable:
                self._pause(wait)
            else:  # what the service asked for (busy) or a retry's backoff: waited out
                self._exit.wait(wait)

    def beat_soon(self) -> None:
        """Heartbeat (or register) now rather than at the end of the period: a rank
        regrouped or resumed, or the agent was carried into a new attempt."""
        self._beat_soon.set()

    def _pause(self, wait: float) -> None:
        """The heartbeat period, cut short by ``beat_soon`` (then ``EARLY_BEAT_GAP_S``
        more, so every rank's datagram of one regroup goes in one beat) or by exit."""
        if self._beat_soon.wait(wait) and not self._exit.is_set():
            self._exit.wait(EARLY_BEAT_GAP_S)

    # --- commands --------------------------------------------------------------------

    def _command_loop(self) -> None:
        assert self.client is not None
        delays = self._retry_delays()
        while not self._exit.is_set():
            if not self._registered.wait(0.5):
                continue
            asked = self.cfg.attempt
            try:
                ans = self.client.commands(self.cursor, COMMAND_WAIT_S)
            except Superseded as e:
                if self.cfg.attempt != asked:
                    continue  # carried meanwhile: the attempt it asked for is left behind
                self.on_superseded(str(e))
                return
            except Unreachable:
                self._exit.wait(next(delays))
                continue
            delays = self._retry_delays()
            if ans.status == 404:
                self._registered.clear()
                continue
            if ans.status != 200 or not isinstance(ans.body, dict):
                log.error("commands refused: HTTP %s %s", ans.status, ans.body)
                self._exit.wait(next(delays))
                continue
            for cmd in ans.body.get("commands") or []:
                self.handle_command(cmd)
                self.cursor = max(self.cursor, int(cmd["seq"]))
                self.acked = self.cursor

    def handle_command(self, cmd: dict[str, Any]) -> None:
        kind, args = cmd.get("type"), cmd.get("args") or {}
        log.info("command %s %s %s", cmd.get("seq"), kind, args)
        if self.cfg.standby and kind in (CommandType.CHECKPOINT_AND_STOP, CommandType.STOP):
            log.info("standby: no ranks to stop; staying up for the group to grow onto")
            return
        if kind == CommandType.CHECKPOINT_AND_STOP:
            grace = args.get("grace_s")
            grace = (
                float(grace) if isinstance(grace, (int, float)) and grace > 0 else self.cfg.grace_s
            )
            what = f"checkpoint_and_stop: {args.get('reason') or 'service'}"
            if args.get("capture_stacks") is True:
                self._capture_then_stop(what, f"evidence:{cmd.get('seq')}")
            self.begin_stop(what, grace)
        elif kind == CommandType.STOP:
            what = f"stop: {args.get('reason') or 'service'}"
            if args.get("capture_stacks") is True:
                self._capture_then_stop(what, f"evidence:{cmd.get('seq')}")
            # save: false (an anomaly): the state in memory is the diverged one; an
            # emergency save of it would only push the good checkpoints out of
            # retention, so the ranks get no grace to write one.
            self.begin_stop(what, 0.0 if args.get("save") is False else STOP_GRACE_S)
        elif kind == CommandType.SET_CHECKPOINT_EVERY:
            n = args.get("every_steps")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                log.error("set_checkpoint_every: every_steps must be an integer >= 1, got %r", n)
                return
            write_control_file(self.cfg.control_file, {"checkpoint_every": n})
        elif kind == CommandType.REGROUP:
            # Off the command thread: staging the checkpoint may take a while, and the
            # thread must go on polling (the new attempt's commands, once moved).
            threading.Thread(target=self.carry, args=(args,), daemon=True).start()
        elif kind == CommandType.UPLOAD_LOGS:
            if self.logs is not None:  # off the command thread: files may be slow
                threading.Thread(target=self.logs.upload, args=("request",), daemon=True).start()
        elif kind == CommandType.INJECT_FAULT:
            # Chaos: the node's ranks fail the way the kind says at their next control
            # poll; the command's seq is the token, so each command acts once.
            fault = args.get("kind")
            if fault not in set(FaultKind):
                log.error("inject_fault: unknown fault kind %r (skipped)", fault)
                return
            rank = args.get("rank")
            write_control_file(
                self.cfg.control_file,
                {
                    "inject_fault": {
                        "kind": str(fault),
                        "token": str(cmd.get("seq")),
                        "rank": rank if isinstance(rank, int) else None,
                    }
                },
            )
        else:
            log.error("unknown command type %r (skipped)", kind)

    # --- warm regroup (elastic) ------------------------------------------------------

    def _note_held(self) -> None:
        if not self._held_logged:
            self._held_logged = True
            log.info(
                "held warm: attempt %d ended; the ranks wait for a membership", self.cfg.attempt
            )

    def carry(self, args: dict[str, Any]) -> bool:
        """A ``regroup`` command: move this agent into the attempt it names, stage the
        checkpoint it names, and write the node's membership into the control file,
        where the waiting ranks re-form the group (``training.Run.groups``). False (and
        nothing moved) when the command is malformed or the ranks cannot take it: the
        service then sees the node never register in the new attempt."""
        attempt, token = args.get("attempt"), args.get("agent_token")
        try:
            m = Membership.from_doc(args.get("membership"))
        except ValueError as e:
            log.error("regroup refused: %s", e)
            return False
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt <= self.cfg.attempt:
            log.error("regroup refused: attempt %r is not after %d", attempt, self.cfg.attempt)
            return False
        if not isinstance(token, str) or not token or self.client is None:
            log.error("regroup refused: no agent token for attempt %s", attempt)
            return False
        waiting = [r for r in self.ranks if not r.exited]
        if self.stopping or len(waiting) != self.cfg.nproc_per_node:
            log.error(
                "regroup refused: %d of %d ranks alive%s",
                len(waiting), self.cfg.nproc_per_node, " (stopping)" if self.stopping else "",
            )  # fmt: skip
            return False
        t0 = time.monotonic()
        with self._lock:
            self.cfg = replace(
                self.cfg,
                attempt=attempt,
                node_rank=m.node_rank,
                nnodes=m.nnodes,
                master_addr=m.master_addr,
            )
            for r in self.ranks:  # their global ranks in the new group
                r.rank = m.global_rank(r.local_rank)
            self.board.reset()
            self._held_logged = False
            self.client.move_to(attempt, token)
            self._registered.clear()  # the heartbeat thread registers in the new attempt
            self.beat_soon()  # ... now, not at the end of its period
        log.info(
            "carried into attempt %d as node rank %d of %d (%s)",
            attempt, m.node_rank, m.nnodes, m.init_method,
        )  # fmt: skip
        stage_from = args.get("stage_from")
        if isinstance(stage_from, str) and stage_from:
            where = {Env.RESUME_FROM: str(args.get("resume_from") or "")}
            if m.resume_step is not None:
                where[Env.EXPECTED_STEP] = str(m.resume_step)
            # The download runs while the heartbeat thread registers (each ~0.1 s here);
            # only the reports, which the new attempt refuses from an unregistered node,
            # wait for the registration.
            if not self.stage_checkpoint(stage_from, where, reports_after=self._registered):
                self.begin_stop("regroup: the checkpoint could not be staged", 0.0)
                return False
            assert self.staged is not None
            m = replace(m, resume_from=self.staged.path, resume_step=self.staged.step)
        write_control_file(self.cfg.control_file, {MEMBERSHIP_KEY: m.to_doc()})
        log.info(
            "membership %d written (%.2f s after the command): resume %s at step %s",
            m.generation, time.monotonic() - t0, m.resume_from, m.resume_step,
        )  # fmt: skip
        return True

    # --- metadata ----------------------------------------------------------------------

    def _metadata_loop(self) -> None:

        provider = self.cfg.provider
        if provider == "auto":
            found = md.detect_provider(self.cfg.metadata_url)
            if found is None:
                log.error("--provider auto: no metadata endpoint answered; notices are off")
                return
            provider = found.value
        poller = md.poller_for(provider, self.cfg.metadata_url)
        log.info("polling %s metadata every %.2f s", provider, self.cfg.poll_s)
        blind_since: float | None = None
        first = True
        while not self._exit.is_set():
            # GCP can long-poll: a change arrives at once instead of a poll later. The
            # first read is a plain poll so a notice already present is not missed.
            if isinstance(poller, md.GcpPoller) and not first:
                result = poller.wait(30.0)
            else:
                result = poller.poll()
            first = False
            if result.state == "notice" and result.notice is not None:
                if not result.notice.ends_vm:  # a warning (md.Notice.ends_vm): logged only
                    log.info(
                        "advisory notice %s %s (not acted on)",
                        result.notice.kind.value,
                        str(result.notice.raw)[:80],
                    )
                else:
                    self.on_notice(result.notice)
                    return
            elif result.state == "unknown":
                if blind_since is None:
                    blind_since = time.monotonic()
                    log.warning("metadata unreadable: %s", result.error)
            else:
                blind_since = None
            if isinstance(poller, md.GcpPoller) and result.state != "unknown":
                continue
            self._exit.wait(self.cfg.poll_s)

    def on_notice(self, notice: Any) -> None:
        """Act first (SIGTERM), tell the service second: fan-out never waits on HTTP."""
        self.notice_at = time.time()
        grace = self.cfg.grace_s
        if notice.deadline is not None:
            left = (notice.deadline - datetime.now(timezone.utc)).total_seconds()
            grace = max(1.0, min(grace, left))
        what = f"preemption notice: {notice.provider.value} {notice.kind.value}"
        if self.cfg.notice_action == "sigterm":
            self.begin_stop(what, grace)
        else:
            log.warning("%s: reported only; waiting for the service's command", what)
        deadline = notice.deadline.isoformat() if notice.deadline else None
        self.report(
            ReportKind.PREEMPTION_NOTICE,
            f"notice:{notice.provider.value}:{notice.kind.value}:{deadline}",
            provider=notice.provider.value,
            notice_kind=notice.kind.value,
            deadline=deadline,
            detail=json_safe(notice.raw),
        )

    # --- health checks and evidence (health.py, evidence.py) ---------------------------

    def health_spec(self) -> hc.HealthSpec:
        env = self.rank_env()
        return hc.HealthSpec(
            expect_gpus=self.cfg.expect_gpus,
            checkpoint_dir=Path(env[Env.LOCAL_CHECKPOINT_DIR]),
            min_free_disk_bytes=int(self.cfg.min_free_disk_gb * 2**30),
            checkpoint_uri=env.get(Env.CHECKPOINT_URI) or None,
            store_timeout_s=self.cfg.store_timeout_s,
            max_clock_skew_s=self.cfg.max_clock_skew_s,
        )

    def check_health(self) -> bool:
        """Run the node's checks before torchrun; report them (pass or fail). False:
        a check failed, a ``node_exit`` is reported and torchrun must not start."""
        if self.client is not None:
            self._registered.wait(self.cfg.service_wait_s)  # the clock check needs a Date
        results = hc.run_checks(
            self.health_spec(), service=self.service_date, have_service=self.client is not None
        )
        if not hc.failed(results):
            # Only a node whose own checks passed joins the all-reduce: a broken one
            # would make its healthy peers wait out the join timeout for nothing.
            c = self.cfg
            results.append(
                hc.check_allreduce(
                    hc.AllreduceSpec(
                        min_gbps=c.min_allreduce_gbps,
                        rank=c.node_rank,
                        world=c.nnodes,
                        addr=c.master_addr,
                        port=c.allreduce_check_port or c.master_port + 1,
                    ),
                    python=sys.executable,
                    env=self.rank_env(),
                )
            )
        bad = hc.failed(results)
        text = hc.summary(results)
        self.report(ReportKind.HEALTH_CHECK, "health_check", checks=[r.to_json() for r in results])
        if not bad:
            log.info("health checks: %s", text)
            return True
        log.error("health check failed, torchrun not started: %s", text)
        self.state = "exited"
        self.report(
            ReportKind.NODE_EXIT,
            "node_exit",
            exit_code=EXIT_HEALTH_CHECK_FAILED,
            reason=f"health check failed: {text}"[:1024],
        )
        return False

    def capture_evidence(self, trigger: str, key: str) -> None:
        """Every live local rank's stack and the node's Flight Recorder dumps, before
        the ranks are signalled (bounded by ``evidence.CAPTURE_BUDGET_S``)."""
        if self.cfg.launcher == "torchrun":
            self._discover()  # a rank torchrun just started must not be missed
        t0 = time.monotonic()
        targets = [
            ev.RankTarget(r.rank, r.local_rank, r.pid, r.log_paths[-1] if r.log_paths else None)
            for r in list(self.ranks)
            if not r.exited
        ]
        gone = [r for r in list(self.ranks) if r.exited]
        stacks = ev.capture_stacks(targets)
        for r in gone:
            how = f"signal {r.signal}" if r.signal else f"exit code {r.exit_code}"
            stacks.append(
                {
                    "rank": r.rank,
                    "local_rank": r.local_rank,
                    "pid": r.pid,
                    "state": None,
                    "error": f"the rank had exited ({how})",
                }
            )
        fr = ev.collect_fr_dumps(self.rank_env().get(ev.FR_PREFIX_ENV), seen=self._fr_seen)
        took = time.monotonic() - t0
        findings = ev.summarize(stacks) + ev.fr_findings(fr)
        log.warning("evidence (%.2f s): %s", took, " | ".join(findings) or "nothing")
        self.report(
            ReportKind.EVIDENCE,
            key,
            trigger=trigger[:256],
            ranks=sorted(stacks, key=lambda x: x["rank"]),
            flight_recorder=json_safe(fr),
            findings=findings,
            took_s=round(took, 3),
        )

    def _capture_then_stop(self, trigger: str, key: str) -> None:
        try:
            self.capture_evidence(trigger, key)
        except Exception:  # evidence is worth a few seconds, never the stop itself
            log.exception("evidence capture failed; stopping the ranks anyway")

    def _report_flight_recorder(self) -> None:
        """Flight Recorder dumps written since the last capture (NCCL writes them on a
        collective timeout, and the rank then dies): reported once, at the end."""
        fr = ev.collect_fr_dumps(self.rank_env().get(ev.FR_PREFIX_ENV), seen=self._fr_seen)
        if fr:
            self.report(
                ReportKind.EVIDENCE,
                "evidence:node_exit",
                trigger="node exit",
                ranks=[],
                flight_recorder=json_safe(fr),
                findings=ev.fr_findings(fr),
                took_s=0.0,
            )

    # --- ranks -------------------------------------------------------------------------

    def rank_env(self) -> dict[str, str]:
        env = dict(self.environ)
        env.pop(TOKEN_ENV, None)
        env[Env.NODE_ID] = self.cfg.node_id
        env[Env.PROGRESS_ADDR] = self.listener.addr
        env[Env.CONTROL_FILE] = str(self.cfg.control_file)
        env.setdefault(Env.LOCAL_CHECKPOINT_DIR, str(self.cfg.local_dir / "checkpoints"))
        # NCCL's Flight Recorder dumps land on the node's disk, where the evidence
        # capture looks for them (NCCL's default is /tmp/nccl_trace_rank_).
        env.setdefault(ev.FR_PREFIX_ENV, str(self.cfg.local_dir / "nccl_trace" / "rank_"))
        Path(env[ev.FR_PREFIX_ENV]).parent.mkdir(parents=True, exist_ok=True)
        env.setdefault(Env.JOB_ID, self.cfg.job_id)
        env.setdefault(Env.ATTEMPT, str(self.cfg.attempt))
        if self.cfg.service_url:
            env.setdefault(Env.SERVICE_URL, self.cfg.service_url)
        # torchrun's own SIGTERM path (if it is signalled) then honours our grace
        # instead of its fixed 30 s.
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(max(1, math.ceil(self.cfg.grace_s)))
        if env.get(Env.FULL_WORLD_SIZE):
            # An elastic run: this agent carries its ranks into a shrunk group (``carry``),
            # so a rank whose peer was lost waits for the membership instead of exiting.
            env.setdefault(Env.REGROUP_TIMEOUT_S, str(REGROUP_WAIT_S))
        return env

    def stage_checkpoint(
        self,
        uri: str | None = None,
        env: dict[str, str] | None = None,
        *,
        reports_after: threading.Event | None = None,
    ) -> bool:
        """Stage ``uri`` (default ``Env.STAGE_FROM``) onto the node's disk before
        torchrun, or before a carried group re-forms (stage.py; ``env``: that attempt's
        ``RESUME_FROM`` and ``EXPECTED_STEP``), and report it; False:
        it failed, a ``node_exit`` is reported and torchrun must not start. True when
        staged, or when nothing was asked for. ``reports_after``: the reports wait for
        it (up to 30 s; a carried agent's registration in its new attempt), the
        download does not."""
        uri = uri or self.environ.get(Env.STAGE_FROM)
        if not uri:
            return True
        env = st.node_disk_values(
            {**self.rank_env(), **(env or {}), Env.STAGE_FROM: uri}, self.cfg.local_dir
        )
        log.info("staging %s", st.safe_uri(env[Env.STAGE_FROM]))
        out = st.stage_for_ranks(env, self.cfg.local_dir)
        assert out is not None
        self.staged = out
        if reports_after is not None and not reports_after.wait(30.0):
            log.warning("not registered in attempt %d yet; reporting the stage anyway",
                        self.cfg.attempt)  # fmt: skip
        self.report(
            ReportKind.STAGED,
            f"staged:{out.step}:{'ok' if out.ok else 'failed'}",
            **out.report_fields(self.cfg.node_id),
        )
        if out.ok:
            log.info(
                "staged in %.2f s, %d bytes downloaded: %s", out.seconds, out.bytes, out.detail
            )
            return True
        log.error("staging failed, torchrun not started: %s", out.detail)
        self.state = "exited"
        self.report(
            ReportKind.NODE_EXIT,
            "node_exit",
            exit_code=EXIT_STAGE_FAILED,
            reason=f"staging failed: {out.detail}"[:1024],
        )
        return False

    def start_ranks(self) -> None:
        c = self.cfg
        # A run-context value may name {node_disk}: this node's local disk.
        env = st.node_disk_values(self.rank_env(), c.local_dir)
        if c.control_file.exists():
            # Ranks started cold belong to the group torchrun forms, not to a membership
            # an earlier agent on this disk wrote for a group that is gone.
            write_control_file(c.control_file, {MEMBERSHIP_KEY: None})
        if self.staged is not None and self.staged.ok:
            # The ranks load what was staged and verified here, and nothing else.
            env.setdefault(Env.RESUME_FROM, self.staged.path)
            env.setdefault(Env.EXPECTED_STEP, str(self.staged.step))
        command = list(c.command)
        own, arg = env.get(Env.OWN_CHECKPOINT), env.get(Env.OWN_RESUME_ARG)
        if own and arg:
            # A plain script's own checkpoint, passed only where this node has it: the
            # service's evidence for what the restart resumed from is this report.
            self.own_seen = {"path": own, "found": os.path.exists(own)}
            if self.own_seen["found"]:
                command += [arg, own]
            log.info("checkpoint.own %s: %s", own, "passed" if command[-1] == own else "absent")
        if c.launcher == "direct":
            self.ranks = rk.start_direct(
                command,
                env,
                nnodes=c.nnodes,
                node_rank=c.node_rank,
                nproc=c.nproc_per_node,
                master_addr=c.master_addr,
                master_port=c.master_port,
                log_dir=c.log_dir,
            )
            self.state = "running"
            return
        argv = rk.torchrun_argv(
            command,
            nnodes=c.nnodes,
            node_rank=c.node_rank,
            nproc=c.nproc_per_node,
            master_addr=c.master_addr,
            master_port=c.master_port,
            log_dir=c.log_dir / "torchrun",
        )
        self.torchrun = rk.start_torchrun(argv, env, c.log_dir / "torchrun.log")
        log.info("torchrun pid %d: %s", self.torchrun.pid, " ".join(argv))

    def _discover(self) -> None:
        if self.torchrun is None or len(self.ranks) >= self.cfg.nproc_per_node:
            return
        known = {r.pid for r in self.ranks}
        new = [r for r in rk.discover_ranks(self.torchrun.pid) if r.pid not in known]
        if not new:
            return
        for r in new:
            r.log_paths = rk.torchrun_log_paths(self.cfg.log_dir / "torchrun", r.local_rank)
        with self._lock:
            self.ranks = sorted([*self.ranks, *new], key=lambda r: r.local_rank)
            if self.stopping:
                self._sigterm_ranks()
        log.info("ranks found: %s", ", ".join(f"{r.rank}:{r.pid}" for r in new))
        if len(self.ranks) >= self.cfg.nproc_per_node:
            if self.state == "starting":
                self.state = "running"
            if self.client is not None and self._registered.is_set():
                self._registered.clear()  # register again so the service has the pids

    def _on_rank_exit(self, r: rk.Rank) -> None:
        how = (
            f"signal {r.signal}"
            if r.signal
            else (f"exit code {r.exit_code}" if r.status_known else "status not yet known")
        )
        log.info("rank %d (pid %d) exited: %s", r.rank, r.pid, how)
        if r.status_known:
            self._report_rank_exit(r)
        if self.stopping:
            return
        if r.status_known and r.exit_code == 0 and not r.signal:
            return  # finished; the others will too
        if not r.status_known:
            # torchrun reaped it: a rank that finished must not get its peers SIGTERMed
            # mid-teardown, and one that failed makes torchrun (max-restarts 0) stop the
            # group itself within a monitor interval. The status comes from torchrun.
            return
        self.begin_stop(f"rank {r.rank} ended ({how})", self.cfg.grace_s)

    def _report_rank_exit(self, r: rk.Rank) -> None:
        if r.reported:
            return
        r.reported = True
        self.report(
            ReportKind.RANK_EXIT,
            f"rank_exit:{r.rank}",
            rank=r.rank,
            local_rank=r.local_rank,
            exit_code=r.exit_code,
            signal=r.signal,
            log_tail=rk.rank_log_tail(r),
            killed_by_agent=r.killed_by_agent,
        )

    def _torchrun_done(self) -> bool:
        return self.torchrun is None or self.torchrun.poll() is not None

    def _all_ranks_gone(self) -> bool:
        if (
            self.cfg.launcher == "torchrun"
            and not self._torchrun_done()
            and len(self.ranks) < self.cfg.nproc_per_node
        ):
            return False
        return all(r.exited for r in self.ranks)

    def supervise(self) -> None:
        """The main loop: discover, watch, enforce the grace deadline."""
        last_discover = 0.0
        while True:
            if self._signal_received is not None:
                sig, self._signal_received = self._signal_received, None
                self.begin_stop(f"agent received {signal.Signals(sig).name}", self.cfg.grace_s)
            now = time.monotonic()
            if now - last_discover >= 0.1:
                last_discover = now
                self._discover()
            for r in list(self.ranks):
                if rk.poll_rank(r):
                    self._on_rank_exit(r)
            orphans = any(not r.exited for r in self.ranks)
            if self.torchrun is not None and self._torchrun_done() and orphans:
                # torchrun died under live ranks: they would train on as orphans.
                self.begin_stop("torchrun exited while ranks ran", STOP_GRACE_S)
            if self.stopping and not self._killed and now >= (self._stop_deadline or now):
                left = [r.rank for r in self.ranks if not r.exited]
                log.warning("grace over: SIGKILL ranks %s", left)
                self._killed = True
                self._kill_everything()
            if self._all_ranks_gone() and (self._torchrun_done() or self.ranks):
                break
            time.sleep(WATCH_S)

    def _settle_torchrun(self) -> None:
        """Wait for torchrun, then fill in exit statuses it reaped before we saw them."""
        if self.torchrun is None:
            return
        try:
            rc = self.torchrun.wait(timeout=10)
        except Exception:
            self.torchrun.kill()
            rc = self.torchrun.wait()
        text = ""
        with contextlib.suppress(OSError):
            text = (self.cfg.log_dir / "torchrun.log").read_text(errors="replace")
        failures = rk.parse_torchrun_failures(text)
        for r in self.ranks:
            if r.status_known:
                continue
            if r.local_rank in failures and failures[r.local_rank][1] == r.pid:
                r.exit_code, r.signal = rk.from_returncode(failures[r.local_rank][0])
                r.status_known = True
            elif failures or rc == 0:
                r.exit_code, r.status_known = 0, True  # torchrun lists every non-zero exit
            else:
                ex = self._exit_datagram(r.rank)
                if ex and isinstance(ex.get("code"), int):
                    r.exit_code, r.status_known = ex["code"], True

    def _exit_datagram(self, rank: int, wait_s: float = 1.0) -> dict[str, Any] | None:
        """The rank's ``exit`` datagram. The listener thread may not have read it yet:
        the rank sent it and exited, torchrun reaped it, and on a loaded node the agent
        got here first (seen in CI: a rank that saved reported exit code None)."""
        deadline = time.monotonic() + wait_s
        while True:
            ex = self.board.snapshot(rank).exit
            if ex or time.monotonic() >= deadline:
                return ex
            time.sleep(0.02)

    # --- run ---------------------------------------------------------------------------

    def _start_threads(self) -> list[threading.Thread]:
        threads = []
        if self.client is not None:
            threads += [
                threading.Thread(target=self._report_loop, name="reports", daemon=True),
                threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True),
                threading.Thread(target=self._command_loop, name="commands", daemon=True),
            ]
        if self.cfg.provider != "none":
            threads.append(
                threading.Thread(target=self._metadata_loop, name="metadata", daemon=True)
            )
        for t in threads:
            t.start()
        return threads

    def run(self) -> int:
        self.cfg.local_dir.mkdir(parents=True, exist_ok=True)
        self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
        self.listener.start()
        self._start_threads()  # metadata polling starts before the ranks: from boot
        if self.logs is not None:
            self.logs.start()  # periodic: what a SIGKILLed node leaves behind
        if self.cfg.health_checks and not self.check_health():
            self._finish()
            return EXIT_HEALTH_CHECK_FAILED
        if self.cfg.standby:
            return self._stand_by()
        if not self.stage_checkpoint():
            self._finish()
            return EXIT_STAGE_FAILED
        try:
            self.start_ranks()
        except OSError as e:
            log.error("could not start ranks: %s", e)
            self.report(
                ReportKind.NODE_EXIT,
                "node_exit",
                exit_code=EXIT_FAILED,
                reason=f"launch failed: {e}",
            )
            self._finish()
            return EXIT_FAILED
        self.supervise()
        self._settle_torchrun()
        for r in self.ranks:
            self._report_rank_exit(r)
        code, reason = node_outcome(self.ranks, self._stop_reason)
        self._report_flight_recorder()
        last = self.board.last_checkpoint()
        self.state = "exited"
        self.report(
            ReportKind.NODE_EXIT,
            "node_exit",
            exit_code=code,
            reason=reason,
            saved_step=last["step"] if last else None,
        )
        log.info("node exit %d: %s", code, reason)
        self._finish()
        return code

    def _stand_by(self) -> int:
        """A spare beside a shrunk group: heartbeat (the threads do) and start nothing,
        until stopped. The grow restarts this node in place as a new attempt (a new
        agent on the same machine, which stages and starts ranks); a teardown stops it."""
        log.info("standby: registered; no ranks until the group grows onto this node")
        while self._signal_received is None and not self._exit.is_set():
            if self.superseded is not None:
                log.info("standby: superseded (%s); exiting", self.superseded)
                break
            time.sleep(0.5)
        self._finish()
        return EXIT_OK

    def _finish(self) -> None:
        if self.client is not None:
            if not self.outbox.wait_drained(self.cfg.final_flush_s):
                log.error(
                    "gave up delivering %d report(s) after %.0f s",
                    self.outbox.pending,
                    self.cfg.final_flush_s,
                )
            if self.logs is not None:
                self.logs.stop()  # the last lines, after the reports (they matter more)
            if self._registered.is_set() and self.superseded is None:
                with contextlib.suppress(Unreachable, Superseded):
                    self.client.heartbeat(self._heartbeat_body())
        self._exit.set()
        self._beat_soon.set()  # a heartbeat pause ends too
        self.outbox.q.put(None)
        self.listener.stop()

    def handle_signal(self, signum: int, _frame: Any) -> None:
        self._signal_received = signum  # no I/O in a handler: the main loop acts


def json_safe(x: Any) -> Any:
    """A JSON value the service can store: NaN/Inf become None (PostgreSQL's JSON
    refuses them), anything unknown becomes its str."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return str(x)


def _str_or_none(x: Any) -> str | None:
    return x if isinstance(x, str) else None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_args(argv)
    except UsageError as e:
        print(f"skyresume-agent: error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    # Run-context values may name {node_disk}; the ranks (and staging) see real paths.
    environ = substitute_node_disk(os.environ, cfg.local_dir)
    if cfg.print_config:
        doc = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
        run_env = {k: v for k, v in sorted(environ.items()) if k.startswith("SKYRESUME_RUN_")}
        print(json.dumps({"config": doc, "run_env": run_env}, indent=2))
        sys.exit(EXIT_OK)
    token = environ.pop(TOKEN_ENV, None) or None
    # Out of this process's environment too: whatever it starts (torchrun, the ranks,
    # py-spy, the all-reduce check) inherits none of it. The ranks talk to the agent
    # over UDP, never to the service, so none of them needs it.
    os.environ.pop(TOKEN_ENV, None)
    if cfg.service_url and not token:
        print(
            f"skyresume-agent: error: {TOKEN_ENV} is not set (the service token)", file=sys.stderr
        )
        sys.exit(EXIT_USAGE)
    logging.basicConfig(
        level=environ.get("SKYRESUME_AGENT_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s skyresume-agent[{cfg.node_id}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    log.info(
        "skyresume %s (build %s, agent protocol %d)%s",
        __version__,
        installed_build_id(),
        AGENT_PROTOCOL,
        f", SkyPilot task {cfg.sky_task_id}" if cfg.sky_task_id else "",
    )
    ring = logtail.install(cfg.node_id)
    agent = Agent(cfg, token=token, environ=environ)
    agent.ring = ring
    if agent.client is not None:
        # Register once before anything starts, so a service that refuses this agent
        # (another version or protocol) stops it here, before any rank runs. A service
        # not up yet, or an attempt already superseded, is the heartbeat thread's to
        # retry or act on, as before.
        try:
            agent._register()
        except AgentRefused:  # kept in agent.refused by _register; acted on below
            assert agent.refused is not None
        except (Unreachable, Superseded) as e:
            log.warning("first register: %s (the heartbeat thread retries)", e)
    if agent.refused is None:
        signal.signal(signal.SIGTERM, agent.handle_signal)
        signal.signal(signal.SIGINT, agent.handle_signal)
        code = agent.run()
    if agent.refused is not None:
        # One line, the service's own words (both versions named), and a code of its
        # own: a launcher or operator can tell "wrong agent" from "training failed".
        print(f"skyresume-agent: error: {agent.refused}", file=sys.stderr)
        sys.exit(EXIT_AGENT_MISMATCH)
    sys.exit(code)


if __name__ == "__main__":
    main()
