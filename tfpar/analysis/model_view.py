"""The planner's view of a captured graph (read only): the forward ops the
losses depend on, with FLOPs, output bytes, input bytes and memory traffic
(bytes read and written: none for a view or a shape read) per sample, the
bytes of the weights each reads, edges and repeated blocks, the batch the
inputs declare and the dtype of the FLOPs (``planner.model_view.ModelView``).

Sizes are per sample of the global batch, found by propagating from the
model's inputs rather than read off static shapes, which say nothing about
merged dimensions: a ``[batch * seq, d]`` reshape of ``[batch, seq, d]`` still
holds ``seq * d`` elements per sample, and a dense layer on it
(``[None, None]`` statically) multiplies them by ``units / depth``. Tensors
that do not depend on the inputs (weights, constants, shapes of weights) hold
nothing per sample, and neither do scalars (a batch mean is one value) nor
shapes; shape arithmetic and views (no device kernels) cost no FLOPs.
"""
import math
from typing import Dict, List, Optional, Tuple

from tfpar.analysis.graph_index import GraphIndex, ancestors, data_ancestors
from tfpar.analysis.op_kinds import (INPUT_TYPES, VARIABLE_TYPES, gradient_tensors, is_input,
                                     is_variable)
from tfpar.analysis.variables import variable_bytes
from tfpar.compat.tf import config, dtypes, ops, tensor_lib, tensor_util
from tfpar.ir.contractions import CONTRACTIONS, einsum_depth
from tfpar.ir.recorded import Recorded
from tfpar.ir.taskgraph import Phase
from tfpar.planner.memory import SLOTS
from tfpar.planner.model_view import ModelView
from tfpar.planner.pruning import block_labels

__all__ = ["model_view", "optimizer_slots"]

SAME_ELEMENTS = frozenset({"Reshape", "Squeeze", "ExpandDims", "Transpose", "Identity"})
# Ops whose output is their input's buffer (TensorFlow forwards it): they
# allocate nothing. A Transpose does when its permutation is the identity
# (tensordot's, on a dense layer over [batch, sequence, features]).
VIEWS = frozenset({"Reshape", "Squeeze", "ExpandDims", "Identity", "IdentityN"})
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
_ELEMENTWISE = FUSIBLE - {"Softmax", "Mean", "Sum"}
_BOUNDARY_TYPES = VARIABLE_TYPES | INPUT_TYPES
_DTYPES = {dtypes.float64: "fp64", dtypes.float32: "fp32", dtypes.float16: "fp16",
           dtypes.bfloat16: "bf16"}


def model_view(index: GraphIndex, recorded: Recorded) -> Tuple[List[ops.Operation], ModelView]:
    """The forward ops (graph order, a topological one) and their view, with
    what the backward pass reads of them (``ModelView.kept_bytes``). Each op
    and tensor is read from TensorFlow once (the planner reads graphs of tens
    of thousands of ops: its time grows with what it reads)."""
    losses = [y.op for call in recorded.gradient_calls for y in call.ys if hasattr(y, "op")]
    needed = ancestors(losses, _is_boundary)
    phases = recorded.op_phase
    order = [op for op in index.ops
             if op in needed and phases.get(op.name, Phase.FORWARD) == Phase.FORWARD]
    graph = _Read(order)
    nbytes = graph.nbytes
    flops = [_flops(j, op, graph) for j, op in enumerate(order)]
    edges = [(graph.producer[id(t)], j, nbytes[id(t)]) for j, ins in enumerate(graph.inputs)
             for t in ins if id(t) in graph.producer]
    names = [op.name for op in order]
    return order, ModelView(
        flops=flops,
        activation_bytes=[nbytes[id(outs[0])] if outs and not view else 0.0
                          for outs, view in zip(graph.outputs, graph.views)],
        param_bytes=_weight_bytes(graph),
        edges=edges, labels=block_labels(names, graph.types), names=names, types=graph.types,
        input_bytes=[sum(nbytes[id(t)] for t in ins if id(t) in graph.fed)
                     for ins in graph.inputs],
        batch=_declared_batch(graph, recorded), compute_dtype=_compute_dtype(graph, flops),
        traffic_bytes=_traffic(graph, edges),
        kept_bytes=_kept_bytes(index, graph, recorded),
        optimizer_slots=optimizer_slots(recorded), attention_heads=_attention_heads(order),
        core_heads=_core_heads(order))


def _core_heads(order: List[ops.Operation]) -> Tuple[Tuple[str, int], ...]:
    """(name scope, heads) of each batched contraction among ``order`` with
    four or more output axes: its second axis (the fewest of a scope's)."""
    found: dict = {}
    for op in order:
        shape = op.outputs[0].shape if "BatchMatMul" in op.type and op.outputs else None
        if shape is not None and shape.rank is not None and shape.rank >= 4 and shape[1]:
            scope = op.name.rpartition("/")[0]
            found[scope] = min(found.get(scope, int(shape[1])), int(shape[1]))
    return tuple(found.items())


def _attention_heads(order: List[ops.Operation]) -> Tuple[Tuple[str, int], ...]:
    """(name scope, heads) of each keras MultiHeadAttention among ``order``:
    its query projection, an EinsumDense in the layer's ``query`` scope, reads
    a ``[model, heads, width]`` kernel."""
    found = []
    for op in order:
        parts = op.name.split("/")
        if op.type == "Einsum" and "query" in parts[:-1] and len(op.inputs) == 2:
            kernel = op.inputs[1].shape
            if kernel.rank == 3 and kernel[1] is not None:
                scope = "/".join(parts[:len(parts) - 1 - parts[::-1].index("query")])
                found.append((scope, int(kernel[1])))
    return tuple(dict(found).items())


def optimizer_slots(recorded: Recorded) -> float:
    """The optimizers' state per weight as the script's optimizers made it
    (``ApplyCall.slots``), weighted by the weights each updates; Adam's
    (``memory.SLOTS``) when no optimizer said."""
    known = [(call.slots, sum(v.shape.num_elements() for _, v in call.grads_and_vars
                              if v is not None and v.shape.is_fully_defined()))
             for call in recorded.apply_calls if call.slots is not None]
    total = sum(size for _, size in known)
    return sum(s * size for s, size in known) / total if total else SLOTS


def _is_boundary(op: ops.Operation) -> bool:
    """Where the walk back from the losses stops: variables and inputs."""
    return op.type in _BOUNDARY_TYPES and (is_variable(op) or is_input(op))


class _Read:
    """The ops' inputs, outputs and types, and per tensor (by ``id``: the
    graph keeps each tensor object): the op of ``order`` producing it, the
    model's inputs (``fed``) and variables among the others, its elements
    per sample and its bytes per sample (0 for a scalar, one value for the
    whole batch, and for a shape: ``shapes``, the ops computing them)."""

    def __init__(self, order: List[ops.Operation]):
        self.types = [op.type for op in order]
        self.inputs = [tuple(op.inputs) for op in order]
        self.outputs = [op.outputs for op in order]
        self.producer = {id(t): j for j, outs in enumerate(self.outputs) for t in outs}
        self.fed, self.variables = set(), {}
        for ins in self.inputs:
            for t in ins:
                if id(t) not in self.producer:
                    if is_input(t.op):
                        self.fed.add(id(t))
                    elif is_variable(t.op):
                        self.variables[id(t)] = t
        self._static: Dict[int, Optional[float]] = {}
        self.contraction = {j: _contraction_sizes(op) for j, op in enumerate(order)
                            if op.type in CONTRACTIONS}
        self.views = [_is_view(op) for op in order]
        self.samples = self._per_sample(order)
        self.shapes = self._shape_ops()
        self.nbytes = {id(t): 0.0 for j in self.shapes for t in self.outputs[j]}
        for tensors in (self.inputs, self.outputs):
            for ts in tensors:
                for t in ts:
                    if id(t) not in self.nbytes:
                        count = self.samples.get(id(t), 0.0)
                        self.nbytes[id(t)] = (count * t.dtype.size
                                              if count and t.shape.rank != 0 else 0.0)

    def static(self, t) -> Optional[float]:
        """Elements per row of ``t`` from its static shape (None when unknown)."""
        key = id(t)
        if key not in self._static:
            dims = t.shape.as_list() if t.shape.rank is not None else None
            self._static[key] = (None if not dims or any(d is None for d in dims[1:])
                                 else float(math.prod(dims[1:])))
        return self._static[key]

    def _per_sample(self, order: List[ops.Operation]) -> Dict[int, float]:
        """Elements per sample of every tensor the ops read or write."""
        samples: Dict[int, float] = {}
        for j, op in enumerate(order):
            reads = []
            for t in self.inputs[j]:
                count = samples.get(id(t))
                if count is None:
                    count = samples[id(t)] = (self.static(t) or 1.0) if id(t) in self.fed else 0.0
                reads.append(count)
            base = max(reads, default=0.0)
            main = self.inputs[j][reads.index(base)] if base else None
            for out in self.outputs[j]:
                samples[id(out)] = base * self._ratio(j, main, out) if base else 0.0
        return samples

    def _shape_ops(self) -> set:
        """The ops computing shapes: shape reads, and integer ops of at most
        one axis reading only shapes and tensors holding nothing per sample
        (tensordot's gathers, products and concatenations of sizes): host
        memory and no gradient in TensorFlow, so no device kernel. Their
        outputs keep ``samples`` for a ``Fill`` or a random draw's shape."""
        shapes = set()
        for j, (ins, outs) in enumerate(zip(self.inputs, self.outputs)):
            if self.types[j] in SHAPE_READS or (ins and outs and all(
                    self.producer.get(id(t)) in shapes or not self.samples.get(id(t))
                    for t in ins) and all(
                    t.dtype.is_integer and t.shape.rank in (0, 1) for t in outs)):
                shapes.add(j)
        return shapes

    def _ratio(self, j: int, main, out) -> float:
        """Elements of ``out`` per element of op j's main (largest) input."""
        if self.types[j] in SAME_ELEMENTS:
            return 1.0
        if j in self.contraction and main is self.inputs[j][0]:
            depth, units = self.contraction[j]
            if depth and units:
                return units / depth
        before, after = self.static(main), self.static(out)
        return after / before if before and after else 1.0


def _kept_bytes(index: GraphIndex, graph: _Read, recorded: Recorded) -> List[float]:
    """Bytes per sample of each op's outputs that stay allocated from the
    forward pass until the backward pass reads them (directly or through
    views). TensorFlow runs an op as soon as its inputs exist, so a backward
    op that reads forward tensors only (a shape read, GeLU's ``exp(-x^2)``)
    runs during the forward pass and keeps nothing: a forward tensor is kept
    when a backward op reading it also waits for a later op (the gradient
    coming back). Only backward ops the gradients depend on by data count
    (Grappler prunes the rest: a constant's gradient, such as a division by
    sqrt(d)'s). An op waits for its control inputs too (silu's gradient
    computes ``sigmoid(beta x)`` once the gradient arrives); what an early
    op keeps counts with the last forward op it waits for that is not a
    constant (silu's ``beta x``: with ``x``, not with ``beta``, which the
    script created after it)."""
    phases, producer = recorded.op_phase, graph.producer
    live = data_ancestors((t.op for call in recorded.gradient_calls for g in call.grads
                           if g is not None for t in gradient_tensors(g)),
                          lambda op: phases.get(op.name) == Phase.BACKWARD)
    # Per backward op: the last forward op it waits for, and its output's
    # bytes per sample (an element-wise op's: its largest input's; others
    # are not counted).
    ready: Dict[ops.Operation, int] = {}
    size: Dict[ops.Operation, float] = {}
    home: Dict[ops.Operation, int] = {}  # the last forward op it waits for, constants aside
    read: Dict[int, int] = {}  # kept forward tensor -> the op of order allocating it
    early = set()  # backward ops run during the forward pass whose outputs are kept
    for op in (op for op in index.ops if op in live):
        inputs = op.inputs
        forward = [producer[id(t)] for t in inputs if id(t) in producer]
        backward = [t.op for t in inputs if id(t) not in producer] + list(op.control_inputs)
        ready[op] = last = max(forward + [ready.get(b, -1) for b in backward], default=-1)
        home[op] = max([j for j in forward if graph.types[j] != "Const"]
                       + [home.get(b, -1) for b in backward], default=-1)
        size[op] = max((graph.nbytes[id(t)] if id(t) in producer else size.get(t.op, 0.0)
                        for t in inputs), default=0.0) if op.type in _ELEMENTWISE else 0.0
        for t in inputs:
            j = producer.get(id(t))
            if j is None:
                if 0 <= ready.get(t.op, last) < last:
                    early.add(t.op)
            elif j < last:
                while graph.views[j] and graph.inputs[j] and id(graph.inputs[j][0]) in producer:
                    t = graph.inputs[j][0]
                    j = producer[id(t)]
                if not graph.views[j]:  # else a view of a fed input: the feed holds it
                    read[id(t)] = j
    kept = [0.0] * len(graph.types)
    for key, j in read.items():
        kept[j] += graph.nbytes[key]
    for op in early:  # counted with the forward op it follows
        kept[max(home[op], 0)] += size[op]
    return kept


def _declared_batch(graph: _Read, recorded: Recorded) -> Optional[int]:
    """The batch the model's inputs declare: dimension 0 of their static
    shapes, as written (``hooks.batch_shapes`` relaxes it while tfpar is
    active and records it in ``Recorded.declared_batch``, by placeholder or
    iterator). When they disagree, the size most of them declare (the
    largest of those); None when none declares one."""
    sizes = []
    inputs = {t.name: t for ins in graph.inputs for t in ins if id(t) in graph.fed}
    for t in inputs.values():
        sources = [t.op] + [s.op for s in t.op.inputs]  # an iterator read: its iterator
        declared = [recorded.declared_batch[s.name] for s in sources
                    if s.name in recorded.declared_batch]
        if declared:
            sizes.append(declared[0])
        elif t.shape.rank and t.shape[0] is not None:
            sizes.append(t.shape[0])
    return max(sizes, key=lambda size: (sizes.count(size), size)) if sizes else None


def _compute_dtype(graph: _Read, flops: List[float]) -> str:
    """The dtype (``hardware.DTYPES``) of most FLOPs: float32 is "tf32" when
    TensorFlow runs it as TF32 (the default, on devices that can:
    ``tf.config.experimental.enable_tensor_float_32_execution``)."""
    by_dtype: Dict[str, float] = {}
    for outs, count in zip(graph.outputs, flops):
        if count and outs and outs[0].dtype in _DTYPES:
            name = _DTYPES[outs[0].dtype]
            by_dtype[name] = by_dtype.get(name, 0.0) + count
    dtype = max(by_dtype, key=by_dtype.get) if any(by_dtype.values()) else "fp32"
    if dtype == "fp32" and config.tensor_float_32_execution_enabled():
        return "tf32"
    return dtype


def _traffic(graph: _Read, edges: List[Tuple[int, int, float]]) -> List[float]:
    """Bytes per sample each op reads and writes in device memory: none for
    a view or a shape read; within a chain of ``FUSIBLE`` ops, a tensor only
    the next op of the chain reads is neither written nor read."""
    nbytes, types = graph.nbytes, graph.types
    traffic = [0.0 if view or kind in SHAPE_READS else
               sum(nbytes[id(t)] for t in ins) + sum(nbytes[id(t)] for t in outs)
               for view, kind, ins, outs in zip(graph.views, types, graph.inputs, graph.outputs)]
    consumers: Dict[int, set] = {}
    for i, j, _ in edges:
        consumers.setdefault(i, set()).add(j)
    for i, j, size in edges:
        if types[i] in FUSIBLE and types[j] in FUSIBLE and consumers[i] == {j}:
            traffic[i] -= size
            traffic[j] -= size
    return [max(t, 0.0) for t in traffic]


def _is_view(op: ops.Operation) -> bool:
    """Whether ``op``'s output shares its input's buffer."""
    if op.type == "Transpose":
        before, after = op.inputs[0].shape, op.outputs[0].shape
        if before.rank is not None and after.rank is not None and any(
                a is not None and b is not None and a != b
                for a, b in zip(before.as_list(), after.as_list())):
            return False  # moves a dimension (read before the permutation: it is dearer)
        perm = _integers(op.inputs[1])
        return perm is not None and perm == list(range(len(perm)))
    return op.type in VIEWS


def _integers(t: tensor_lib.Tensor) -> Optional[List[int]]:
    """The values of a constant integer tensor (None: not constant). A
    ``Const`` that holds its values as packed bytes is read from them
    (numpy's conversion costs more); every other form through TensorFlow."""
    if t.op.type == "Const" and t.dtype in (dtypes.int32, dtypes.int64):
        content, width = t.op.get_attr("value").tensor_content, t.dtype.size
        if content:
            return [int.from_bytes(content[k:k + width], "little", signed=True)
                    for k in range(0, len(content), width)]
    value = tensor_util.constant_value(t)
    return None if value is None else [int(v) for v in value.flat]


def _contraction_sizes(op: ops.Operation) -> Tuple[Optional[int], Optional[int]]:
    """(contracted size, output columns) of a matmul from either operand; of
    an einsum, (its summed letters' sizes multiplied, None)."""
    if op.type == "Einsum":
        shapes = [t.shape.as_list() if t.shape.rank is not None else None for t in op.inputs]
        return einsum_depth(op.get_attr("equation").decode(), shapes), None
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


def _flops(j: int, op: ops.Operation, graph: _Read) -> float:
    """FLOPs per sample of op j: 2 x multiply-adds of contractions and
    convolutions, none for views and shapes, output elements otherwise."""
    if graph.views[j] or j in graph.shapes:
        return 0.0
    outs = graph.outputs[j]
    out = graph.samples.get(id(outs[0]), 0.0) if outs else 0.0
    if j in graph.contraction:
        depth, _ = graph.contraction[j]
        return 2.0 * out * float(depth or 1)
    if op.type == "Conv2D":
        kernel = op.inputs[1].shape
        depth = kernel.num_elements() / max(int(kernel[-1] or 1), 1) if (
            kernel.is_fully_defined()) else 1.0
        return 2.0 * out * depth
    return out


def _weight_bytes(graph: _Read) -> List[float]:
    """Bytes of the variables each op reads first."""
    seen = set()
    owned = []
    for kind, ins, outs in zip(graph.types, graph.inputs, graph.outputs):
        total = 0.0
        for t in ins:
            if id(t) in graph.variables and t.op not in seen:
                seen.add(t.op)
                # A read's output is the variable (attributes are dearer to read).
                elements = outs[0].shape.num_elements() if kind == "ReadVariableOp" else None
                if elements is None:
                    total += variable_bytes(t)
                else:
                    total += elements * outs[0].dtype.size
        owned.append(total)
    return owned
