"""Run one of ``training.integrations.examples`` with a pause after every optimizer
step: ``python tests/e2e/paced_example.py SECONDS MODULE ARGS...``.

The integration e2e injects its faults at steps it watches through the service (a
heartbeat a second), and a tiny model on CPU runs a step in tens of milliseconds,
so unpaced the run would end before the first fault lands. The pause is a global
optimizer post-step hook: it changes no arithmetic and no line of the example."""

from __future__ import annotations

import runpy
import sys
import time


def main() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    seconds, module = float(sys.argv[1]), sys.argv[2]
    register_optimizer_step_post_hook(lambda _opt, _args, _kwargs: time.sleep(seconds))
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
