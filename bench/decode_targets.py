"""The decode-floor targets (issue #39) checked against a `bench/model.py` run: one line per target row, the
measured ratio, its bound and whether it is met; exit status 1 when one is not (or cannot be read from the rows),
2 when the file is not a bench/model.py result (a file may gather several under "runs": each is checked).

  - the base decode step at batch 1 and 32: at most 1.15x its floor (weights + KV at the copy bandwidth);
  - one r=16 adapter at batch 32: at most 1.04x the base step;
  - every LoRA decode row: at most 1.08x its floor (the base step + the adapters' bytes);
  - every LoRA prefill row: at most 1.09x its floor.
The kernel table's rows (within 3 % of the last run) come from bench/kernels.py, not this file. Where the run
recorded its GPU (`common.GpuMonitor`), the header names the card, and a line after the table names the batches
whose SM clock was held below its top while they ran (a power or thermal cap), which a ratio between runs should
be read with. `--table` prints instead the rows docs/performance.md shows, as its table.

  python bench/decode_targets.py [--table] [bench/results/model.json]
"""

from __future__ import annotations

import argparse
import sys

from result_files import read_model_results

BOUNDS = {"base": 1.15, "one adapter": 1.04, "decode": 1.08, "prefill": 1.09}


def checks(rows: list[dict]) -> list[tuple[str, str, float | None, float]]:
    """(target, row, measured ratio or None where the file lacks it, bound) for each target row of `rows`."""
    out = []
    for batch in (1, 32):
        row = next((r for r in rows if r["kind"] == "decode" and r["adapters"] == 0 and r["batch"] == batch), None)
        out.append(("base step / its floor", f"decode batch {batch}", row and row.get("base_vs_floor"),
                     BOUNDS["base"]))
    row = next((r for r in rows if r["kind"] == "decode" and r["batch"] == 32 and r["adapters"] == 1
                and r["rank"] == 16), None)
    out.append(("one adapter / the base step", "decode batch 32, 1 adapter r=16", row and row["overhead_vs_base"],
                BOUNDS["one adapter"]))
    for r in rows:
        if r["adapters"]:
            out.append((f"{r['kind']} with LoRA / its floor",
                        f"{r['kind']} batch {r['batch']}, {r['tokens']} tokens, {r['adapters']} "
                        f"adapter{'s' * (r['adapters'] > 1)} r={r['rank']}",
                        r["vs_floor"], BOUNDS[r["kind"]]))
    return out


def card(result: dict) -> str:
    """The card a run recorded (UUID, power limit, host kernel), for its header ("" where it recorded none)."""
    gpu = result.get("gpu") or {}
    if "uuid" not in gpu:
        return ""
    return f"; card {gpu['uuid']} ({gpu.get('power.limit', '?')} W limit), host kernel {gpu.get('kernel', '?')}"


def capped(rows: list[dict]) -> list[str]:
    """Each batch whose recorded span saw the SM clock held down (a clock-event reason other than idle), once:
    "decode batch 64 (sw_power_cap; SM median 1980 MHz, least 1950)"."""
    seen = {}
    for r in rows:
        gpu = r.get("gpu") or {}
        events = [e for e in gpu.get("clock_events", []) if e != "idle"]
        if events:
            seen.setdefault(f"{r['kind']} batch {r['batch']}",
                            f"{', '.join(events)}; SM median {gpu['sm_mhz']:.0f} MHz, least {gpu['sm_mhz_min']:.0f}")
    return [f"{name} ({why})" for name, why in seen.items()]


# The rows docs/performance.md's table shows, in its order: (kind, batch, rank, adapters); rank 0 is the base step.
SHOWN = [("decode", 1, 0, 0), ("decode", 1, 16, 1), ("decode", 8, 0, 0), ("decode", 8, 16, 8),
         ("decode", 32, 0, 0), ("decode", 32, 16, 1), ("decode", 32, 16, 8), ("decode", 32, 16, 32),
         ("decode", 32, 64, 32), ("decode", 64, 0, 0), ("decode", 64, 16, 32), ("decode", 64, 64, 32),
         ("prefill", 4, 0, 0), ("prefill", 4, 16, 4), ("prefill", 16, 0, 0), ("prefill", 16, 16, 16)]


def table(rows: list[dict]) -> list[str]:
    """docs/performance.md's table of the model step: the SHOWN rows that `rows` holds, one markdown line each."""
    lines = ["| kind | batch | tokens | r | adapters | ms | tokens/s | × base | × floor | base step's floor ms (× it) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, batch, rank, adapters in SHOWN:
        r = next((row for row in rows if (row["kind"], row["batch"], row["rank"], row["adapters"])
                  == (kind, batch, rank, adapters)), None)
        if r is None:
            continue
        floor = "—" if r.get("vs_floor") is None else f"{r['vs_floor']:.2f}"
        base_floor = ("—" if r.get("base_floor_ms") is None or adapters
                      else f"{r['base_floor_ms']:.2f} ({r['base_vs_floor']:.2f})")
        lines.append(f"| {kind} | {batch} | {r['tokens']} | {rank or '—'} | {adapters} | {r['ms']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {r['overhead_vs_base']:.2f} | {floor} | {base_floor} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description="#39's decode-floor targets read from a bench/model.py result")
    parser.add_argument("path", nargs="?", default="bench/results/model.json")
    parser.add_argument("--table", action="store_true", help="print docs/performance.md's table of the rows instead")
    args = parser.parse_args()
    path = args.path
    results = read_model_results(path)
    if results is None:
        return 2
    if args.table:
        for i, result in enumerate(results):
            if len(results) > 1:  # several gathered under "runs": each table under its run's name
                print(("\n" if i else "") + f"# {path}, run {i + 1}: {result['device']}")
            print("\n".join(table(result["rows"])))
        return 0
    met = True
    for i, result in enumerate(results):  # one bench/model.py result, or several gathered under "runs"
        processes = result.get("processes")  # a table over several processes (`bench/model.py --add`)
        head = "" if processes else f", copy bandwidth {result['copy_bandwidth_Bps'] / 1e12:.2f} TB/s{card(result)}"
        print(f"# {path}{f', run {i + 1}' if len(results) > 1 else ''}: {result['device']}{head}")
        for process in processes or ():
            print(f"#   decode batches {', '.join(map(str, process['batches']))} in a process at "
                  f"{process['copy_bandwidth_Bps'] / 1e12:.2f} TB/s{card(process)}")
        print()
        print("| target | row | measured | bound | met |\n|---|---|---|---|---|")
        for target, row, ratio, bound in checks(result["rows"]):
            ok = ratio is not None and ratio <= bound
            met &= ok
            shown = "not in this file (rerun bench/model.py)" if ratio is None else f"{ratio:.3f}x"
            print(f"| {target} | {row} | {shown} | {bound:.2f}x | {'yes' if ok else 'no'} |")
        held = capped(result["rows"])
        if held:
            print(f"\nSM clock held below its top while timed: {'; '.join(held)}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
