"""The planning pass of auto_parallel scripts: when it runs, and that a failed
pass is an error. The pass itself: test_structure's example."""
import sys

import pytest

from tfpar.config import Config
from tfpar.errors import PlanError
from tfpar.runtime import planning_pass

AUTO = Config({"auto.auto_parallel": True})
SCRIPT = {"__name__": "__main__"}


@pytest.mark.parametrize("config,caller,env", [
    (Config(), SCRIPT, {}),                                         # auto off
    (AUTO.replace({"auto.planning_pass": False}), SCRIPT, {}),      # pass off
    (AUTO.replace({"plan": {"task_graphs": []}}), SCRIPT, {}),      # plan pinned
    (AUTO, {"__name__": "tests.model"}, {}),                        # not the script
    (AUTO, SCRIPT, {planning_pass.ENV: "1"}),                       # already the pass
    (AUTO, SCRIPT, {"TF_CONFIG": "{}"}),                            # a cluster worker
])
def test_no_pass(config, caller, env, monkeypatch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    monkeypatch.setattr(sys, "argv", [str(script)])
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ran = []
    monkeypatch.setattr(planning_pass, "_run_pass", lambda *a: ran.append(a) or {})
    assert planning_pass.pinned_by_planning_pass(config, caller) is config
    assert not ran


def test_a_failed_pass_is_an_error(monkeypatch, tmp_path, capsys):
    """Before, a crashing pass printed a line and went on without sharding."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(3)\n")
    monkeypatch.setattr(sys, "argv", [str(script), "--flag"])
    with pytest.raises(PlanError, match=r"planning pass .*--flag.* failed \(exit 3.*"
                                        r"auto.planning_pass\": false"):
        planning_pass.pinned_by_planning_pass(AUTO, SCRIPT)
    assert "planning pass:" in capsys.readouterr().err
