"""tfpar: plan, inspect and launch TensorFlow training on several devices.

    tfpar config                       list every config key, its default and meaning
    tfpar plan [--config CFG] [--json] [--out FILE] [--html FILE] SCRIPT [ARGS...]
                                       run SCRIPT until its first session run and print
                                       the plan tfpar would execute (or write its JSON, or
                                       its HTML report, to FILE), without training
    tfpar plan --model gpt|llama|bert --layers L --hidden H --heads A --seq S
               --vocab V --batch B --cluster "N x DEVICE" [--ffn F] [--kv-heads K]
               [--fused-qkv] [--tied-embeddings] [--devices-per-node D]
               [--config CFG] [--json] [--out FILE] [--html FILE]
                                       plan that model on the cluster described, which
                                       need not exist, without a script
    tfpar launch --workers N [--devices-per-worker K] [--network auto|private|host]
                 [--max-restarts R] SCRIPT [ARGS...]
                                       run SCRIPT as N local workers of a TF_CONFIG cluster,
                                       in a network of their own where the OS allows;
                                       restart them all up to R times after a failure
    tfpar launch --hosts H1,H2 [--port P] SCRIPT [ARGS...]
                                       print each host's command and TF_CONFIG
    tfpar simulate --stages P --micro-batches M [--schedule S] [--group-size K]
                   [--forward F] [--backward B] [--transfer T] [--weight-share S]
                   [--virtual-stages V] [--trace OUT.json]
                                       replay a pipeline schedule: length (in the unit of
                                       F and B), bubble, micro-batches in flight, vs 1F1B;
                                       optional Chrome trace
"""
import argparse
import os
import runpy
import sys
from typing import List, Optional

__all__ = ["main"]


class _PlanReady(BaseException):
    """Raised inside the user's script once the plan is known (not an
    Exception: neither the script nor tfpar's own handlers catch it)."""


def _plan(args) -> int:
    if (args.model is None) == (args.script is None):
        print("tfpar plan: give a SCRIPT or --model, not " + ("both" if args.model else "neither"),
              file=sys.stderr)
        return 2
    if args.model is not None:
        return _plan_model(args)
    if _script_missing(args):
        return 2
    from tfpar import api  # pylint: disable=import-outside-toplevel
    from tfpar.runtime import engine, planning, planning_pass  # pylint: disable=import-outside-toplevel

    original_init = api.init
    forced = args.config

    def init(config=None):
        return original_init(forced if forced is not None else config)

    os.environ[planning_pass.ENV] = "1"  # this run is the planning pass

    def stop_at_plan(graph):
        from tfpar.hooks.capture import existing_capture  # pylint: disable=import-outside-toplevel
        from tfpar.runtime.context import active  # pylint: disable=import-outside-toplevel
        capture = existing_capture(graph)
        if active() is None or capture is None or not capture.gradient_calls:
            return None
        _show(planning.plan_for(graph, capture, active()), args)
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


def _plan_model(args) -> int:
    """``tfpar plan --model``: plan a described model on a described cluster."""
    from tfpar import plan_models  # pylint: disable=import-outside-toplevel
    from tfpar.errors import ConfigError  # pylint: disable=import-outside-toplevel
    try:
        plan = plan_models.model_plan(args)
    except ConfigError as error:
        print(f"tfpar plan: {error}", file=sys.stderr)
        return 2
    _show(plan, args)
    return 0


def _show(plan, args) -> None:
    """Print the plan (summary or JSON), or write its JSON to ``--out`` and
    its report to ``--html``, and say so."""
    if args.html:
        print(f"tfpar plan: report written to {plan.to_html(args.html)}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(plan.to_json())
        print(f"tfpar plan: wrote the plan's JSON to {args.out}")
    elif not args.html:
        print(plan.to_json() if args.json else plan.summary())


def _script_missing(args) -> bool:
    """True, after saying so on stderr, when the script to run does not exist."""
    if os.path.exists(args.script):
        return False
    print(f"tfpar {args.command}: {args.script}: no such file", file=sys.stderr)
    return True


def _launch(args) -> int:
    """Run the script as local workers, or print each host's command."""
    from tfpar.runtime import launcher  # pylint: disable=import-outside-toplevel
    if args.hosts:  # the script is on those hosts, not necessarily here
        print(launcher.hosts_commands(args.hosts.split(","), args.port, args.script,
                                      args.script_args))
        return 0
    if _script_missing(args):
        return 2
    return launcher.launch(args.workers, args.script, args.script_args, args.devices_per_worker,
                           network=args.network, max_restarts=args.max_restarts)


def _simulate(args) -> int:
    from tfpar.ir import schedule, simulate, trace  # pylint: disable=import-outside-toplevel
    try:
        tasks, result, name = _simulated(args, schedule, simulate)
        baseline = simulate.simulate(schedule.build_schedule("1f1b", args.stages,
                                                             args.micro_batches),
                                     args.forward, args.backward, args.transfer)
    except ValueError as exc:
        print(f"tfpar simulate: {exc}", file=sys.stderr)
        return 2
    unit = f" (in the unit of --forward {args.forward:g} and --backward {args.backward:g})"
    print(f"{name} x {args.micro_batches} micro-batches: "
          f"{result.describe(unit)}")
    print(f"  vs 1f1b: length {baseline.length:g} (same unit), bubble {baseline.bubble_fraction:.1%} "
          f"(step {result.length / baseline.length:.3f}x 1f1b's)")
    for stage, stage_tasks in enumerate(tasks):
        print(f"  stage {stage}: " + " ".join(map(str, stage_tasks)))
    if args.trace:
        trace.write_chrome_trace(trace.chrome_trace(result), args.trace)
        print(f"Chrome trace: {args.trace}")
    return 0


def _simulated(args, schedule, simulate):
    """(tasks per stage, the simulation, the schedule's name) of ``tfpar
    simulate``'s arguments: with ``--virtual-stages V``, each of the stages
    (devices) runs V stages of 1/V of its times, interleaved."""
    if args.virtual_stages == 1:
        tasks = schedule.build_schedule(args.schedule, args.stages, args.micro_batches,
                                        args.group_size)
        return tasks, simulate.simulate(tasks, args.forward, args.backward, args.transfer,
                                        args.weight_share), \
            f"{args.schedule} schedule, {args.stages} stages"
    if args.schedule != "1f1b":
        raise ValueError("--virtual-stages interleaves the 1f1b schedule")
    v = args.virtual_stages
    tasks = schedule.interleaved_schedule(args.stages, v, args.micro_batches)
    return tasks, simulate.simulate(tasks, args.forward / v, args.backward / v, args.transfer,
                                    device_groups=args.stages), \
        f"interleaved 1f1b schedule, {args.stages} devices x {v} virtual stages"


def _count(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not >= 0")
    return value


def main(argv: Optional[List[str]] = None) -> int:
    from tfpar.ir.schedule import SCHEDULES  # pylint: disable=import-outside-toplevel
    from tfpar.runtime.launcher import NETWORKS  # pylint: disable=import-outside-toplevel
    from tfpar.plan_models import add_arguments  # pylint: disable=import-outside-toplevel
    parser = argparse.ArgumentParser(prog="tfpar", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("config", help="list config keys")
    plan = sub.add_parser("plan", help="print the plan of a training script, or of a "
                                       "described model on a described cluster (--model)")
    plan.add_argument("script", nargs="?", help="the training script (or give --model)")
    plan.add_argument("--config", help="config (JSON file or text) used instead of the script's "
                                       "(with --model: its keys over the command's)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--out", help="write the plan's JSON to this file instead")
    plan.add_argument("--html", metavar="FILE", help="write the plan report (one HTML file) "
                                                     "to FILE instead")
    plan.add_argument("script_args", nargs=argparse.REMAINDER)
    add_arguments(plan)
    launch = sub.add_parser("launch", help="run a script as N local workers (TF_CONFIG)")
    launch.add_argument("--workers", type=int, default=2, help="worker processes")
    launch.add_argument("--devices-per-worker", type=int, help="cluster.num_devices per worker")
    launch.add_argument("--hosts", help="comma-separated hosts: print each host's command "
                                        "and TF_CONFIG instead of running locally")
    launch.add_argument("--port", type=int, default=2222, help="port on each host (--hosts)")
    launch.add_argument("--network", choices=NETWORKS, default="auto",
                        help="private: a network namespace of the workers' own, loopback only "
                             "(refused where the OS does not allow one); host: this host's "
                             "network, where their gRPC servers are open to anyone who reaches "
                             "it; auto: private where allowed, else host, saying why")
    launch.add_argument("--max-restarts", type=_count, default=0, metavar="R",
                        help="after a worker fails, stop every worker and start them all again, "
                             "at most this many times (the script resumes from its checkpoint)")
    launch.add_argument("script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER)
    simulate = sub.add_parser("simulate", help="replay a pipeline schedule (no TensorFlow)")
    simulate.add_argument("--stages", type=int, required=True)
    simulate.add_argument("--micro-batches", type=int, required=True)
    simulate.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    simulate.add_argument("--group-size", type=int, default=1, help="k of kfkb")
    simulate.add_argument("--forward", type=float, default=1.0, help="forward time per stage (any unit: lengths "
                          "are printed in it)")
    simulate.add_argument("--backward", type=float, default=2.0, help="backward time per stage (same unit)")
    simulate.add_argument("--transfer", type=float, default=0.0, help="cross-stage delay")
    simulate.add_argument("--weight-share", type=float, default=0.5,
                          help="part of the backward its weight gradients take (zero_bubble)")
    simulate.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                          help="stages per device, interleaved (1f1b only; --forward and "
                               "--backward stay a device's whole share)")
    simulate.add_argument("--trace", help="write a Chrome trace of the schedule here")
    args = parser.parse_args(argv)
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "launch":
        return _launch(args)
    if args.command == "config":
        from tfpar.config_schema import describe  # pylint: disable=import-outside-toplevel
        print(describe())
        return 0
    return _plan(args)


if __name__ == "__main__":
    sys.exit(main())
