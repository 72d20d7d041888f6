"""Whether the interpreter's switch interval bounds a tenancy run's inter-token latency: the loader threads'
Python work holds the GIL that the engine loop waits for, up to a switch interval (5 ms by default) each time
the loop takes it back.

Runs bench/tenancy.py (its arguments follow) with `sys.setswitchinterval` set before each measured run to the
next of `--intervals` in turn (seconds), so the values alternate within one process, over the same arrivals.
Prints each run's interval before tenancy's row.

  python bench/studies/switch_interval.py [--intervals 0.005,0.0005] [tenancy.py's arguments,
                                          e.g. --alphas 0.5 --adapters 32,32,512,512,512,512]
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    import tenancy

    intervals = [0.005, 0.0005]
    if "--intervals" in sys.argv:
        i = sys.argv.index("--intervals")
        intervals = [float(x) for x in sys.argv[i + 1].split(",")]
        del sys.argv[i : i + 2]
    send, runs = tenancy.send, []

    def switched_send(client, url, rate, requests, rng):
        if np.isfinite(rate):  # a measured run (the warm-up waves go at once)
            interval = intervals[len(runs) % len(intervals)]
            runs.append(interval)
            sys.setswitchinterval(interval)
            print(f"# switch interval {interval * 1e3:g} ms", flush=True)
        return send(client, url, rate, requests, rng)

    tenancy.send = switched_send
    tenancy.main()


if __name__ == "__main__":  # the client process (spawned) imports this module: only the parent runs
    main()
