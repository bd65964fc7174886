"""``tfpar plan --model``: the plan of a common architecture on a described
cluster, without a script.

The model's training graph is built by ``tfpar.models`` (the builders the
benchmarks measure) in a fresh graph and planned as a script's would be under
``auto.auto_parallel`` with the cluster described by ``cluster.hardware``
("1024 x A100-80GB"): logical device names stand in for the described
devices, none of which has to exist, and no step runs.
"""
import argparse
import os
import time
import warnings

from tfpar.cluster.hardware import CATALOG, NODE_SIZES, expand
from tfpar.config import Config
from tfpar.config_rules import parse_json, read_json_file
from tfpar.errors import ConfigError
from tfpar.models import MODELS, builder

__all__ = ["add_arguments", "model_plan"]

# What the command lets the search use unless --config says otherwise.
DEFAULTS = {"auto.auto_parallel": True, "auto.planning_pass": False, "auto.split_heads": True,
            "auto.memory_techniques": ["recompute", "zero", "mixed_precision"]}
SHAPE = ("layers", "hidden", "heads", "seq", "vocab", "batch")


def _positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tfpar plan --model`` on ``tfpar plan``'s parser."""
    group = parser.add_argument_group(
        "a described model (instead of SCRIPT)",
        "plan a GPT, Llama or BERT of this shape on the --cluster described, without a script")
    group.add_argument("--model", choices=sorted(MODELS), help="the architecture")
    for name, text in (("layers", "transformer blocks"), ("hidden", "hidden size"),
                       ("heads", "attention heads"), ("seq", "sequence length in tokens"),
                       ("vocab", "vocabulary size"), ("batch", "global batch in sequences")):
        group.add_argument(f"--{name}", type=_positive, help=f"{text} (required with --model)")
    group.add_argument("--ffn", type=_positive,
                       help="MLP width (default: 4 x hidden; llama: 2/3 of that, rounded up to "
                            "a multiple of 256)")
    group.add_argument("--kv-heads", type=_positive,
                       help="llama: key/value heads, each shared by heads / kv-heads query "
                            "heads (grouped-query attention; default: --heads)")
    group.add_argument("--fused-qkv", action="store_true",
                       help="one projection makes q, k and v (default: three)")
    group.add_argument("--tied-embeddings", action="store_true",
                       help="the output projection is the token embedding (default: its own)")
    group.add_argument("--mask", choices=("shared", "per_layer"),
                       help="gpt: a causal mask built once and read by every layer, or built "
                            "in each layer (default: none)")
    group.add_argument("--cluster", metavar="'N x DEVICE'",
                       help="the devices to plan for: N of a catalog device ("
                            + ", ".join(CATALOG) + "), or several such entries separated by "
                            "commas (required with --model)")
    group.add_argument("--devices-per-node", type=_positive,
                       help="devices a node holds (default: 8 for "
                            + ", ".join(NODE_SIZES) + "; needed for more than 8 of another)")


def _cluster(args):
    """(device count, cluster.hardware entries) of ``--cluster``."""
    entries = [e.strip() for e in args.cluster.split(",") if e.strip()]
    devices = expand(entries)
    unknown = sorted({d for d in devices if d not in CATALOG})
    if unknown:
        raise ConfigError(f"--cluster: unknown device {', '.join(map(repr, unknown))}; "
                          f"write 'N x DEVICE' with a DEVICE of {', '.join(CATALOG)}")
    if not devices:
        raise ConfigError("--cluster: no device described; write 'N x DEVICE' with N >= 1")
    return len(devices), entries


def _node(args, devices: list) -> dict:
    """``cluster.devices_per_node``: --devices-per-node, else the node size
    of the devices' kind when there are more than one node's worth."""
    if args.devices_per_node:
        return {"cluster.devices_per_node": args.devices_per_node}
    sizes = {NODE_SIZES.get(d) for d in devices}
    node = sizes.pop() if len(sizes) == 1 else None
    if node is not None and len(devices) > node:
        return {"cluster.devices_per_node": node}
    if node is None and len(devices) > 8:
        raise ConfigError(f"--cluster: {len(devices)} devices, and tfpar knows no node size of "
                          f"{', '.join(sorted(set(devices)))}: give --devices-per-node")
    return {}


def _config(args, count: int, entries: list) -> Config:
    """The config the model is planned under: the command's defaults, the
    cluster, then --config's keys over them."""
    given = {}
    if args.config:
        given = (parse_json(args.config, "--config") if args.config.strip().startswith("{")
                 else read_json_file(args.config))
    cluster = {"cluster.num_devices": count, "cluster.hardware": entries,
               **_node(args, expand(entries))}
    return Config.load({**DEFAULTS, **cluster}).replace(given)


def _shape(args) -> dict:
    """The builder's arguments, checked."""
    missing = [f"--{n}" for n in SHAPE if getattr(args, n) is None] + (
        [] if args.cluster else ["--cluster"])
    if missing:
        raise ConfigError(f"--model {args.model} needs {', '.join(missing)}")
    if args.hidden % args.heads:
        raise ConfigError(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    shape = {n: getattr(args, n) for n in SHAPE}
    shape.update(fused_qkv=args.fused_qkv, tied_embeddings=args.tied_embeddings)
    if args.mask is not None and args.model != "gpt":
        raise ConfigError(f"--mask: only --model gpt builds a causal mask, not --model "
                          f"{args.model}")
    if args.model == "gpt":
        shape.update(mask=args.mask)
    if args.model != "llama":
        if args.kv_heads is not None:
            raise ConfigError(f"--kv-heads: only --model llama has grouped-query attention, "
                              f"not --model {args.model}")
        return dict(shape, ffn=args.ffn)
    from tfpar.models.llama import default_ffn  # pylint: disable=import-outside-toplevel
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        raise ConfigError(f"--kv-heads {kv_heads} does not divide --heads {args.heads}")
    if (args.hidden // args.heads) % 2:
        raise ConfigError(f"--model llama: a head's width, --hidden / --heads = "
                          f"{args.hidden // args.heads}, must be even (rotary embeddings)")
    return dict(shape, ffn=args.ffn or default_ffn(args.hidden), kv_heads=kv_heads)


def model_plan(args):
    """The plan of ``args.model`` on ``args.cluster`` (``ConfigError`` naming
    the option at fault when the arguments do not describe one)."""
    shape = _shape(args)
    count, entries = _cluster(args)
    config = _config(args, count, entries)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfpar import api  # pylint: disable=import-outside-toplevel
    from tfpar.hooks.capture import existing_capture  # pylint: disable=import-outside-toplevel
    from tfpar.runtime import context, planning  # pylint: disable=import-outside-toplevel
    from tfpar.runtime.progress import progress  # pylint: disable=import-outside-toplevel
    tf.config.set_visible_devices([], "GPU")  # this host's GPUs are not the ones described
    graph = tf.Graph()
    try:
        with graph.as_default():
            api.init(config)
            described = ", ".join(k if v is True else f"{k} {v}" for k, v in shape.items()
                                  if v not in (None, False))
            progress(f"tfpar plan: building {args.model} ({described}) ...")
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", r"`tf.layers.dense` is deprecated")
                builder(args.model)(**shape)
            progress(f"tfpar plan: built {len(graph.get_operations())} ops in "
                     f"{time.perf_counter() - start:.1f} s; planning for {args.cluster} ...")
            return planning.plan_for(graph, existing_capture(graph), context.active())
    finally:
        api.reset()
