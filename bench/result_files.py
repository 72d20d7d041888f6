"""Reading a benchmark's JSON result for the target scripts (`decode_targets.py`, `tenancy_targets.py`): a file
that cannot be read, or holds something else, is said on stderr instead of ending in a traceback."""

from __future__ import annotations

import json
import sys


def read_results(path: str, keys: tuple[str, ...], script: str) -> list[dict] | None:
    """The results in JSON file `path`: the one it holds, or those it gathers under "runs"; None, said on stderr,
    where it cannot be read or one of them is not a `script` result (a dict with every one of `keys`)."""
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
    return results
