"""A tiny stdlib rank for the agent tests: reports progress like the training library,
and on SIGTERM records when it got the signal, "saves" and exits 75.

Behaviour per rank from the environment:
  AGENT_TEST_MARKS=DIR        write DIR/sigterm_<rank> (the time) on SIGTERM
  AGENT_TEST_IGNORE_TERM=0,1  these ranks ignore SIGTERM (only SIGKILL ends them)
  AGENT_TEST_CRASH=R:STEP     rank R raises at STEP
"""

import json
import os
import signal
import socket
import sys
import time

rank = int(os.environ["RANK"])
addr = os.environ.get("SKYRESUME_RUN_PROGRESS_ADDR", "")
host, _, port = addr.rpartition(":")
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
marks = os.environ.get("AGENT_TEST_MARKS")
ignore = os.environ.get("AGENT_TEST_IGNORE_TERM", "").split(",")
crash = os.environ.get("AGENT_TEST_CRASH", "")
stop = []


def send(kind, **fields):
    if port:
        doc = {"type": kind, "rank": rank, "ts": time.time(), **fields}
        sock.sendto(json.dumps(doc).encode(), (host, int(port)))


def on_term(signum, frame):
    stop.append(time.time())
    if marks:
        with open(os.path.join(marks, f"sigterm_{rank}"), "w") as f:
            f.write(repr(stop[0]))


signal.signal(signal.SIGTERM, signal.SIG_IGN if str(rank) in ignore else on_term)
print(f"rank {rank} pid {os.getpid()} up", flush=True)
send("resumed", step=0, manifest_digest=None)
step = 0
while not stop:
    step += 1
    send("progress", step=step, step_time=0.02, loss=1.0 / step, grad_norm=0.5, samples_per_s=1.0)
    if crash == f"{rank}:{step}":
        print("about to fail", flush=True)
        raise ValueError(f"rank {rank} hit a bug at step {step}")
    time.sleep(0.02)
print(f"rank {rank}: stop requested; saved step {step}", file=sys.stderr, flush=True)
if rank == 0:
    send(
        "checkpoint",
        step=step,
        path=f"/local/step_{step}",
        world_size=int(os.environ["WORLD_SIZE"]),
    )
sys.exit(75)
