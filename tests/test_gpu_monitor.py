"""bench/common.py's GpuMonitor reads the card's facts and summarizes the clocks sampled while a block runs, from an
nvidia-smi stand-in on PATH (a script that answers as the real one does, with the fields in the order asked for);
without nvidia-smi it records the kernel release alone (so does `gpu_facts`, which bench/kernels.py and the studies'
JSON record)."""

import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import common  # noqa: E402

# Answers the facts query with one line, and the looped query with samples every 20 ms: the first two at the top
# clock and idle, the rest power-capped at 1600-1700 MHz, one of them unreadable as nvidia-smi prints it.
FAKE = """#!/bin/sh
case "$*" in
  *--loop-ms*)
    echo "1980, 3201, 120.50, 35, 0x0000000000000001"
    echo "1980, 3201, 130.00, 36, 0x0000000000000001"
    while true; do
      echo "1600, 3201, 699.25, 61, 0x0000000000000004"
      echo "1700, 3201, 650.00, 62, 0x0000000000000004"
      echo "[N/A], [N/A], [N/A], [N/A], [N/A]"
      sleep 0.02
    done ;;
  *) echo "GPU-1234, NVIDIA H200, 580.159.04, 700.00, 1980, 3201" ;;
esac
"""


def _fake_smi(tmp_path, monkeypatch) -> None:
    (tmp_path / "nvidia-smi").write_text(FAKE)
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_facts_and_a_span_of_samples(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch)
    monitor = common.GpuMonitor(period_ms=20)
    try:
        assert monitor.facts == {"uuid": "GPU-1234", "name": "NVIDIA H200", "driver_version": "580.159.04",
                                 "power.limit": "700.00", "clocks.max.sm": "1980", "clocks.max.mem": "3201",
                                 "kernel": platform.release()}
        time.sleep(0.2)  # the two idle samples come before the span
        with monitor.span() as got:
            time.sleep(0.3)
    finally:
        monitor.close()
    assert got["samples"] >= 6
    assert got["sm_mhz_min"] == 1600 and 1600 <= got["sm_mhz"] <= 1700 and got["mem_mhz"] == 3201
    assert got["power_w_max"] == 699.25 and got["temperature_c_max"] == 62
    assert got["clock_events"] == ["sw_power_cap"]
    assert common.describe_span(got).startswith("  [SM ") and "sw_power_cap" in common.describe_span(got)


def test_without_nvidia_smi_the_kernel_alone_and_empty_spans(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi there
    monitor = common.GpuMonitor()
    with monitor.span() as got:
        pass
    monitor.close()
    assert monitor.facts == common.gpu_facts() == {"kernel": platform.release()}
    assert got == {} and common.describe_span(got) == ""


def test_a_studys_rows_name_the_card(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch)
    _, record = common.row_recorder(str(tmp_path / "out"), "study.json")
    record({"case": "a"})
    record({"case": "b"})
    with open(tmp_path / "out" / "study.json") as f:
        written = json.load(f)
    assert written["gpu"]["uuid"] == "GPU-1234" and written["gpu"]["kernel"] == platform.release()
    assert [row["case"] for row in written["rows"]] == ["a", "b"]
