"""The config schema: every key's type, default, allowed values and meaning
(``SCHEMA``), the Whale paper's flat aliases, and ``describe``, the table
``tfpar config`` prints."""

__all__ = ["ACCEPTS", "ALIASES", "Option", "SCHEMA", "SECTIONS", "describe"]

import textwrap
from collections.abc import Mapping
from typing import Any, NamedTuple

from .cluster.hardware import HOST_CPU, OPTIONAL_KEYS

ACCEPTS = {  # type name -> accepts(value)
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, (list, tuple)),
    "dict": lambda v: isinstance(v, Mapping),
    "None": lambda v: v is None,
}


class Option(NamedTuple):
    """Schema entry of one config key."""

    type: str  # alternatives joined by "|": int, float, bool, str, list, dict, None
    default: Any
    rule: tuple  # (text, predicate) applied to non-None values; () for none
    help: str


def _at_least(low):
    return (f">= {low}", lambda v: v >= low)


def _one_of(*choices, note=""):
    return ("one of " + ", ".join(map(repr, choices)) + note, lambda v: v in choices)


def _is_device(d):
    if isinstance(d, str):
        return bool(d)
    required = {"name", "tflops", "memory_gb"}
    return (isinstance(d, Mapping) and required <= set(d) <= required | set(OPTIONAL_KEYS)
            and isinstance(d["name"], str)
            and all(ACCEPTS["float"](d[k]) and d[k] > 0 for k in set(d) - {"name"})
            and d.get("efficiency", 1) <= 1)


_POSITIVE = ("> 0", lambda v: v > 0)
_HARDWARE = ("a catalog name, or a non-empty list of catalog names ('N x name' for N alike) "
             "or {name, tflops, memory_gb[, intra_node_gbps, inter_node_gbps, tflops_fp64, "
             "tflops_fp32, tflops_tf32, tflops_fp16, tflops_bf16, memory_gbps, efficiency <= 1]} "
             "dicts, or the path of a JSON file holding one such dict (measure.calibrate writes one)",
             lambda v: _is_device(v) if isinstance(v, str)
             else bool(v) and all(_is_device(d) for d in v))
_GROUP_SIZE = (">= 1 or 'auto'", lambda v: v == "auto" or isinstance(v, int) and v >= 1)

SCHEMA = {
    "cluster.num_devices": Option("int|None", None, _at_least(1),
                                  "devices on this host; None: all GPUs, else 1"),
    "cluster.hardware": Option("list|str|None", None, _HARDWARE,
                               "per-device specs; None: not described, so the planner "
                               "assumes every device is a generic host CPU "
                               f"({HOST_CPU.memory_gb:g} GB; on CPU devices at this host's "
                               "measured float32 matmul throughput, else "
                               f"{HOST_CPU.tflops:g} TFLOPS; nothing is detected, GPUs "
                               "included) and balances none"),
    "cluster.devices_per_node": Option("int|None", None, _at_least(1),
                                       "devices per node of cluster.hardware (collectives "
                                       "beyond a node use its inter-node bandwidth); None: "
                                       "TF_CONFIG's devices per worker, else 8 for more than "
                                       "8 V100-32GB, A100-80GB or H100-80GB (a fallback), "
                                       "else one node"),
    "cluster.colocate_split_and_replicate": Option("bool", False, (),
                                                   "let TaskGraphs share devices"),
    "cluster.trusted_network": Option(
        "bool", False, (), "the network of this TF_CONFIG cluster admits only its workers to "
        "their ports (a private network, a firewall): their gRPC servers, open to whoever "
        "connects, are then not said to be (see Security)"),
    "pipeline.num_micro_batch": Option("int", 1, _at_least(1),
                                       "micro-batches per step (1 with auto.auto_parallel and "
                                       "a known batch: the planner chooses)"),
    "pipeline.schedule": Option(
        "str", "auto", _one_of("gpipe", "1f1b", "kfkb", "zero_bubble", "auto"),
        "pipeline schedule; auto: the planner's choice with auto.auto_parallel, else 1f1b"),
    "pipeline.task_functions": Option(
        "bool", True, (), "run each micro-batch's stage tasks as calls of one graph function "
        "per task (off: a copy of the stage per micro-batch)"),
    "pipeline.group_size": Option("int|str", 1, _GROUP_SIZE, "k of kFkB, or 'auto' (Ada-Grouper)"),
    "pipeline.virtual_stages": Option(
        "int", 1, _at_least(1), "stages per device group (Narayanan et al. SC'21 §2.2): the "
        "TaskGraphs are dealt round-robin, group g running stages g, g + G, ..., in the "
        "interleaved 1F1B order"),
    "pipeline.retune_steps": Option(
        "int", 100, ("0 or >= 2", lambda v: v == 0 or v >= 2), "with group_size 'auto', "
        "every this many Session.run training steps one is profiled and k moves to the best "
        "for the measured stage and transfer times (Ada-Grouper's online tuning); 0: k stays "
        "as planned"),
    "pipeline.retune_tolerance": Option(
        "float", 0.05, _at_least(0), "online tuning keeps the smallest k whose predicted step "
        "is at most this fraction longer than the shortest (fewer activations alive)"),
    "split.patterns": Option("dict|None", None, (),
                             "ShardingUnit name -> sharding pattern the matcher must use"),
    "split.sequence_parallel": Option(
        "bool", False, (), "sequence parallelism (Korthikanti et al. 2022, §4.2.2): the "
        "[batch, sequence, ...] output of a row split layer is summed by a reduce scatter "
        "along the sequence, the residual adds, LayerNormalization and Dropout after it run "
        "on each device's sequence slice, and the next column split layer gathers it: their "
        "activations are divided by the split's device count, the communication is the same"),
    "auto.auto_parallel": Option("bool", False, (), "let the planner choose TaskGraphs"),
    "auto.num_task_graph": Option("int|None", None, _at_least(1),
                                  "stage count for auto pipeline (device groups when the "
                                  "search interleaves V stages on each); None: planner "
                                  "decides"),
    "auto.opt_level": Option("str", "O2", _one_of("O2", "O3"),
                             "O2: segmented search, O3: whole-graph ILP"),
    "auto.global_batch": Option("int|None", None, _at_least(1),
                                "global batch the planner's cost model assumes; None: the "
                                "static batch of the model's inputs, else 32"),
    "auto.search_time_limit_s": Option("float", 60.0, _POSITIVE, "planner search time limit"),
    "auto.memory_techniques": Option(
        "list", [], ("a list of 'recompute', 'zero', 'mixed_precision', 'offload', "
                     "'sequence_parallel'", lambda v: set(v) <= {
                         "recompute", "zero", "mixed_precision", "offload", "sequence_parallel"}),
        "memory techniques the planner may choose (sequence_parallel: for split meshes, when "
        "it makes the step faster or makes it fit)"),
    "auto.split_heads": Option("bool", False, (),
                               "tensor groups may split attention cores of raw ops by heads "
                               "(Megatron's attention; keras MultiHeadAttention's are without "
                               "it), where the group's devices divide the heads"),
    "auto.planning_pass": Option("bool", True, (),
                                 "a script with auto_parallel plans in a child run first, "
                                 "so sharded layers are built split"),
    "memory.recompute": Option(
        "list", [], ("a list of name scopes", lambda v: all(isinstance(s, str) and s for s in v)),
        "name scopes whose forward the backward recomputes from their inputs instead of "
        "keeping their activations"),
    "memory.offload_optimizer": Option(
        "bool", False, (), "the optimizer's slots, the weights they update and the update "
        "run on the host CPU; the step reads the weights from there (pipelines, or replicas "
        "on the CPUs of one process: not with mirrored variables)"),
    "memory.zero": Option(
        "int", 0, ("0, 1 or 2", lambda v: v in (0, 1, 2)),
        "ZeRO stage over mirrored replicas: 1, each variable's optimizer slots and update "
        "live on one replica, which sends the new value to the others; 2, its gradient is "
        "also summed there only"),
    "memory.mixed_precision": Option(
        "str|None", None, _one_of("fp16", "bf16"),
        "compute what TensorFlow's auto mixed precision allows in 16 bits, variables and "
        "checkpoints in float32: fp16 (GPUs) with dynamic loss scaling, bf16 (oneDNN CPUs "
        "with AVX-512)"),
    "balance.hardware_aware": Option("bool", True, (),
                                     "on mixed cluster.hardware: batch rows, split shards and "
                                     "stage cuts by device speed (Whale §3.3.1, Algorithm 1), "
                                     "stages on devices by memory, most first (§3.3.2); false: "
                                     "even, in device order"),
    "batch_norm.sync": Option(
        "bool", False, (), "every Keras BatchNormalization layer computes its batch statistics "
        "over the rows of all replicas (as synchronized=True layers do): one device's numbers "
        "with one micro-batch"),
    "communication.backend": Option(
        "str", "auto", _one_of("auto", "collective", "horovod"),
        "auto: one-process CPUs share variables and sum on one device; else collective"),
    "communication.fusion_mb": Option("float", 64.0, _POSITIVE, "gradient fusion bucket (MB)"),
    "communication.timeout_s": Option("float", 60.0, _POSITIVE, "collective timeout"),
    "io.shard_dataset": Option("bool", False, (), "shard input datasets across replicas"),
    "check.finite_gradients": Option(
        "bool", False, (), "every replica's and micro-batch's gradients are checked before they "
        "are summed: a NaN or Inf fails the step naming the variable, the step, the replica, "
        "TaskGraph / stage, micro-batch and device"),
    "measure.after_steps": Option(
        "int", 3, _at_least(0), "after this training step (counted from 1) the cost model is "
        "set against the steps traced (the last 5 up to it, not the first unless it is 1): per "
        "TaskGraph, predicted and measured (the shortest) compute time and peak memory, printed, kept in the plan (plan.measured) and warned about when off by more "
        "than measure.tolerance; 0: never"),
    "measure.tolerance": Option(
        "float", 0.5, _POSITIVE, "measured / predicted between 1 / (1 + this) and 1 + this "
        "is within tolerance"),
    "measure.calibrate": Option(
        "str|None", None, (), "write to this JSON file the device entry (cluster.hardware) "
        "whose efficiency makes the prediction of the measured step equal its measurement; "
        "give the file as cluster.hardware to plan with it"),
    "plan": Option("dict|None", None, (), "plan JSON (dict or text) that pins the plan"),
    "report": Option("str|None", None, (), "write the plan report (one HTML file: devices, "
                     "layers, schedule with the traced step, memory, searched candidates, "
                     "notes) to this path after the first training step"),
    "strict": Option("bool", False, (), "every fallback (tfpar running something other than "
                     "what was asked, a tfpar.FallbackWarning) raises PlanError instead"),
}

ALIASES = {  # Whale paper flat names
    "num_micro_batch": "pipeline.num_micro_batch",
    "num_task_graph": "auto.num_task_graph",
    "auto_parallel": "auto.auto_parallel",
}

SECTIONS = tuple(dict.fromkeys(k.split(".")[0] for k in SCHEMA if "." in k))


def describe(width: int = 100) -> str:
    """Every config key: key, type and default on one line, then its meaning and
    allowed values indented below, wrapped to ``width`` columns."""
    key_width = max(map(len, SCHEMA))
    type_width = max(len(o.type) for o in SCHEMA.values())
    lines = [f"{'key':<{key_width}}  {'type':<{type_width}}  default",
             f"{'-' * key_width}  {'-' * type_width}  -------"]
    for key, opt in SCHEMA.items():
        lines.append(f"{key:<{key_width}}  {opt.type:<{type_width}}  {opt.default!r}")
        for text in (opt.help, f"allowed: {opt.rule[0]}" if opt.rule else ""):
            lines += textwrap.wrap(text, width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)
