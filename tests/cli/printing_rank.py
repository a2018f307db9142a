"""A rank that prints a numbered line every 50 ms until it is killed (stdlib only)."""

import os
import time

rank = int(os.environ["RANK"])
n = 0
while True:
    n += 1
    print(f"rank {rank} line {n}", flush=True)
    time.sleep(0.05)
