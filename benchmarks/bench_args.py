"""What every benchmark shares (no TensorFlow import): the command line (--json,
--check, --quick and sizes) and the --check verdict on stated targets.

``sizes`` maps a size name to (full default, --quick default, help text); the
flag is ``--name`` (underscores become dashes).
"""
import argparse
import json
import os
import subprocess
import sys
import time

__all__ = ["cell", "meets", "parse_sizes", "ratio", "report", "run_configuration", "verdict",
           "worker_option"]


def parse_sizes(description, sizes, argv, check_help, quick_help="tiny sizes (smoke test)",
                parents=()):
    """(parser, args) with every size resolved from --quick when not given."""
    p = argparse.ArgumentParser(description=description, parents=list(parents))
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--check", action="store_true", help=check_help)
    p.add_argument("--quick", action="store_true", help=quick_help)
    for key, (full, quick, text) in sizes.items():
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int,
                       help=f"{text} (default {full}, --quick {quick})")
    args = p.parse_args(argv)
    for key, (full, quick, _) in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    return p, args


def worker_option(configurations):
    """Parent parser of ``--worker NAME`` for benchmarks that run each
    configuration in a fresh process of themselves."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--worker", choices=configurations,
                   help="run only this configuration, in this process, and print its result "
                        "as JSON (the table runs each configuration so, in a fresh process)")
    return p


def report(rows, found, args, sizes, print_table, checks_ok=None) -> int:
    """Print ``rows``, the targets ``found`` and the ``sizes`` run as JSON
    (``--json``), or the table ``print_table`` makes; return the benchmark's exit code
    (``verdict`` with ``checks_ok``; None: every row must have the same losses as its
    plain run)."""
    if args.json:
        print(json.dumps({"config": {k: getattr(args, k) for k in sizes}, "results": rows,
                          "targets": [{"target": n, "value": v, "limit": lim,
                                       "met": meets(v, lim)} for n, v, lim in found]}, indent=2))
    else:
        print_table(rows, found, args)
    if checks_ok is None:
        checks_ok = all(r["same_loss"] for r in rows)
    return verdict(found, args, checks_ok)


def meets(value, limit) -> bool:
    """Whether a measured ``value`` is at most its target ``limit``; a None limit
    marks an informational value (always met), a None value never meets a limit."""
    return limit is None or (value is not None and value <= limit)


def verdict(targets, args, checks_ok=True) -> int:
    """The exit code of a benchmark: with ``args.check``, print one PASS/FAIL line per
    stated target, each ``(name, measured value, limit)`` (limit None: informational,
    not judged), to stderr under ``args.json``, and return 1 when a target is missed
    or ``checks_ok`` (the benchmark's other checks) is false; without it, 0."""
    if not args.check:
        return 0
    missed = 0
    for name, value, limit in targets:
        if limit is None:
            continue
        met = meets(value, limit)
        missed += not met
        shown = "n/a" if value is None else f"{value:.4g}"
        print(f"{'PASS' if met else 'FAIL'}  {name}: measured {shown}, target <= {limit:g}",
              file=sys.stderr if args.json else sys.stdout)
    return 1 if missed or not checks_ok else 0


def cell(value, fmt) -> str:
    """A table cell: n/a for a missing value, yes/no for a flag, else ``fmt``."""
    if value is None:
        return "n/a"
    return ("yes" if value else "no") if isinstance(value, bool) else format(value, fmt)


def ratio(a, b):
    """``a / b``, or None when either is missing."""
    return None if a is None or b is None else a / b


def run_configuration(script, label, name, args, sizes, keys):
    """Run configuration ``name`` of benchmark ``script`` in a fresh process
    (``script --worker name`` with every size of ``sizes`` from ``args``, given
    ``args.timeout`` seconds, progress on stderr under ``label``): the JSON
    dict its last output line holds, or, on failure, ``keys`` set to None and
    the error under "error"."""
    flags = [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in sizes]
    print(f"{label}: {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, os.path.abspath(script), "--worker", name,
                               *flags], capture_output=True, text=True, timeout=args.timeout)
        failure = None if done.returncode == 0 else (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        failure = f"timed out after {args.timeout} s"
    print(f"{label}: {name} {'failed' if failure else 'done'} in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if failure:
        print(failure, file=sys.stderr)
        return {**dict.fromkeys(keys), "error": failure}
    return json.loads(done.stdout.strip().splitlines()[-1])
