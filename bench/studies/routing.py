"""Routing requests over N replicas by adapter, simulated: how even the load stays, and how many adapter loads
a minute each policy causes, under power-law adapter popularity (no GPU; numbers for docs/design.md).

A adapters, adapter k requested with weight 1 / (k + 1)^α; Poisson arrivals of `--rate` requests/s, each busy
on its replica for `--duration` s; every replica holds `--slots` adapters (its host tier, LRU), loading one on
a miss. Policies:
- random: the less loaded of two random replicas (power of two choices), blind to adapters.
- affinity: Ray Serve's multiplexed routing: the least loaded replica that holds the adapter, unless all such
  are `--overload` times busier than the mean (then, as on a miss, the least loaded replica, which loads it).
Per run: the busiest replica's mean in-flight requests over the mean (1.0 is even), and adapter loads/min.

  python bench/studies/routing.py [--replicas 2,4,8] [--adapters 1000] [--alphas 1,0.5] [--out bench/results]
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import os

import numpy as np


def simulate(policy: str, replicas: int, adapters: int, alpha: float, rate: float, duration: float, slots: int,
             overload: float, minutes: float, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, adapters + 1) ** alpha
    n = int(rate * minutes * 60)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    wanted = rng.choice(adapters, n, p=weights / weights.sum())
    held = [collections.OrderedDict() for _ in range(replicas)]  # adapter -> None, least recently used first
    busy = [0] * replicas
    ends: list[tuple[float, int]] = []  # (time, replica) of requests in flight
    loads, area, last = 0, np.zeros(replicas), 0.0
    for t, adapter in zip(arrivals, wanted):
        while ends and ends[0][0] <= t:
            done, r = heapq.heappop(ends)
            area += np.array(busy) * (done - last)
            last = done
            busy[r] -= 1
        area += np.array(busy) * (t - last)
        last = t
        if policy == "random":
            a, b = rng.choice(replicas, 2, replace=False)
            r = a if busy[a] <= busy[b] else b
        else:
            having = [r for r in range(replicas) if adapter in held[r]]
            mean = max(sum(busy) / replicas, 1.0)
            having = [r for r in having if busy[r] < overload * mean]
            r = min(having or range(replicas), key=lambda r: busy[r])
        if adapter in held[r]:
            held[r].move_to_end(adapter)
        else:
            loads += 1
            held[r][adapter] = None
            if len(held[r]) > slots:
                held[r].popitem(last=False)
        busy[r] += 1
        heapq.heappush(ends, (t + duration, r))
    share = area / last
    return dict(policy=policy, replicas=replicas, adapters=adapters, alpha=alpha,
                imbalance=float(share.max() / share.mean()), loads_per_min=loads / minutes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="2,4,8")
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--alphas", default="1,0.5")
    parser.add_argument("--rate", type=float, default=16.0, help="requests per second per replica")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds a request is in flight")
    parser.add_argument("--slots", type=int, default=128, help="adapters a replica holds (its host tier)")
    parser.add_argument("--overload", type=float, default=2.0)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    rows = []
    print("| α | replicas | policy | busiest / mean load | adapter loads / min |\n|---|---|---|---|---|")
    for alpha in map(float, args.alphas.split(",")):
        for n in map(int, args.replicas.split(",")):
            for policy in ("random", "affinity"):
                row = simulate(policy, n, args.adapters, alpha, args.rate * n, args.duration, args.slots,
                               args.overload, args.minutes)
                rows.append(row)
                print(f"| {alpha:g} | {n} | {policy} | {row['imbalance']:.2f} | {row['loads_per_min']:.0f} |",
                      flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "routing.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
