"""The plan report in a real browser (headless Chromium, ``tests/browser.py``):
the demo's report and a 1024-GPU described plan's render with no console
error, a screenshot that is not blank, and no request but the file itself."""
import os
import sys

import pytest
import tensorflow as tf

import tfpar as wh
from browser import CHROMIUM, colours, load
from test_expert_plans import gpt_loss
import warm_python

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed: `make test` installs Debian's "
    "chromium package where it runs as root with apt-get")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
v1 = tf.compat.v1


def _check(path: str, shot: str):
    """The page at ``path`` loads cleanly, fetches nothing, and is drawn;
    its screenshot is saved to ``shot``."""
    page = load(path)
    with open(shot, "wb") as f:
        f.write(page.screenshot)
    assert page.errors == []
    assert [u for u in page.requests if u != "file://" + os.path.abspath(path)
            and not u.startswith("data:")] == []
    assert colours(page.screenshot) > 100  # a blank page has one
    return page


def test_a_page_that_errs_or_fetches_is_caught(tmp_path):
    """The checks can fail: a console error, an exception and a request are
    seen, and a blank page has one colour."""
    bad = tmp_path / "bad.html"
    bad.write_text('<img src="http://example.invalid/x.png"><script>console.error("boom");'
                   "missing();</script><p>text</p>")
    page = load(str(bad))
    assert "http://example.invalid/x.png" in page.requests
    assert any("boom" in e for e in page.errors) and len(page.errors) >= 2
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><title>blank</title>")
    assert colours(load(str(blank)).screenshot) <= 2


def test_the_demos_report_renders(tmp_path):
    report = tmp_path / "demo_report.html"
    out = warm_python.run([sys.executable, os.path.join(ROOT, "examples", "data_parallel_mlp.py"),
                           "--devices", "2", "--steps", "2", "--report", str(report)],
                          capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.rstrip().endswith(f"plan report (open it in a browser): {report}")
    assert "traced step: " in report.read_text()
    _check(str(report), str(tmp_path / "demo_report.png"))


def test_a_1024_gpu_described_plan_renders(tmp_path):
    """A GPT of 8 blocks planned for 1024 described A100s (128 DGX nodes)."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"auto.auto_parallel": True, "auto.planning_pass": False,
                 "cluster.num_devices": 1024, "cluster.hardware": "1024 x A100-80GB",
                 "cluster.devices_per_node": 8,
                 "auto.memory_techniques": ["recompute", "zero", "mixed_precision"]})
        try:
            loss = gpt_loss(8, 2048, 16, vocab=32000)(v1.placeholder(tf.int32, [1024, 1024]))
            v1.train.AdamOptimizer(1e-4).minimize(loss)
            plan = wh.current_plan()
        finally:
            wh.reset()
    report = plan.to_html(str(tmp_path / "plan_1024.html"))
    text = open(report, encoding="utf-8").read()
    assert "1024 devices on 128 node(s)" in text and "chosen" in text
    _check(report, str(tmp_path / "plan_1024.png"))
