"""The tenancy targets (issue #36) checked against `bench/tenancy.py` runs: one line per target and row, the
measured value, its bound and whether it is met; exit status 1 when one is not, 2 for a file that is no result.

A file holds one result, or several under "runs". Each result's pooled rows (`--repeat`) are read where it has
them, else its single runs. Against each α's run of
fewest adapters (N = 32: every adapter resident) of the same file, and against the same arrivals with every
adapter resident (`--control-slots`) where the file has them:
  - throughput at N >= 1000 with α = 1: at least 0.9x the fewest N's;
  - ITL p99 of every run with loads: at most 1.2x the run without loads: the all-resident run of the same
    arrivals where there is one (what loads cost, at the same adapter mix), else the fewest N's;
  - TTFT p99 of the requests whose adapter was on disk: at most the loads' p99 (disk -> host + host -> device)
    plus the ITL p99.

  python bench/tenancy_targets.py [bench/results/tenancy.json ...]
"""

from __future__ import annotations

import dataclasses
import sys

from result_files import read_results

THROUGHPUT, ITL = 0.9, 1.2


@dataclasses.dataclass(frozen=True)
class Check:
    """One target row: the measured value against its bound (None: not in the file), at most it or at least it."""

    target: str
    row: str
    value: float | None
    bound: float | None
    unit: str  # "x" (a ratio) or " ms"
    at_least: bool = False

    @property
    def met(self) -> bool:
        if self.value is None or self.bound is None:
            return False
        return self.value >= self.bound if self.at_least else self.value <= self.bound

    def shown(self, x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}x" if self.unit == "x" else f"{x:.0f}{self.unit}"


def checks(result: dict) -> list[Check]:
    """Each target row of one tenancy.py result."""
    rows = result.get("pooled") or result["rows"]
    out, seen = [], {}
    for r in rows:
        seen[r["alpha"], r["adapters"]] = run = seen.get((r["alpha"], r["adapters"]), 0) + 1
        fewest = min((f for f in rows if f["alpha"] == r["alpha"] and f.get("repeat", 0) == r.get("repeat", 0)),
                     key=lambda f: f["adapters"])
        if r is fewest:
            continue
        name = f"α = {r['alpha']:g}, N = {r['adapters']}" + (f", {r['runs']} runs" if "runs" in r else f", run {run}")
        if r["alpha"] == 1 and r["adapters"] >= 1000:
            out.append(Check("throughput / the fewest N's", name, r["tokens_per_s"] / fewest["tokens_per_s"],
                             THROUGHPUT, "x", at_least=True))
        control = r.get("control")
        label, without = ("all resident", control) if control else (f"N = {fewest['adapters']}", fewest)
        out.append(Check(f"ITL p99 / {label}", name, r["itl_p99_ms"] / without["itl_p99_ms"], ITL, "x"))
        if r.get("cold_requests"):
            out.append(Check("on-disk TTFT p99 <= load + step p99", name, r["cold_ttft_p99_ms"],
                             r["load_plus_step_ms"], " ms"))
    return out


def device_cache(result: dict) -> str:
    """The run's device cache, as `bench/tenancy.py --device-cache-memory` set it (none in runs before it)."""
    gib = result.get("device_cache_memory")
    return "no device cache" if gib is None else f"device cache {gib:g} GiB"


def main() -> int:
    met = True
    for path in sys.argv[1:] or ["bench/results/tenancy.json"]:
        # a tenancy.py result, or several gathered under "runs" (bench/results' merged files)
        results = read_results(path, ("device", "max_loras", "rate", "rows"), "bench/tenancy.py")
        if results is None:
            return 2
        for i, result in enumerate(results):
            print(f"# {path}{f', run {i + 1}' if len(results) > 1 else ''}: {result['device']}, "
                  f"{result['max_loras']} slots, {device_cache(result)}, {result['rate']:g} requests/s\n")
            print("| target | row | measured | bound | met |\n|---|---|---|---|---|")
            for c in checks(result):
                met &= c.met
                print(f"| {c.target} | {c.row} | {c.shown(c.value)} | {c.shown(c.bound)} | "
                      f"{'yes' if c.met else 'no'} |")
            print()
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
