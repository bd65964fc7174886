"""Mixed precision (``memory.mixed_precision``; Micikevicius et al. 2018):
TensorFlow's own graph rewrite, grappler's auto mixed precision, computes the
ops it knows to be safe (MatMul, convolutions, ...) in 16 bits and leaves the
rest, the variables included, in float32: master weights are float32 and
checkpoints keep their names and dtypes.

* ``"fp16"`` on GPUs: ``auto_mixed_precision``, with dynamic loss scaling,
  which keeps small gradients from vanishing (``hooks.loss_scaling``). CPUs
  have no fp16 kernels; TensorFlow's emulation of the GPU rewrite on them
  (``auto_mixed_precision_cpu``, casts only) aborts the process on common
  graphs (``tf.compat.v1.losses``' cross-entropy): refused.
* ``"bf16"`` on CPUs whose oneDNN kernels compute in bf16 (AVX-512 and later):
  ``auto_mixed_precision_onednn_bfloat16``; bf16 has float32's range, so no
  loss scaling. TensorFlow 2.15 has no bf16 rewrite for GPUs.

A session of a graph whose tasks are function calls optimizes each call's
body when it is instantiated: the calls get the same option
(``rewriters.task_functions``). tf.functions called from eager code run with
the eager context's options: ``wh.init`` turns it on there too.
"""
import functools
from typing import Any, Dict, Optional

import numpy as np
from tfpar.compat.tf import context
from tfpar.errors import PlanError
from tfpar.ir.plan import pinned_plan

__all__ = ["applied", "applied_option", "check_supported", "in_functions",
           "onednn_computes_bf16", "restore_functions", "rewrite_option"]

_OPTIONS = {("fp16", "GPU"): "auto_mixed_precision",
            ("bf16", "CPU"): "auto_mixed_precision_onednn_bfloat16"}
_LOW = {"GPU": "fp16", "CPU": "bf16"}


def applied(config: Any, device_type: str) -> Optional[str]:
    """The 16-bit type the graphs compute in: ``memory.mixed_precision``, else
    the device type's (GPUs fp16, CPUs bf16) when the pinned plan (``plan``,
    as the planning pass pins it before the script builds its graph) uses
    mixed precision; None for float32."""
    chosen = config.get("memory.mixed_precision")
    if chosen:
        return chosen
    pinned = pinned_plan(config)
    estimate = pinned.estimate if pinned is not None else {}
    return _LOW.get(device_type) if "mixed_precision" in estimate.get(
        "memory_techniques", []) else None


def applied_option(config: Any, device_type: str) -> Optional[str]:
    """The grappler option the graphs of ``device_type`` devices compute in
    (``rewrite_option`` of what is ``applied``), or None for float32."""
    return rewrite_option(applied(config, device_type), device_type)


def rewrite_option(precision: Optional[str], device_type: str) -> Optional[str]:
    """The grappler option (a ``RewriterConfig`` field) that computes in
    ``precision`` on ``device_type`` devices, or None for float32."""
    return _OPTIONS.get((precision, device_type)) if precision else None


def check_supported(precision: Optional[str], device_type: str) -> None:
    """Raise PlanError if TensorFlow cannot compute in ``precision`` on
    ``device_type`` devices here."""
    if not precision:
        return
    if rewrite_option(precision, device_type) is None:
        raise PlanError(f"tfpar: memory.mixed_precision {precision!r} on {device_type}s: " + (
            "TensorFlow 2.15 rewrites graphs to bf16 for oneDNN CPUs only; use 'fp16' on GPUs"
            if precision == "bf16" else
            "CPUs have no fp16 kernels, and TensorFlow 2.15's emulation of the GPU rewrite on "
            "them (auto_mixed_precision_cpu) aborts the process on common graphs; use 'bf16'"))
    if precision == "bf16" and not onednn_computes_bf16():
        raise PlanError("tfpar: memory.mixed_precision 'bf16': TensorFlow's oneDNN kernels "
                        "do not compute in bf16 on this CPU (they need AVX-512 and "
                        "TF_ENABLE_ONEDNN_OPTS not 0), so its rewrite would leave the graph "
                        "in float32; train without mixed precision here, or with 'fp16' on "
                        "GPUs")


# Options turned on in the eager context -> their value before (None: unset).
_before: Dict[str, Any] = {}


def in_functions(option: str) -> None:
    """Turn grappler's ``option`` on for tf.functions (the eager context's)."""
    ctx = context.context()
    _before.setdefault(option, ctx.get_optimizer_experimental_options().get(option))
    ctx.set_optimizer_experimental_options({option: True})


def restore_functions() -> None:
    """Undo ``in_functions``."""
    context.context().set_optimizer_experimental_options(dict(_before))
    _before.clear()


@functools.lru_cache(maxsize=None)
def onednn_computes_bf16() -> bool:
    """Whether grappler's bf16 rewrite changes a MatMul here: run one in a
    graph of its own and look for the cast it inserts (TensorFlow decides by
    the CPU's features and its oneDNN build, and says nothing if it declines)."""
    # pylint: disable=import-outside-toplevel
    from tfpar.compat.tf import config_pb2, rewriter_config_pb2
    from tfpar.compat.tf import tf_session as session
    from tfpar.compat.tf import dtypes, ops
    from tfpar.compat.tf import array_ops, math_ops, nn_ops

    graph = ops.Graph()
    with graph.as_default():
        x = array_ops.placeholder(dtypes.float32, [4, 4])
        y = math_ops.matmul(nn_ops.relu(math_ops.matmul(x, x)), x)
    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.auto_mixed_precision_onednn_bfloat16 = \
        rewriter_config_pb2.RewriterConfig.ON
    metadata = config_pb2.RunMetadata()
    with session.Session(graph=graph, config=config) as sess:
        sess.run(y, {x: np.ones((4, 4), np.float32)}, run_metadata=metadata,
                 options=config_pb2.RunOptions(trace_level=config_pb2.RunOptions.FULL_TRACE))
    return any("CastToBf16" in node.node_name for dev in metadata.step_stats.dev_stats
               for node in dev.node_stats)
