"""bench/decode_targets.py reads a bench/model.py result against issue #39's bounds: each target row, met or not,
and an exit status that says whether all are."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import decode_targets  # noqa: E402


def _row(kind, batch, adapters, rank=16, **ratios):
    return {"kind": kind, "batch": batch, "tokens": batch * (512 if kind == "prefill" else 1), "adapters": adapters,
            "rank": rank if adapters else 0, "ms": 5.0, "tokens_per_s": batch / 5e-3, "overhead_vs_base": 1.0,
            "vs_floor": None, "base_vs_floor": None, **ratios}


def _run(tmp_path, monkeypatch, capsys, rows):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"device": "GPU", "copy_bandwidth_Bps": 4e12, "rows": rows}))
    monkeypatch.setattr(sys, "argv", ["decode_targets.py", str(path)])
    return decode_targets.main(), capsys.readouterr().out


def test_every_target_met_exits_zero(tmp_path, monkeypatch, capsys):
    rows = [_row("decode", 1, 0, base_vs_floor=1.15), _row("decode", 32, 0, base_vs_floor=1.1),
            _row("decode", 32, 1, overhead_vs_base=1.04, vs_floor=1.0), _row("decode", 64, 32, 64, vs_floor=1.08),
            _row("prefill", 4, 4, vs_floor=1.09)]
    status, out = _run(tmp_path, monkeypatch, capsys, rows)
    assert status == 0 and out.count("| yes |") == 6 and "| no |" not in out


def test_a_row_past_its_bound_or_missing_fails(tmp_path, monkeypatch, capsys):
    rows = [_row("decode", 1, 0, base_vs_floor=1.16), _row("decode", 32, 1, overhead_vs_base=1.0, vs_floor=1.0)]
    status, out = _run(tmp_path, monkeypatch, capsys, rows)
    assert status == 1
    assert "| decode batch 1 | 1.160x | 1.15x | no |" in out
    assert "| decode batch 32 | not in this file (rerun bench/model.py) | 1.15x | no |" in out
    assert "| decode batch 32, 1 adapter r=16 | 1.000x | 1.04x | yes |" in out


def test_a_file_that_is_not_a_model_result_is_refused_without_a_traceback(tmp_path, monkeypatch, capsys):
    path = tmp_path / "x.json"
    for text, message in (("{not json", "cannot read it"), ("[1]", "not a bench/model.py result"),
                          (json.dumps({"rows": []}), "not a bench/model.py result"),
                          (json.dumps({"runs": 5}), "not a bench/model.py result"),
                          # bench/model.py --profile's result: its rows are of another kind
                          (json.dumps({"device": "GPU", "copy_bandwidth_Bps": 4e12, "rows": [{"batch": 32}]}),
                           "a row lacks one of kind, batch"),
                          (json.dumps({"device": "GPU", "copy_bandwidth_Bps": 4e12, "rows": 5}), "a row lacks")):
        path.write_text(text)
        monkeypatch.setattr(sys, "argv", ["decode_targets.py", str(path)])
        assert decode_targets.main() == 2
        assert message in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["decode_targets.py", str(tmp_path / "missing.json")])
    assert decode_targets.main() == 2
    assert "missing.json: cannot read it" in capsys.readouterr().err


def test_results_gathered_under_runs_are_each_checked(tmp_path, monkeypatch, capsys):
    one = {"device": "GPU", "copy_bandwidth_Bps": 4e12, "rows": [_row("decode", 1, 0, base_vs_floor=1.1)]}
    two = one | {"rows": [_row("decode", 1, 0, base_vs_floor=1.2)]}
    path = tmp_path / "gathered.json"
    path.write_text(json.dumps({"runs": [one, two]}))
    monkeypatch.setattr(sys, "argv", ["decode_targets.py", str(path)])
    assert decode_targets.main() == 1
    out = capsys.readouterr().out
    assert f"# {path}, run 1: GPU" in out and f"# {path}, run 2: GPU" in out
    assert "| decode batch 1 | 1.100x | 1.15x | yes |" in out and "| decode batch 1 | 1.200x | 1.15x | no |" in out


def test_the_card_and_the_batches_whose_clock_was_held_down_are_named(tmp_path, monkeypatch, capsys):
    """A run that recorded its GPU (bench/common.py's GpuMonitor) names the card in the header, and each batch
    whose span saw a clock event other than idle once, after the table; a run without those reads as before."""
    top = {"sm_mhz": 1980.0, "sm_mhz_min": 1980.0, "clock_events": ["idle"]}
    held = {"sm_mhz": 1515.0, "sm_mhz_min": 1170.0, "clock_events": ["idle", "sw_power_cap"]}
    rows = [_row("decode", 1, 0, base_vs_floor=1.1, gpu=top), _row("prefill", 4, 0, gpu=held),
            _row("prefill", 4, 4, vs_floor=1.05, gpu=held)]
    gpu = {"uuid": "GPU-1234", "power.limit": "700.00", "kernel": "6.18"}
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"device": "GPU", "copy_bandwidth_Bps": 4e12, "gpu": gpu, "rows": rows}))
    monkeypatch.setattr(sys, "argv", ["decode_targets.py", str(path)])
    decode_targets.main()
    out = capsys.readouterr().out
    assert "4.00 TB/s; card GPU-1234 (700.00 W limit), host kernel 6.18" in out
    assert out.rstrip().endswith(
        "SM clock held below its top while timed: prefill batch 4 (sw_power_cap; SM median 1515 MHz, least 1170)")
    _, out = _run(tmp_path, monkeypatch, capsys, [_row("decode", 1, 0, base_vs_floor=1.1)])
    assert "; card " not in out and "held below" not in out


def test_a_table_over_two_processes_keeps_the_batches_the_second_does_not_time(tmp_path, monkeypatch, capsys):
    """`bench/model.py --batches 64 --add FILE` (a table run in two device calls): FILE's rows of other batches
    and its prefill rows are kept and each process is listed, which decode_targets names; a file of another kind
    of card, depth or LoRA backend, or no model result, is refused with a message."""
    import model

    first = {"device": "GPU", "copy_bandwidth_Bps": 4e12, "layers": 32, "gpu": {"uuid": "GPU-1"},
             "rows": [_row("decode", 32, 0, base_vs_floor=1.1), _row("decode", 64, 0, base_vs_floor=1.3),
                      _row("prefill", 4, 0)]}
    path = tmp_path / "first.json"
    path.write_text(json.dumps(first))
    processes, rows = model.earlier_rows(str(path), "GPU", (64,), 32, "auto")
    assert rows == first["rows"][::2] and processes == [{"copy_bandwidth_Bps": 4e12, "gpu": {"uuid": "GPU-1"},
                                                         "batches": [32]}]
    assert model.earlier_rows(str(path), "GPU", (32, 64), 32, "auto") == ([], [])  # batch 32 runs the prefill again
    for device, layers, backend in (("Other GPU", 32, "auto"), ("GPU", 2, "auto"), ("GPU", 32, "gather")):
        with pytest.raises(SystemExit, match="measured on GPU with 32 layers and backend auto; this run is on"):
            model.earlier_rows(str(path), device, (64,), layers, backend)
    path.write_text("{}")
    with pytest.raises(SystemExit, match="not one bench/model.py result"):
        model.earlier_rows(str(path), "GPU", (64,), 32, "auto")
    second = {"uuid": "GPU-2", "power.limit": "700.00", "kernel": "6.18"}
    table = first | {"processes": processes + [{"copy_bandwidth_Bps": 3e12, "gpu": second, "batches": [64]}]}
    path.write_text(json.dumps(table))
    monkeypatch.setattr(sys, "argv", ["decode_targets.py", str(path)])
    decode_targets.main()
    out = capsys.readouterr().out
    assert f"# {path}: GPU\n#   decode batches 32 in a process at 4.00 TB/s" in out
    assert "#   decode batches 64 in a process at 3.00 TB/s; card GPU-2 (700.00 W limit), host kernel 6.18" in out


def test_the_table_shows_the_docs_rows_in_their_order(tmp_path, monkeypatch, capsys):
    """`--table` prints docs/performance.md's table: the shown rows the file holds in the docs' order, a base
    decode step with its own floor, a LoRA row with its floor, and rows the docs leave out (r=64 at batch 1) not
    at all; exit status 0 whatever the targets; a file of several runs, each run's table under its name."""
    rows = [_row("decode", 32, 1, overhead_vs_base=1.2, vs_floor=1.19),
            _row("decode", 1, 0, base_vs_floor=1.3, base_floor_ms=3.85), _row("decode", 1, 1, 64, vs_floor=1.5),
            _row("prefill", 4, 0)]
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"device": "GPU", "copy_bandwidth_Bps": 4e12, "rows": rows}))
    monkeypatch.setattr(sys, "argv", ["decode_targets.py", "--table", str(path)])
    assert decode_targets.main() == 0
    assert capsys.readouterr().out.splitlines()[2:] == [
        "| decode | 1 | 1 | — | 0 | 5.00 | 200 | 1.00 | — | 3.85 (1.30) |",
        "| decode | 32 | 32 | 16 | 1 | 5.00 | 6400 | 1.20 | 1.19 | — |",
        "| prefill | 4 | 2048 | — | 0 | 5.00 | 800 | 1.00 | — | — |"]
    one = {"device": "GPU", "copy_bandwidth_Bps": 4e12, "rows": rows[1:2]}
    path.write_text(json.dumps({"runs": [one, one | {"device": "Other GPU"}]}))
    assert decode_targets.main() == 0
    assert capsys.readouterr().out.splitlines() == [
        f"# {path}, run 1: GPU", *decode_targets.table(rows[1:2]), "", f"# {path}, run 2: Other GPU",
        *decode_targets.table(rows[1:2])]
