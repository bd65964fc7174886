"""``auto.auto_parallel`` in a script: plan first, then build with the plan pinned.

Sharded layers must be built split (their variables are made in shards), so
the sharding search has to run before the model is built. When a script's
``wh.init`` turns on ``auto.auto_parallel`` without a pinned plan, tfpar runs
the script once more in a child process, as ``tfpar plan --out FILE`` does:
the child builds the model plainly, the planner searches, and the child stops
at the first training step. If the plan it found shards layers, this process
goes on with that plan pinned (config key ``plan``); otherwise it plans again
itself, as without a planning pass, without saying the search's progress
lines a second time. Scripts' output during the pass is
discarded; the planner's progress lines (``runtime.progress``) and errors
go to stderr. A pass that
fails or times out is an error (``PlanError``), never a quiet fallback to a
plan without sharding.
"""
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, Tuple

from tfpar.config import Config
from tfpar.errors import PlanError
from tfpar.ir.plan import Plan
from tfpar.runtime.progress import progress

__all__ = ["ENV", "pinned_by_planning_pass"]

ENV = "_TFPAR_PLANNING_PASS"  # set in the child (and by `tfpar plan`): no nested pass
TIMEOUT_S = 900


def pinned_by_planning_pass(cfg: Config, caller_globals: Dict[str, Any]
                            ) -> Tuple[Config, bool]:
    """``cfg`` with the planning pass's plan pinned when it shards layers,
    and whether a pass ran (then it said the search's progress lines); the
    pass runs only for ``wh.init`` called from a script (``__main__``) run
    as a single process (no TF_CONFIG cluster or Horovod job)."""
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if (not cfg.get("auto.auto_parallel") or not cfg.get("auto.planning_pass")
            or cfg.plan is not None or os.environ.get(ENV) or "TF_CONFIG" in os.environ
            or cfg.get("communication.backend") == "horovod"
            or caller_globals.get("__name__") != "__main__" or not os.path.isfile(script)):
        return cfg, False
    plan = _run_pass(script, sys.argv[1:])
    if not plan or not Plan.from_dict(plan).sharding:
        return cfg, True
    return cfg.replace({"plan": plan}), True


def _run_pass(script: str, args) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tfpar-plan-") as tmp:
        out = os.path.join(tmp, "plan.json")
        command = [sys.executable, "-m", "tfpar.cli", "plan", "--out", out, script, *args]
        progress(f"tfpar auto: planning pass: {' '.join(command)}")
        skip = ('set {"auto.planning_pass": false} to plan in this process without tensor '
                "sharding, or pin a plan written by `tfpar plan --out FILE`")
        try:
            done = subprocess.run(command, env={**os.environ, ENV: "1"}, timeout=TIMEOUT_S,
                                  stdout=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired as error:
            raise PlanError(f"tfpar: the planning pass took over {TIMEOUT_S} s; {skip}") from error
        if done.returncode != 0 or not os.path.exists(out):
            raise PlanError(f"tfpar: the planning pass `{' '.join(command)}` failed (exit "
                            f"{done.returncode}; its error is printed above); {skip}")
        with open(out, encoding="utf-8") as f:
            return json.load(f)
