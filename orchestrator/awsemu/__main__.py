"""``python -m orchestrator.awsemu``: start, fault and stop the emulated AWS.

up --home DIR [--no-hosts] [--sky] [--regions r1,r2]   foreground; ^C or `down` stops
down --home DIR
status --home DIR
fault capacity --home DIR [--region R] [--zone Z] [--instance-type T]
                          [--seconds N] [--calls N]
fault clear-capacity --home DIR
fault preempt INSTANCE_ID --home DIR [--window 120]
fault terminate INSTANCE_ID --home DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from orchestrator.awsemu import emulator
from orchestrator.awsemu.front import admin


def _up(args: argparse.Namespace) -> int:
    regions = tuple(r.strip() for r in args.regions.split(",") if r.strip())
    done = threading.Event()
    # SIGTERM (what `down` sends) ends the foreground run as ^C does: everything it made
    # goes with it.
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    kw: dict[str, Any] = {"with_hosts": not args.no_hosts, "with_sky": args.sky}
    if regions:
        kw["regions"] = regions
    emu = emulator.start(args.home, **kw)
    try:
        assert emu.state is not None
        print(f"awsemu: AWS endpoint {emu.endpoint}", flush=True)
        print(json.dumps(asdict(emu.state)), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            done.wait()
    finally:
        emu.stop()
    return 0


def _fault(args: argparse.Namespace) -> int:
    url = emulator.read_state(args.home).endpoint
    if args.what == "capacity":
        doc = {k: v for k, v in (("region", args.region), ("zone", args.zone),
                                 ("instance_type", args.instance_type),
                                 ("seconds", args.seconds), ("calls", args.calls))
               if v is not None}  # fmt: skip
        out = admin(url, "POST", "capacity", doc)
    elif args.what == "clear-capacity":
        out = admin(url, "DELETE", "capacity")
    elif args.what == "preempt":
        out = admin(url, "POST", "preempt", {"instance_id": args.instance_id,
                                             "window_s": args.window})  # fmt: skip
    elif args.what == "terminate":
        out = admin(url, "POST", "terminate", {"instance_id": args.instance_id})
    else:
        out = admin(url, "GET", "faults")
    print(json.dumps(out, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.awsemu", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the emulator in the foreground")
    up.add_argument("--home", type=Path, required=True)
    up.add_argument("--no-hosts", action="store_true", help="moto and the front only")
    up.add_argument(
        "--sky", action="store_true", help="also prepare SkyPilot's side and start its API server"
    )
    up.add_argument("--regions", default="", help="comma-separated (default: the seeded)")
    for name in ("down", "status"):
        sp = sub.add_parser(name)
        sp.add_argument("--home", type=Path, required=True)
    fault = sub.add_parser("fault", help="inject a fault through the front's admin API")
    fsub = fault.add_subparsers(dest="what", required=True)
    cap = fsub.add_parser("capacity", help="RunInstances fails with InsufficientInstanceCapacity")
    cap.add_argument("--region")
    cap.add_argument("--zone")
    cap.add_argument("--instance-type")
    cap.add_argument("--seconds", type=float, help="for this long (default: until cleared)")
    cap.add_argument("--calls", type=int, help="for this many matching calls")
    fsub.add_parser("clear-capacity")
    fsub.add_parser("show")
    pre = fsub.add_parser("preempt", help="spot notice now, terminated after the window")
    pre.add_argument("instance_id")
    pre.add_argument("--window", type=float, default=120.0, help="seconds (AWS: 120)")
    term = fsub.add_parser("terminate", help="terminate now, without notice")
    term.add_argument("instance_id")
    for sp in fsub.choices.values():
        sp.add_argument("--home", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "up":
            return _up(args)
        if args.cmd == "down":
            emulator.down(args.home)
            return 0
        if args.cmd == "status":
            print(json.dumps(asdict(emulator.read_state(args.home)), indent=2))
            return 0
        return _fault(args)
    except (emulator.EmulatorError, RuntimeError, ValueError) as e:
        print(f"awsemu: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
