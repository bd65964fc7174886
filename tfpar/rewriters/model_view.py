"""The planner's view of a captured graph (read only): the forward ops the
losses depend on, with FLOPs, output bytes, input bytes and memory traffic
(bytes read and written: none for a view or a shape read) per sample, the
bytes of the weights each reads, edges and repeated blocks, the batch the
inputs declare and the dtype of the FLOPs (``auto.ModelView``).

Sizes are per sample of the global batch, found by propagating from the
model's inputs rather than read off static shapes, which say nothing about
merged dimensions: a ``[batch * seq, d]`` reshape of ``[batch, seq, d]`` still
holds ``seq * d`` elements per sample, and a dense layer on it
(``[None, None]`` statically) multiplies them by ``units / depth``. Tensors
that do not depend on the inputs (weights, constants, shapes of weights) hold
nothing per sample, and neither do scalars (a batch mean is one value).
"""
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from tensorflow.python.framework import config, dtypes, ops, tensor_shape, tensor_util
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import handle_data_util

from tfpar.hooks.capture import GraphCapture
from tfpar.ir.taskgraph import Phase
from tfpar.planner.auto import ModelView
from tfpar.planner.pruning import block_labels
from tfpar.rewriters.select import GraphIndex, ancestors, is_input, is_variable

__all__ = ["model_view"]

CONTRACTIONS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
SAME_ELEMENTS = frozenset({"Reshape", "Squeeze", "ExpandDims", "Transpose", "Identity"})
# Ops whose output is their input's buffer (TensorFlow forwards it): they
# allocate nothing. A Transpose does when its permutation is the identity
# (tensordot's, on a dense layer over [batch, sequence, features]).
VIEWS = frozenset({"Reshape", "Squeeze", "ExpandDims", "Identity"})
# Ops that read only their input's shape, not its elements.
SHAPE_READS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
# Elementwise ops and the row reductions of softmax and layer norms: a chain
# of them runs as one kernel (XLA's fusion; Megatron-LM's fused bias-GeLU,
# scale-mask-softmax and layer norm), its intermediate tensors never written.
FUSIBLE = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "Gelu", "Tanh", "Sigmoid", "Softplus", "Cast", "Neg",
    "Square", "Sqrt", "Rsqrt", "Exp", "Log", "Erf", "Pow", "Mul", "AddV2", "Add", "Sub",
    "RealDiv", "Maximum", "Minimum", "BiasAdd", "SquaredDifference", "Select", "SelectV2",
    "StopGradient", "Softmax", "Mean", "Sum"})
_DTYPES = {dtypes.float64: "fp64", dtypes.float32: "fp32", dtypes.float16: "fp16",
           dtypes.bfloat16: "bf16"}


def model_view(index: GraphIndex, capture: GraphCapture) -> Tuple[List[ops.Operation], ModelView]:
    """The forward ops (graph order, a topological one) and their view."""
    losses = [y.op for call in capture.gradient_calls for y in call.ys if hasattr(y, "op")]
    needed = ancestors(losses, lambda op: is_variable(op) or is_input(op))
    order = [op for op in index.ops
             if op in needed and capture.op_phase.get(op.name, Phase.FORWARD) == Phase.FORWARD]
    samples = _per_sample(order)
    position = {op: i for i, op in enumerate(order)}
    names, types = [op.name for op in order], [op.type for op in order]

    def size(t) -> float:
        # A scalar is one value for the whole batch, not one per sample (the
        # elements a full reduction reads stay its FLOPs, not its output bytes).
        if t.shape.rank == 0:
            return 0.0
        return samples.get(t, 0.0) * t.dtype.size

    flops = [_flops(op, samples) for op in order]
    edges = [(position[t.op], j, size(t)) for j, op in enumerate(order) for t in op.inputs
             if t.op in position]
    return order, ModelView(
        flops=flops,
        activation_bytes=[size(op.outputs[0]) if op.outputs and not _is_view(op) else 0.0
                          for op in order],
        param_bytes=_weight_bytes(order),
        edges=edges, labels=block_labels(names, types), names=names, types=types,
        input_bytes=[sum(size(t) for t in op.inputs if is_input(t.op))
                     for op in order],
        batch=_declared_batch(order, capture), compute_dtype=_compute_dtype(order, flops),
        traffic_bytes=_traffic(order, edges, size))


def _declared_batch(order: List[ops.Operation], capture: GraphCapture) -> Optional[int]:
    """The batch the model's inputs declare: dimension 0 of their static
    shapes, as written (``hooks.batch_shapes`` relaxes it while tfpar is
    active and records it in ``capture.declared_batch``, by placeholder or
    iterator). When they disagree, the size most of them declare (the
    largest of those); None when none declares one."""
    sizes = []
    inputs = {t.name: t for op in order for t in op.inputs if is_input(t.op)}
    for t in inputs.values():
        sources = [t.op] + [s.op for s in t.op.inputs]  # an iterator read: its iterator
        declared = [capture.declared_batch[s.name] for s in sources
                    if s.name in capture.declared_batch]
        if declared:
            sizes.append(declared[0])
        elif t.shape.rank and t.shape[0] is not None:
            sizes.append(t.shape[0])
    return max(sizes, key=lambda size: (sizes.count(size), size)) if sizes else None


def _compute_dtype(order: List[ops.Operation], flops: List[float]) -> str:
    """The dtype (``hardware.DTYPES``) of most FLOPs: float32 is "tf32" when
    TensorFlow runs it as TF32 (the default, on devices that can:
    ``tf.config.experimental.enable_tensor_float_32_execution``)."""
    by_dtype: Dict[str, float] = {}
    for op, count in zip(order, flops):
        if op.outputs and op.outputs[0].dtype in _DTYPES:
            name = _DTYPES[op.outputs[0].dtype]
            by_dtype[name] = by_dtype.get(name, 0.0) + count
    dtype = max(by_dtype, key=by_dtype.get) if any(by_dtype.values()) else "fp32"
    if dtype == "fp32" and config.tensor_float_32_execution_enabled():
        return "tf32"
    return dtype


def _traffic(order: List[ops.Operation], edges: List[Tuple[int, int, float]], size
             ) -> List[float]:
    """Bytes per sample each op reads and writes in device memory: none for
    a view or a shape read; within a chain of ``FUSIBLE`` ops, a tensor only
    the next op of the chain reads is neither written nor read."""
    traffic = [0.0 if _is_view(op) or op.type in SHAPE_READS else
               sum(size(t) for t in list(op.inputs) + list(op.outputs)) for op in order]
    consumers: Dict[int, set] = {}
    for i, j, _ in edges:
        consumers.setdefault(i, set()).add(j)
    for i, j, nbytes in edges:
        if order[i].type in FUSIBLE and order[j].type in FUSIBLE and consumers[i] == {j}:
            traffic[i] -= nbytes
            traffic[j] -= nbytes
    return [max(t, 0.0) for t in traffic]


def _is_view(op: ops.Operation) -> bool:
    """Whether ``op``'s output shares its input's buffer."""
    if op.type == "Transpose":
        perm = tensor_util.constant_value(op.inputs[1])
        return perm is not None and list(perm) == list(range(len(perm)))
    return op.type in VIEWS


def _per_sample(order: List[ops.Operation]) -> Dict[Any, float]:
    """Elements per sample of every tensor the ops read or write."""
    samples: Dict[Any, float] = {}
    for op in order:
        for t in op.inputs:
            if t not in samples:
                samples[t] = (_static(t) or 1.0) if is_input(t.op) else 0.0
        reads = [samples[t] for t in op.inputs]
        base = max(reads, default=0.0)
        main = op.inputs[reads.index(base)] if base else None
        for out in op.outputs:
            samples[out] = base * _ratio(op, main, out) if base else 0.0
    return samples


def _ratio(op: ops.Operation, main, out) -> float:
    """Elements of ``out`` per element of the op's main (largest) input."""
    if op.type in SAME_ELEMENTS:
        return 1.0
    if op.type in CONTRACTIONS and main is op.inputs[0]:
        depth, units = _contraction_sizes(op)
        if depth and units:
            return units / depth
    before, after = _static(main), _static(out)
    return after / before if before and after else 1.0


def _contraction_sizes(op: ops.Operation) -> Tuple[Optional[int], Optional[int]]:
    """(contracted size, output columns) of a matmul from either operand."""
    a, b = op.inputs[0].shape, op.inputs[1].shape
    if a.rank is None or b.rank is None:
        return None, None
    if op.type == "MatMul":
        flip_a, flip_b = op.get_attr("transpose_a"), op.get_attr("transpose_b")
    else:
        flip_a, flip_b = op.get_attr("adj_x"), op.get_attr("adj_y")
    depth = a[-2] if flip_a else a[-1]
    if depth is None:
        depth = b[-1] if flip_b else b[-2]
    return depth, b[-2] if flip_b else b[-1]


def _flops(op: ops.Operation, samples) -> float:
    """FLOPs per sample: 2 x multiply-adds of contractions and convolutions,
    output elements otherwise."""
    out = samples.get(op.outputs[0], 0.0) if op.outputs else 0.0
    if op.type in CONTRACTIONS:
        depth, _ = _contraction_sizes(op)
        return 2.0 * out * float(depth or 1)
    if op.type == "Conv2D":
        kernel = op.inputs[1].shape
        depth = kernel.num_elements() / max(int(kernel[-1] or 1), 1) if (
            kernel.is_fully_defined()) else 1.0
        return 2.0 * out * depth
    return out


def _static(t) -> Optional[float]:
    """Elements per row of ``t`` from its static shape (None when unknown)."""
    dims = t.shape.as_list() if t.shape.rank is not None else None
    if not dims or any(d is None for d in dims[1:]):
        return None
    return float(np.prod(dims[1:], dtype=np.int64))


def _weight_bytes(order: List[ops.Operation]) -> List[float]:
    """Bytes of the variables each op reads first."""
    seen = set()
    owned = []
    for op in order:
        total = 0.0
        for t in op.inputs:
            if is_variable(t.op) and t.op not in seen:
                seen.add(t.op)
                shape, dtype = _variable_shape(t)
                total += (shape.num_elements() or 0) * dtype.size
        owned.append(total)
    return owned


def _variable_shape(handle: tensor_lib.Tensor):
    """(shape, dtype) of the variable behind ``handle``: its op's attributes,
    or, captured by a tf.function, the handle's resource data."""
    op = handle.op
    if op.type != "Placeholder":
        return tensor_shape.TensorShape(op.get_attr("shape")), dtypes.as_dtype(op.get_attr("dtype"))
    shape_and_type = handle_data_util.get_resource_handle_data(handle).shape_and_type[0]
    return tensor_shape.TensorShape(shape_and_type.shape), dtypes.as_dtype(shape_and_type.dtype)
