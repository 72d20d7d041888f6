"""bench/tenancy_targets.py reads bench/tenancy.py results against issue #36's bounds: each target row, met or
not, against the all-resident run where there is one, and an exit status that says whether all are."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import tenancy_targets  # noqa: E402


def _row(alpha, n, tokens_per_s=2000.0, itl_p99_ms=16.0, control=None, cold=0, cold_p99=None, bound=None, **extra):
    row = {"alpha": alpha, "adapters": n, "tokens_per_s": tokens_per_s, "itl_p99_ms": itl_p99_ms,
           "cold_requests": cold, "cold_ttft_p99_ms": cold_p99, "load_plus_step_ms": bound, **extra}
    if control is not None:
        row["control"] = {"itl_p99_ms": control, "tokens_per_s": tokens_per_s}
    return row


def _run(tmp_path, monkeypatch, capsys, *results):
    paths = []
    for i, result in enumerate(results):
        paths.append(tmp_path / f"tenancy{i}.json")
        paths[-1].write_text(json.dumps({"device": "GPU", "max_loras": 32, "rate": 16, **result}))
    monkeypatch.setattr(sys, "argv", ["tenancy_targets.py", *map(str, paths)])
    return tenancy_targets.main(), capsys.readouterr().out


def test_every_target_met_exits_zero(tmp_path, monkeypatch, capsys):
    rows = [_row(1, 32, control=16.5), _row(1, 1000, tokens_per_s=1800.0, itl_p99_ms=19.8, control=16.5, cold=100,
                                              cold_p99=350.0, bound=350.0)]
    status, out = _run(tmp_path, monkeypatch, capsys, {"rows": rows})
    assert status == 0 and out.count("| yes |") == 3 and "| no |" not in out
    assert "| throughput / the fewest N's | α = 1, N = 1000, run 1 | 0.900x | 0.900x | yes |" in out
    assert "| ITL p99 / all resident | α = 1, N = 1000, run 1 | 1.200x | 1.200x | yes |" in out
    assert "| on-disk TTFT p99 <= load + step p99 | α = 1, N = 1000, run 1 | 350 ms | 350 ms | yes |" in out


def test_pooled_rows_are_read_first_and_a_miss_in_any_file_fails(tmp_path, monkeypatch, capsys):
    """The first file's single runs miss the ITL bound against N = 32 (no all-resident run), but its pooled rows
    are what it is judged on; the second misses its on-disk TTFT bound."""
    single = [_row(0.5, 32, itl_p99_ms=10.0), _row(0.5, 512, itl_p99_ms=30.0)]
    pooled = [_row(0.5, 32, itl_p99_ms=15.0, runs=2), _row(0.5, 512, itl_p99_ms=17.0, runs=2, cold=3, cold_p99=300.0,
                                                            bound=310.0)]
    late = [_row(0.5, 32), _row(0.5, 512, itl_p99_ms=16.0, cold=5, cold_p99=400.0, bound=399.0)]
    status, out = _run(tmp_path, monkeypatch, capsys, {"rows": single, "pooled": pooled}, {"rows": late})
    assert status == 1
    assert "| ITL p99 / N = 32 | α = 0.5, N = 512, 2 runs | 1.133x | 1.200x | yes |" in out
    assert "| on-disk TTFT p99 <= load + step p99 | α = 0.5, N = 512, 2 runs | 300 ms | 310 ms | yes |" in out
    assert "| on-disk TTFT p99 <= load + step p99 | α = 0.5, N = 512, run 1 | 400 ms | 399 ms | no |" in out
    assert "3.000x" not in out  # the single runs of the first file are not judged


def test_repeated_runs_of_one_n_are_told_apart(tmp_path, monkeypatch, capsys):
    rows = [_row(0.5, 32, control=15.0), _row(0.5, 512, itl_p99_ms=19.0, control=15.0),
            _row(0.5, 512, itl_p99_ms=18.0, control=16.0)]
    status, out = _run(tmp_path, monkeypatch, capsys, {"rows": rows})
    assert status == 1
    assert "| ITL p99 / all resident | α = 0.5, N = 512, run 1 | 1.267x | 1.200x | no |" in out
    assert "| ITL p99 / all resident | α = 0.5, N = 512, run 2 | 1.125x | 1.200x | yes |" in out


def test_results_gathered_under_runs_are_each_checked_and_other_json_is_refused(tmp_path, monkeypatch, capsys):
    one = {"device": "GPU", "max_loras": 32, "rate": 16, "rows": [_row(1, 32), _row(1, 128, itl_p99_ms=17.0)]}
    two = one | {"rows": [_row(1, 32), _row(1, 128, itl_p99_ms=20.0)]}
    path = tmp_path / "gathered.json"
    path.write_text(json.dumps({"note": "two processes", "runs": [one, two]}))
    monkeypatch.setattr(sys, "argv", ["tenancy_targets.py", str(path)])
    assert tenancy_targets.main() == 1
    out = capsys.readouterr().out
    assert f"# {path}, run 1: GPU" in out and f"# {path}, run 2: GPU" in out
    assert "| ITL p99 / N = 32 | α = 1, N = 128, run 1 | 1.062x | 1.200x | yes |" in out
    assert "| ITL p99 / N = 32 | α = 1, N = 128, run 1 | 1.250x | 1.200x | no |" in out
    path.write_text(json.dumps({"rows": []}))
    assert tenancy_targets.main() == 2
    assert "not a bench/tenancy.py result" in capsys.readouterr().err
    for text in ("[1, 2]", "{not json"):  # JSON of another shape, and no JSON at all
        path.write_text(text)
        assert tenancy_targets.main() == 2
    monkeypatch.setattr(sys, "argv", ["tenancy_targets.py", str(tmp_path / "missing.json")])
    assert tenancy_targets.main() == 2
    assert "missing.json: cannot read it" in capsys.readouterr().err
