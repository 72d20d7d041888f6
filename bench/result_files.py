"""Reading a benchmark's JSON result for the target scripts (`decode_targets.py`, `tenancy_targets.py`): a file
that cannot be read, or holds something else, is said on stderr instead of ending in a traceback."""

from __future__ import annotations

import json
import sys


def read_results(path: str, keys: tuple[str, ...], script: str,
                 row_keys: tuple[str, ...] = ()) -> list[dict] | None:
    """The results in JSON file `path`: the one it holds, or those it gathers under "runs"; None, said on stderr,
    where it cannot be read or one of them is not a `script` result (a dict with every one of `keys`, and with
    `row_keys`, a list under "rows" of dicts with every one of them: another script's rows, as the profile's of
    bench/model.py, lack some)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        print(f"{path}: cannot read it: {err}", file=sys.stderr)
        return None
    results = data.get("runs", [data]) if isinstance(data, dict) else [data]
    if not isinstance(results, list) or not all(isinstance(r, dict) and set(keys) <= r.keys() for r in results):
        print(f"{path}: not a {script} result (no {', '.join(keys[:-1])} and {keys[-1]})", file=sys.stderr)
        return None
    if row_keys and not all(isinstance(r["rows"], list) and all(isinstance(row, dict) and set(row_keys) <= row.keys()
                                                                for row in r["rows"]) for r in results):
        print(f"{path}: not a {script} result (a row lacks one of {', '.join(row_keys)})", file=sys.stderr)
        return None
    return results


def read_model_results(path: str) -> list[dict] | None:
    """`read_results` of a `bench/model.py` table (its profile's and --tp's results, whose rows are of other kinds,
    are refused)."""
    return read_results(path, ("device", "copy_bandwidth_Bps", "rows"), "bench/model.py",
                        ("kind", "batch", "tokens", "rank", "adapters", "ms", "tokens_per_s", "overhead_vs_base",
                         "vs_floor"))
