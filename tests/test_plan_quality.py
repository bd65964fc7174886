"""``benchmarks/plan_quality.py``: the models it writes out op by op have the sizes
the papers state, and ``--quick --json`` runs in a fresh process and prints every
row with its targets (whether they are met is the benchmark's ``--check``)."""
import json
import os
import sys

import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import plan_quality  # noqa: E402

MIB = 2 ** 20


def test_resnet50_has_the_sizes_whale_states():
    """Whale §1 and §5.1.2: a 90 MB ResNet-50 backbone and a 782 MB FC for
    100K classes. Keras's ResNet50 has 25,636,712 parameters with its
    1000-class head (2048 x 1000 + 1000): 23,587,712 in the backbone (batch
    norms' moving statistics included); its convolutions 3.8-4.1 G
    multiply-adds per 224 x 224 image (He et al. count 3.8 G)."""
    view = plan_quality.resnet50(100000)
    head = view.names.index("predictions/MatMul")
    assert sum(view.param_bytes[:head]) == 4 * 23587712
    assert round(sum(view.param_bytes[:head]) / MIB) == 90
    assert round(sum(view.param_bytes[head:]) / MIB) == 782
    assert 2 * 3.8e9 < sum(view.flops[:head]) < 2 * 4.1e9


def test_gpt_medium_has_the_size_rhino_states():
    """Rhino Table 1: GPT-Medium, 350M parameters (the untied ``lm_head`` apart)."""
    view = plan_quality.gpt(24, 1024, 16, 1024, 50257)
    head = view.names.index("lm_head/MatMul")
    assert 340e6 < sum(view.param_bytes[:head]) / 4 < 360e6


def test_quick_json_prints_every_row_and_its_targets():
    done = warm_python.run([sys.executable, os.path.join(ROOT, "benchmarks", "plan_quality.py"),
                            "--quick", "--json"], capture_output=True, text=True, timeout=120,
                           cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["config"] == {"batch_per_gpu": 32, "seq": 128, "time_limit": 20}
    rows = out["results"]
    assert [(r["source"], r["gpus"]) for r in rows[:2]] == [("Whale §5.1.2 Fig. 13", 8),
                                                             ("Whale §5.1.2 Fig. 13", 16)]
    assert rows[-1]["source"] == "Rhino §7.3"
    for r in rows:
        assert r["chosen"] and r["paper_plan"] and r["est_ratio"] > 0
        assert r["met"] == all(c["met"] for c in r["checks"].values())
    assert len(out["targets"]) == sum(len(r["checks"]) for r in rows)
    assert "plan_quality: searching 16 GPUs" in done.stderr
