"""Smoke test: benchmarks/split.py --quick --json runs and reports positive numbers;
raw-op attention split by heads moves no more than Megatron's split must."""
import json
import os
import sys

import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_split_benchmark_quick_json():
    out = warm_python.run([sys.executable, os.path.join(ROOT, "benchmarks", "split.py"),
                           "--quick", "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=True).stdout
    report = json.loads(out)
    assert set(report) == {"config", "results", "checks"}
    assert len(report["results"]) == 5
    for r in report["results"]:
        assert {"measurement", "a", "b", "unit", "a_value", "b_value", "ratio", "target",
                "met", "estimate"} <= set(r)
        assert r["a_value"] > 0 and r["b_value"] > 0 and r["ratio"] > 0
    estimate = report["results"][0]["estimate"]
    assert estimate["sp1_bytes_per_row"] > 0 and estimate["sp2_bytes_per_row"] > 0
    assert estimate["sp1_patterns"]["logits"] == "column"
    assert estimate["sp2_patterns"]["logits"] == "row"
    megatron = report["results"][4]  # raw-op attention split by heads moves Megatron's bytes
    assert megatron["b"] == "Megatron" and megatron["met"], megatron
