"""Weighting and summing the gradients of a rewritten step (see
``data_parallel``): each version's backprop is weighted by its share of the
batch (through its seeds, or its gradients for higher-order gradients), summed
over a device's micro-batches, then across the devices holding the same
variable by the reducer of ``allreduce`` (or Horovod's)."""
import collections
from typing import Dict, List, NamedTuple, Set, Tuple

from tfpar import fallback
from tfpar.analysis.batch_reductions import is_reduction, loss_scaling
from tfpar.analysis.normalizers import reductions_into_rows, whole_batch
from tfpar.compat.tf import array_ops, check_ops, indexed_slices, math_ops, ops, tensor_lib
from tfpar.errors import PlanError
from tfpar.ir.recorded import Recorded
from tfpar.rewriters import graph_edit
from tfpar.rewriters.normalizers import read_whole_batch
from tfpar.analysis.graph_index import GraphIndex
from tfpar.analysis.op_kinds import gradient_tensors
from tfpar.rewriters.rewrite_record import RewriteBuilder

__all__ = ["Reduced", "Scaled", "Weighting", "loss_weights", "reduce_gradients", "scale_seed",
           "scale_seeds"]

Tensor = tensor_lib.Tensor


class Weighting(NamedTuple):
    """How each version's backprop is weighted by its batch share (``scale_seeds``).

    Attributes:
      seeds: the seeds to scale (``scale_seed``), whose backprop is linear in
        them; none when gradients are weighted instead.
      seed_weighted: every step op downstream of a scaled seed, whose versions
        equal the global-batch backprop restricted to their rows.
      summed_grads: raw gradients of batch-sum losses, whose versions weigh 1
        (when gradients are weighted).
      edits: in-place edits of original ops (normalizers read whole-batch).
    """

    seeds: List[Tensor]
    seed_weighted: Set[ops.Operation]
    summed_grads: Set[Tensor]
    edits: int


class Scaled(NamedTuple):
    """A seed scaled per version (``scale_seed``): the ops ``made``, and the
    ``edits`` of original ops (their readers rerouted to the product)."""

    made: List[ops.Operation]
    edits: int


class Reduced(NamedTuple):
    """The gradients reduced (``reduce_gradients``).

    Attributes:
      tensors: raw gradient tensor -> its reduced value per stage device.
      edits: in-place edits of original ops (their readers outside the step
        rerouted to the reduced values).
    """

    tensors: Dict[Tensor, List[Tensor]]
    edits: int


def scale_seeds(rw: RewriteBuilder, recorded: Recorded, index: GraphIndex) -> Weighting:
    """Decide how each version's backprop is weighted by its batch share (n_u / N
    for a loss that is a mean over the rows; 1 for a sum: ``loss_weights``):
    the seeds to scale (``scale_seed``), whose backprop is linear in them.

    ``seed_weighted``: every step op downstream of a seed, whose versions then
    equal the global-batch backprop restricted to their rows (so fetched
    gradients merge by concatenation or plain sums). Empty, with no seed, and
    gradients are weighted instead (``summed_grads`` weighing 1), when a seed
    is unknown or a differentiated tensor depends on a seed (higher-order
    gradients, where the backprop is no longer linear in the seed).

    Raises:
      PlanError: higher-order gradients across stages of different widths.
    """
    summed, edits = loss_weights(rw, recorded)
    seeds = {s for call in recorded.gradient_calls for s in call.seeds}
    step = rw.selection.step_ops_set
    seed_ops = {s.op for s in seeds if isinstance(s, tensor_lib.Tensor) and s.op in step}
    downstream = {op for op in index.descendants(seed_ops) if op in step}
    if (not seeds or len(seed_ops) < len({getattr(s, "op", None) for s in seeds})
            or any(getattr(y, "op", None) in downstream | seed_ops
                   for call in recorded.gradient_calls for y in call.ys)):
        if len(set(rw.layout.widths)) > 1:
            raise PlanError("tfpar: higher-order gradients are not supported across bridged "
                            f"TaskGraphs of different widths {rw.layout.widths}")
        grads = {t for call in recorded.gradient_calls if id(call) in summed
                 for g in call.grads if g is not None for t in gradient_tensors(g)}
        grads |= {t for t, whole in rw.gradient_terms.items() if whole in grads}
        return Weighting([], set(), grads, edits)
    unweighted = {s for call in recorded.gradient_calls if id(call) in summed for s in call.seeds}
    return Weighting(sorted(seeds - unweighted, key=lambda t: t.name), downstream, set(), edits)


def scale_seed(rw: RewriteBuilder, seed: tensor_lib.Tensor, versions) -> Scaled:
    """Multiply ``seed`` by the batch share of each of its ``versions`` (what
    reads it in that version reads the product)."""
    stage = rw.placement.stage(seed.op)
    everything = {x for op in rw.selection.step_ops for x in rw.versions(op)}
    made, edits = [], 0
    for v in versions:
        seed_v = rw.versions(seed.op)[v].outputs[seed.value_index]
        readers = [c for c in seed_v.consumers() if c in everything]
        weight = rw.bridges.weight(stage, v)
        known = len(seed.graph.get_operations())
        with ops.device(rw.bridges.device(stage, v)):
            scaled = seed_v * math_ops.cast(weight, seed.dtype)
        made += seed.graph.get_operations()[known:]
        for c in readers:
            edits += graph_edit.reroute(c, seed_v, scaled)
    return Scaled(made, edits)


def loss_weights(rw: RewriteBuilder, recorded: Recorded) -> Tuple[Set[int], int]:
    """ids of the gradient calls whose losses are sums over the rows (each copy's
    gradient then weighs 1, not n_u / N; ``analysis.batch_reductions``), and the
    edits of original ops made reading a loss's normalizers
    (``analysis.normalizers``) whole-batch in every copy first
    (``normalizers.read_whole_batch``).

    Raises:
      PlanError: a loss no weighting of copies reproduces (a batch sum plus a
        term independent of the batch; a count it divides by that cannot be
        computed on the whole batch). A loss of unknown kind is taken for a
        mean, with a warning naming the op.
    """
    sel = rw.selection
    sources = set(sel.batch_inputs)
    args = (sel.batch_dependent, rw.batch_axes.holds_rows, rw.built_inputs)

    def computable(t: tensor_lib.Tensor) -> str:
        return whole_batch(t, sources, sel.batch_dependent, rw.built_inputs,
                           rw.batch_axes.axis)[1]

    summed, normalizers = set(), {}
    for call in recorded.gradient_calls:
        kinds = set()
        for y in call.ys:
            scaling = loss_scaling(y, *args, computable)
            _refuse_or_say(y, scaling)
            normalizers.update(dict.fromkeys(scaling.normalizers))
            normalizers.update(dict.fromkeys(
                t for t in reductions_into_rows(y, *args, sel.backward)
                if is_reduction(t, *args) and not computable(t)))
            kinds.add(scaling.kind or "mean")
        if kinds == {"sum"}:
            summed.add(id(call))
        elif len(kinds) > 1:
            raise PlanError(f"tfpar: one tf.gradients call differentiates both a batch mean and "
                            f"a batch sum ({[y.name for y in call.ys]}); add them into one loss "
                            "of one kind")
    sharded = bool(recorded.worker_iterators) or getattr(rw.processes, "shard_dataset", False)
    return summed, read_whole_batch(rw, list(normalizers), sharded)


def _refuse_or_say(y: tensor_lib.Tensor, scaling) -> None:
    """Refuse a loss no weighting of copies reproduces; say that one of
    unknown kind is weighted as a mean.

    Raises:
      PlanError: ``scaling.mixed``, or a normalizer that cannot be read
        whole-batch.
    """
    if scaling.mixed or scaling.unnormalized:
        raise PlanError(
            f"tfpar: the loss '{y.name}' cannot be split over replicas / micro-batches: "
            f"{scaling.culprit}. " + (
                "Make it a mean over the batch (divide the sum by the batch size) or make the "
                "other term a sum over the rows too" if scaling.mixed else
                "Compute the count from the batch inputs alone (a mask of the tokens or a "
                "weights feature), or fetch it once per step and feed it"))
    if scaling.kind is None:
        fallback.fall_back(
            f"the loss '{y.name}' split over replicas / micro-batches", "tfpar cannot "
            f"tell whether it is a mean or a sum over the batch ({scaling.culprit}), and "
            "weights its replicas as for a mean", "Write it as a reduce_mean or "
            "reduce_sum over the rows", y.graph)


def _device_terms(rw: RewriteBuilder, t: tensor_lib.Tensor, device: int,
                  weigh: bool = True) -> List[tensor_lib.Tensor]:
    """Stage device ``device``'s versions of ``t`` (one per micro-batch), each
    weighted by its batch share if ``weigh`` and not weighted already."""
    stage = rw.placement.stage(t.op)
    picks = [rw.layout.version(stage, device, m) for m in range(rw.num_micro_batch)]
    terms = [rw.version_tensor(t, v) for v in picks]
    if not weigh or t.op in rw.seed_weighted or t in rw.summed_grads:
        return terms
    return [x * math_ops.cast(rw.bridges.weight(stage, v), t.dtype) for x, v in zip(terms, picks)]


def reduce_gradients(rw: RewriteBuilder, raw, reducer_for) -> Reduced:
    """Weighted sum over a stage device's micro-batches, then summed across the
    devices holding the same variable (a stage's devices; for a split stage,
    the same shard's devices) (IndexedSlices: values and indices concatenated,
    then gathered; duplicates are summed by the optimizer, as for any
    IndexedSlices gradient). With ZeRO-2 a dense gradient is summed on its
    variable's owner only (``zero``). A step of several rounds
    (``analysis.rounds``) reduces each round's gradients on their own, round
    after round: a round's update waits on its sums only."""
    consumers = {t: [(c, k) for c in t.consumers() for k, x in enumerate(c.inputs) if x is t]
                 for t in raw}
    groups = collections.defaultdict(list)
    for g, var in rw.selection.raw_grads:
        op = gradient_tensors(g)[0].op
        slots = range(len(rw.placement.stage_devices[rw.placement.stage(op)]))
        groups[(rw.selection.rounds.of.get(op, 0),
                tuple(rw.placement.device(op, j) for j in slots))].append((g, var))
    reducers, reduced = {}, {}
    for (_, devices), grads in sorted(groups.items(), key=lambda item: item[0][0]):
        if devices not in reducers:
            reducers[devices] = reducer_for(list(devices))
        reduced.update(_reduce_group_gradients(rw, list(devices), grads, reducers[devices]))
    step = rw.selection.step_ops_set
    edits = 0
    for t in raw:
        for c, k in consumers[t]:
            if c not in step:
                graph_edit.update_input(c, k, reduced[t][0])
                edits += 1
    return Reduced(reduced, edits)


def _reduce_group_gradients(rw: RewriteBuilder, devices, grads,
                            reducer) -> Dict[Tensor, List[Tensor]]:
    """One group's gradients reduced (``reduce_gradients``): raw gradient
    tensor -> its reduced value per device."""
    fixed = [(g, var) for g, var in grads if _fixed_rows(g)]
    dense = [(g, var) for g, var in grads if not isinstance(g, indexed_slices.IndexedSlices)]
    sparse = [(g, var) for g, var in grads
              if isinstance(g, indexed_slices.IndexedSlices) and not _fixed_rows(g)]
    zero = rw.zero
    dense_owners = [zero.gradient_owner(var) if zero is not None else None
                    for _, var in dense + fixed]
    sparse_owners = [zero.owner.get(var) if zero is not None else None for _, var in sparse]
    dense_local, sparse_local = [], []
    fixed_indices = list(zip(*[_same_rows(rw, g.indices, len(devices), var) for g, var in fixed]))
    for j, device in enumerate(devices):
        with ops.device(device):
            dense_local.append([_with_shape(_sum(_device_terms(rw, g, j)), g) for g, _ in dense]
                               + [_with_shape(_sum(_device_terms(rw, g.values, j)), g.values)
                                  for g, _ in fixed])
            sparse_local.append(
                [_concat(_device_terms(rw, g.values, j)) for g, _ in sparse]
                + [_concat(_device_terms(rw, g.indices, j, weigh=False)) for g, _ in sparse])
    if len(devices) > 1 or getattr(reducer, "cross_process", False):
        dense_local = _across_devices(devices, dense_local, dense_owners, reducer.sum, _sum)
        sparse_local = _across_devices(devices, sparse_local, sparse_owners * 2, reducer.gather,
                                       _concat)
    reduced = {}
    for i, (g, _) in enumerate(dense):
        reduced[g] = [local[i] for local in dense_local]
    for i, (g, _) in enumerate(fixed):
        reduced[g.values] = [local[len(dense) + i] for local in dense_local]
        reduced[g.indices] = [local[i] for local in fixed_indices]
    for i, (g, _) in enumerate(sparse):
        reduced[g.values] = [local[i] for local in sparse_local]
        reduced[g.indices] = [local[len(sparse) + i] for local in sparse_local]
    return reduced


def _fixed_rows(g) -> bool:
    """An IndexedSlices gradient whose row count the graph fixed (a position
    embedding looked up with ``tf.range(seq_len)``): the update ops were built
    for that count, so the versions' slices are summed row by row, not
    concatenated (they read the same rows: ``_same_rows``)."""
    return (isinstance(g, indexed_slices.IndexedSlices) and g.indices.shape.rank == 1
            and g.indices.shape[0] is not None)


def _same_rows(rw: RewriteBuilder, indices: tensor_lib.Tensor, devices: int,
               var) -> List[tensor_lib.Tensor]:
    """The rows of a fixed-row sparse gradient (``_fixed_rows``) on each of a
    stage's ``devices``: its first version's there, checked at run time to
    equal every other version's when they depend on the batch (which rows a
    replica looks up could then differ, and summing would be wrong)."""
    firsts = [_device_terms(rw, indices, j, weigh=False)[0] for j in range(devices)]
    if indices.op not in rw.selection.batch_dependent:
        return firsts
    first = rw.version_tensor(indices, 0)
    checks = [check_ops.assert_equal(
        t, first, message=f"tfpar: the sparse gradient of '{var.name}' has {indices.shape[0]} "
        "rows in every replica / micro-batch, but they look up different rows; tfpar sums such "
        "gradients row by row. Give the lookup ids an unknown leading dimension")
        for j in range(devices) for t in _device_terms(rw, indices, j, weigh=False)
        if t is not first]
    result = []
    for t in firsts:
        with ops.device(t.device), ops.control_dependencies(checks):
            result.append(array_ops.identity(t))
    return result


def _across_devices(devices, local, owners, collective, combine):
    """``local[j][i]``, device j's term i, combined across devices: on
    ``owners[i]`` alone by ``combine`` where one is given (ZeRO: every device
    reads that result, only the owner's update does: dense gradients with
    stage 2, sparse ones always, which a gather collective would leave waiting
    on devices that never read them), else by ``collective``."""
    shared = [i for i, owner in enumerate(owners) if owner is None]
    result = [list(row) for row in local]
    if shared:
        combined = collective([[row[i] for i in shared] for row in local])
        for row, values in zip(result, combined):
            for i, value in zip(shared, values):
                row[i] = value
    for i, owner in enumerate(owners):
        if owner is not None:
            with ops.device(devices[owner]):
                value = combine([row[i] for row in local])
            for row in result:
                row[i] = value
    return result


def _concat(terms: List[tensor_lib.Tensor]) -> tensor_lib.Tensor:
    return array_ops.concat(terms, 0)


def _with_shape(t: tensor_lib.Tensor, raw: tensor_lib.Tensor) -> tensor_lib.Tensor:
    """``t``, a copy of gradient ``raw``, knowing ``raw``'s static shape: a
    copy (imported ops, a function's result) infers shapes again without the
    ``set_shape`` the script's ops made (Tensordot's on 3-D inputs), and
    collectives need them."""
    t.set_shape(raw.shape)
    return t


def _sum(terms: List[tensor_lib.Tensor]) -> tensor_lib.Tensor:
    return terms[0] if len(terms) == 1 else math_ops.add_n(terms)
