"""Every benchmark's quickest mode runs end to end (issue 62): ``--quick
--json`` exits 0 and prints its report, so ``make bench`` and the figures the
docs quote from it cannot rot unseen (``benchmarks/memory.py`` crashed for a
wave after its model builder moved). ``split.py`` has its own, closer test
(``test_benchmark_split.py``). The benchmarks that start many TensorFlow
processes or take over 20 s in their quickest mode run with the multi-process
tests (marked slow)."""
import json
import os
import sys

import pytest

import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["memory", "overhead", "plan_quality", "planner", "retune"]
LONGER = ["batch_norm", "multiworker", "plan_scale", "startup", "tf2"]
# Fewer timed rounds and a smaller model than --quick, where a benchmark takes them
# as flags: every part still runs end to end (what the suite checks).
FEWEST = {"overhead": ["--steps", "1", "--reps", "1", "--layers", "1", "--width", "16",
                       "--batch", "8"],
          "memory": ["--layers", "1", "--batch", "2"]}


def run_quick(name: str) -> dict:
    done = warm_python.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"),
                            "--quick", "--json", *FEWEST.get(name, [])], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{name}.py --quick --json:\n{done.stderr[-3000:]}"
    report = json.loads(done.stdout[done.stdout.index("{"):])
    assert report.get("results"), f"{name}.py reported no results: {report}"
    return report


@pytest.mark.parametrize("name", QUICK)
def test_a_benchmark_runs_in_its_quickest_mode(name):
    run_quick(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", LONGER)
def test_a_longer_benchmark_runs_in_its_quickest_mode(name):
    run_quick(name)
