"""The phases of the data-parallel selection (``rewriters.select``) and
rewrite (``rewriters.data_parallel``), each on a graph of a few ops: a
placeholder ``x`` ([None, 3]), a resource variable ``w`` ([3, 1]),
``y = x @ w``, ``loss = mean(y)``, plain SGD, and a summary of the loss."""
import dataclasses

import pytest
import tensorflow as tf

import tfpar as wh
from tfpar.analysis.graph_index import GraphIndex, ancestors
from tfpar.analysis.stages import Placement, canonical_device
from tfpar.errors import PlanError
from tfpar.hooks.capture import existing_capture
from tfpar.rewriters import data_parallel as dp
from tfpar.rewriters import select
from tfpar.rewriters.allreduce import LocalReducer
from tfpar.rewriters.batch_sources import refuse_unsplittable, worker_sources
from tfpar.rewriters.mirrored import clone_variables
from tfpar.rewriters.rewrite_record import DataParallelRewrite

v1 = tf.compat.v1
CPU = [canonical_device(f"/job:localhost/replica:0/task:0/device:CPU:{j}") for j in range(2)]


@dataclasses.dataclass
class MirroringReducer(LocalReducer):
    """A local reducer whose devices keep their own copies of the variables."""

    mirrors_variables = True


@dataclasses.dataclass
class Model:
    graph: tf.Graph
    ops: dict

    @property
    def capture(self):
        return existing_capture(self.graph)

    def __getitem__(self, name):
        return self.ops[name]


@pytest.fixture
def model():
    """The tiny model, captured by tfpar on two devices (not rewritten)."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 2})
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        w = v1.get_variable("w", [3, 1], initializer=v1.ones_initializer(), use_resource=True)
        y = tf.matmul(x, w, name="y")
        loss = tf.reduce_mean(y, name="loss")
        step = v1.train.get_or_create_global_step()
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
        summary = v1.summary.scalar("loss_summary", loss)
    (grad, _), = [(g, v) for call in existing_capture(graph).gradient_calls
                  for g, v in zip(call.grads, call.xs)]
    apply = [op for op in graph.get_operations() if op.type == "ResourceApplyGradientDescent"]
    return Model(graph, {"x": x.op, "w": graph.get_operation_by_name("w"), "y": y.op,
                         "loss": loss.op, "step": step.op, "train": train, "grad": grad,
                         "summary": summary.op, "apply": apply[0]})


def _selection(m: Model) -> select.Selection:
    return select.select_replication(m.graph, m.capture, GraphIndex(m.graph), {m["step"]},
                                     set())


def _placement(m: Model, stage_of=None, devices=2) -> Placement:
    stage_devices = ([CPU[:devices]] if stage_of is None else [[CPU[0]], [CPU[1]]])
    return Placement(stage_devices=stage_devices, num_replicas=len(stage_devices[0]),
                     stage_of=stage_of or {}, task_graph_names=["a", "b"][:len(stage_devices)])


def _rewrite(m: Model, reducer=LocalReducer, stage_of=None):
    """The record of ``_new_rewrite`` for two replicas (or two stages)."""
    sel = dp._selection(m.graph, m.capture, GraphIndex(m.graph))
    return dp._new_rewrite(sel, _placement(m, stage_of), 1, reducer, [], None, None)


# --- select_replication's phases --------------------------------------------------------

def test_training_roots_are_loss_and_gradients_but_the_global_step(model):
    roots, raw_grads = select.training_roots(model.capture, {model["step"]})
    assert model["loss"] in roots and model["grad"].op in roots
    assert raw_grads == [(model["grad"], model["w"])]
    _, with_step = select.training_roots(model.capture, {model["w"]})
    assert with_step == []


def test_batch_sources_are_the_fed_placeholder_and_its_descendants(model):
    needed = ancestors([model["loss"], model["grad"].op], select.is_frozen)
    sources = select.batch_sources(needed, GraphIndex(model.graph))
    assert sources.inputs == {model["x"]} and sources.sparse_readers == set()
    assert {model["y"], model["loss"], model["summary"]} <= sources.dependent
    assert model["w"] not in sources.dependent


def test_step_ops_are_forward_and_backward_not_updates_nor_frozen(model):
    index = GraphIndex(model.graph)
    needed = ancestors([model["loss"], model["grad"].op], select.is_frozen)
    step = select.step_ops(model.capture, index, needed, select.batch_sources(needed, index),
                           {model["grad"].op})
    assert {model["y"], model["loss"], model["grad"].op} <= step
    assert not {model["x"], model["w"], model["apply"], model["summary"]} & step


def test_update_ops_are_the_apply_phase_writers_cut_at_the_step(model):
    index = GraphIndex(model.graph)
    cut = {model["y"], model["loss"], model["grad"].op}
    update = select.update_ops(model.graph, model.capture, index, cut, {model["step"]})
    assert model["apply"] in update
    assert not cut & update
    assert all(op.type != "AssignAddVariableOp" for op in update)  # the global step's


def test_accumulator_reads_and_writes_run_once_after_the_replicas():
    """A tracker's update adds what one device adds (its merged value), once;
    before, every replica added its own (a Mean tracker counted R steps)."""
    graph = tf.Graph()
    with graph.as_default():
        total = v1.get_variable("total", [], initializer=v1.zeros_initializer(),
                                use_resource=True)
        x = v1.placeholder(tf.float32, [None], name="x")
        add = total.assign_add(tf.reduce_sum(x), read_value=False)
        read = v1.identity(total.read_value(), name="value")
    index = GraphIndex(graph)
    reads = [c for c in total.handle.consumers() if c.type == "ReadVariableOp"]
    step = {add, read.op, read.op.inputs[0].op, *reads}
    late = select.late_accumulator_ops(index, step, needed=set(),
                                       accumulators={total.handle.op})
    assert late == step  # the write, the read, and what reads its value
    assert select.late_accumulator_ops(index, step, step, {total.handle.op}) == set()


def test_step_batch_inputs_are_the_fed_tensors_the_step_reads(model):
    index = GraphIndex(model.graph)
    needed = ancestors([model["loss"], model["grad"].op], select.is_frozen)
    sources = select.batch_sources(needed, index)
    step = select.step_ops(model.capture, index, needed, sources, {model["grad"].op})
    assert select.step_batch_inputs(index, step, step, sources) == [model["x"].outputs[0]]


def test_select_replication_assembles_the_phases(model):
    sel = _selection(model)
    assert sel.variables == [model["w"]]
    assert sel.batch_inputs == [model["x"].outputs[0]]
    assert sel.raw_grads == [(model["grad"], model["w"])]
    assert [op.type for op in sel.sync_writers] == ["AssignVariableOp"]  # w's initializer
    assert model["apply"] in sel.update_ops and model["y"] in sel.step_ops_set
    assert model["grad"].op in sel.backward and model["y"] not in sel.backward


# --- replicate's phases -----------------------------------------------------------------

def test_selection_leaves_out_the_global_step(model):
    sel = dp._selection(model.graph, model.capture, GraphIndex(model.graph))
    assert sel.variables == [model["w"]]
    assert all(var is model["w"] for _, var in sel.raw_grads)


def test_new_rewrite_has_a_version_per_replica_and_mirrors_with_a_mirroring_reducer(model):
    rw = _rewrite(model)
    assert len(rw.version_maps) == 1 and len(rw.version_maps[0]) == 2
    assert len(rw.device_maps[0]) == 2
    assert not rw.mirrored and not rw.trivial and not rw.weight_tasks and rw.edits == 0
    assert _rewrite(model, MirroringReducer).mirrored


def test_place_moves_the_copied_ops_to_their_stage_device(model):
    rw = _rewrite(model, stage_of={model["loss"]: 1})
    dp._place(model.graph, rw, zero=0, offload=False)
    assert canonical_device(model["y"].device) == CPU[0]
    assert canonical_device(model["w"].device) == CPU[0]
    assert canonical_device(model["loss"].device) == CPU[1]
    assert model["summary"].device == ""  # not copied, not moved


def test_built_edges_snapshot_readers_and_stage_crossings(model):
    rw = _rewrite(model, stage_of={model["loss"]: 1})
    edges = dp._built_edges(rw, GraphIndex(model.graph))
    assert (model["loss"].outputs[0], model["summary"], 1) in edges.outside_readers
    assert (model["loss"], 0, model["y"].outputs[0]) in edges.crossing
    assert {c for c, _, _ in edges.crossing} == {model["loss"]}  # y and Mean's axes
    assert model["apply"] in edges.copied and model["grad"] in edges.raw
    assert rw.original_inputs[model["y"]] == list(model["y"].inputs)


def test_refuse_unsplittable_names_what_cannot_be_cut(model):
    sel = _selection(model)
    refuse_unsplittable(sel)  # a relaxed placeholder can be cut
    with pytest.raises(PlanError, match="found no batch input"):
        refuse_unsplittable(dataclasses.replace(sel, batch_inputs=[]))
    with model.graph.as_default():
        fixed = tf.zeros([8, 3], name="fixed")
    with pytest.raises(PlanError, match="'fixed:0' .* static batch size 8"):
        refuse_unsplittable(dataclasses.replace(sel, batch_inputs=[fixed]))
    assert worker_sources(model.capture, sel, 2) is None  # no io.shard_dataset


def _split(model, reducer=LocalReducer):
    rw = _rewrite(model, reducer)
    dp._place(model.graph, rw, zero=0, offload=False)
    edges = dp._built_edges(rw, GraphIndex(model.graph))
    with model.graph.as_default(), tf.name_scope("tfpar"):
        dp._split_batch(model.capture, rw, shares=())
    return rw, edges


def test_split_batch_gives_each_version_its_rows(model):
    rw, _ = _split(model)
    pieces = [rw.bridges.batch_input(0, 0, v) for v in range(2)]
    assert pieces[0] is not pieces[1]
    assert all(p.op.name.startswith("tfpar/") for p in pieces)
    assert rw.batch_axes.axis(model["y"].outputs[0]) == 0


def test_reroute_batch_inputs_counts_its_edits(model):
    rw, _ = _split(model)
    dp._reroute_batch_inputs(rw)
    piece = rw.bridges.batch_input(0, 0, 0)
    readers = [op for op in model.graph.get_operations() if piece in list(op.inputs)]
    assert sorted(op.type for op in readers) == ["MatMul", "MatMul"]  # y, w's gradient
    assert model["y"] in readers
    assert all(c.name.startswith("tfpar/") for c in model["x"].outputs[0].consumers())
    assert rw.edits == 2


def test_versions_as_copies_copies_the_step_on_the_second_device(model):
    rw, edges = _split(model)
    dp._reroute_batch_inputs(rw)
    with model.graph.as_default():
        dp._versions_as_copies(model.graph, rw, edges, [], LocalReducer)
    copy = rw.version_maps[0][1][model["y"]]
    assert copy.name == "replica_1/micro_0/y"
    assert canonical_device(copy.device) == CPU[1]
    assert copy.inputs[0] is rw.bridges.batch_input(0, 0, 1)
    assert copy.inputs[1].op.inputs[0] is model["w"].outputs[0]  # shared variable
    assert rw.versions(model["y"]) == [model["y"], copy]


def test_mirrored_variables_and_updates_are_copied_per_device(model):
    rw, edges = _split(model, MirroringReducer)
    with model.graph.as_default():
        rw.device_maps = clone_variables(model.graph, rw)
        dp._versions_as_copies(model.graph, rw, edges, [], MirroringReducer)
        dp._reduce_and_update(model.graph, rw, edges, MirroringReducer)
    w1 = rw.device_maps[0][1][model["w"]]
    assert w1.name == "replica_1/variables/w" and canonical_device(w1.device) == CPU[1]
    assert rw.replica_versions(model["w"]) == [model["w"], w1]
    copy = rw.version_maps[0][1][model["y"]]
    assert copy.inputs[1].op.inputs[0] is w1.outputs[0]  # its device's copy
    apply1 = rw.device_maps[0][1][model["apply"]]
    assert apply1.inputs[0] is w1.outputs[0] and canonical_device(apply1.device) == CPU[1]


def test_rewire_readers_merge_what_the_summary_reads(model):
    rw, edges = _split(model)
    dp._reroute_batch_inputs(rw)
    with model.graph.as_default():
        dp._versions_as_copies(model.graph, rw, edges, [], LocalReducer)
        dp._reduce_and_update(model.graph, rw, edges, LocalReducer)
        before = rw.edits
        dp._rewire_readers(rw, edges)
    merged = rw.merged[model["loss"].outputs[0]]
    assert model["summary"].inputs[1] is merged
    assert rw.edits == before + 1


def test_replicate_runs_the_phases_in_order(model):
    rw = dp.replicate(model.graph, model.capture, GraphIndex(model.graph), _placement(model),
                      1, LocalReducer, [], functions=False)
    assert rw.version_maps[0][1][model["y"]].name == "tfpar/replica_1/micro_0/y"
    assert model["summary"].inputs[1] is rw.merged[model["loss"].outputs[0]]
    # x read by y and w's gradient (2), the gradient seed's reader scaled in
    # each version (2), the update reading the reduced gradient and the
    # summary the merged loss (1 + 1)
    assert rw.edits == 6


def test_versions_as_calls_make_one_call_per_task_and_version(model):
    rw = dp.replicate(model.graph, model.capture, GraphIndex(model.graph), _placement(model),
                      1, LocalReducer, [], functions=True)
    assert rw.functions
    calls = [rw.version_maps[0][v][model["y"]] for v in range(2)]
    assert [c.type for c in calls] == ["StatefulPartitionedCall"] * 2
    assert [c.name for c in calls] == ["tfpar/replica_0/micro_0/F", "tfpar/replica_1/micro_0/F"]
    assert [canonical_device(c.device) for c in calls] == CPU
    assert rw.version_tensor(model["y"].outputs[0], 1).op is calls[1]
    # the backward call of version 1 reads its own forward call's values
    backward = rw.version_maps[0][1][model["grad"].op]
    assert backward.name == "tfpar/replica_1/micro_0/B" and calls[1] in {
        t.op for t in backward.inputs}


def test_replicate_returns_a_frozen_record(model):
    """What the rewrite made does not change after it: no field can be set, and
    its mappings, lists and sets are read-only."""
    rw = dp.replicate(model.graph, model.capture, GraphIndex(model.graph), _placement(model),
                      1, LocalReducer, [], functions=True)
    assert isinstance(rw, DataParallelRewrite)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rw.edits = 0
    loss = model["loss"].outputs[0]
    for mapping in (rw.merged, rw.version_maps[0][1], rw.sync_ops, rw.reduced, rw.task_ops):
        with pytest.raises(TypeError):
            mapping[loss] = loss
    assert isinstance(rw.version_maps, tuple) and isinstance(rw.version_maps[0], tuple)
    assert isinstance(rw.seed_weighted, frozenset) and isinstance(rw.outside_tasks, frozenset)
    assert all(isinstance(values, tuple) for values in rw.reduced.values())
