"""The ``tfpar`` command.

    tfpar config                       list every config key, its default and meaning
    tfpar plan [--config CFG] [--json] SCRIPT [ARGS...]
                                       run SCRIPT until its first session run and print
                                       the plan tfpar would execute, without training
    tfpar launch --workers N [--devices-per-worker K] SCRIPT [ARGS...]
                                       run SCRIPT as N local workers of a TF_CONFIG cluster
    tfpar launch --hosts H1,H2 [--port P] SCRIPT [ARGS...]
                                       print each host's command and TF_CONFIG
"""
import argparse
import os
import runpy
import sys
from typing import List, Optional

__all__ = ["main"]


class _PlanReady(Exception):
    """Raised inside the user's script once the plan is known."""


def _plan(args) -> int:
    from tfpar import api  # pylint: disable=import-outside-toplevel
    from tfpar.runtime import engine  # pylint: disable=import-outside-toplevel

    original_init = api.init
    forced = args.config

    def init(config=None):
        return original_init(forced if forced is not None else config)

    def stop_at_plan(graph):
        from tfpar.hooks.capture import existing_capture  # pylint: disable=import-outside-toplevel
        from tfpar.runtime.context import active  # pylint: disable=import-outside-toplevel
        capture = existing_capture(graph)
        if active() is None or capture is None or not capture.gradient_calls:
            return None
        plan = engine.plan_for(graph, capture, active())
        print(plan.to_json() if args.json else plan.summary())
        raise _PlanReady()

    api.init = init
    import tfpar  # pylint: disable=import-outside-toplevel
    tfpar.init = init
    engine.before_run = stop_at_plan
    sys.argv = [args.script] + list(args.script_args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))  # as `python script.py`
    try:
        runpy.run_path(args.script, run_name="__main__")
    except _PlanReady:
        return 0
    print(f"tfpar plan: {args.script} finished without running a training step under "
          "tfpar (did it call wh.init() and run a session?)", file=sys.stderr)
    return 1


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tfpar", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("config", help="list config keys")
    plan = sub.add_parser("plan", help="print the plan of a training script")
    plan.add_argument("script")
    plan.add_argument("--config", help="config (JSON file or text) used instead of the script's")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("script_args", nargs=argparse.REMAINDER)
    launch = sub.add_parser("launch", help="run a script as N local workers (TF_CONFIG)")
    launch.add_argument("--workers", type=int, default=2, help="worker processes")
    launch.add_argument("--devices-per-worker", type=int, help="cluster.num_devices per worker")
    launch.add_argument("--hosts", help="comma-separated hosts: print each host's command "
                                        "and TF_CONFIG instead of running locally")
    launch.add_argument("--port", type=int, default=2222, help="port on each host (--hosts)")
    launch.add_argument("script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "launch":
        from tfpar.runtime import launcher  # pylint: disable=import-outside-toplevel
        if args.hosts:
            print(launcher.hosts_commands(args.hosts.split(","), args.port, args.script,
                                          args.script_args))
            return 0
        return launcher.launch(args.workers, args.script, args.script_args,
                               args.devices_per_worker)
    if args.command == "config":
        from tfpar.config import describe  # pylint: disable=import-outside-toplevel
        print(describe())
        return 0
    return _plan(args)


if __name__ == "__main__":
    sys.exit(main())
