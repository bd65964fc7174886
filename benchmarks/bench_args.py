"""The command line every benchmark shares: --json, --check, --quick and sizes
(no TensorFlow import).

``sizes`` maps a size name to (full default, --quick default, help text); the
flag is ``--name`` (underscores become dashes).
"""
import argparse

__all__ = ["parse_sizes"]


def parse_sizes(description, sizes, argv, check_help, quick_help="tiny sizes (smoke test)"):
    """(parser, args) with every size resolved from --quick when not given."""
    p = argparse.ArgumentParser(description=description)
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
