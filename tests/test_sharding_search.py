"""The sharding search (Rhino §4) on layer graphs, no TensorFlow: the ILP and
the segment DP equal brute force, critical layers, plan reuse, memory; how
it ended, and its time limit."""
import dataclasses
import itertools
import random
import time

import pytest
import tensorflow as tf

import tfpar as wh
from tfpar.analysis.graph_index import GraphIndex
from tfpar.analysis.model_view import model_view
from tfpar.hooks.capture import existing_capture
from tfpar.models.gpt import gpt_train_op

from tfpar.cluster.hardware import Hardware
from tfpar.planner import elimination, sharding
from tfpar.planner.auto import search
from tfpar.planner.model_view import ModelView
from tfpar.planner.layers import Layer, LayerGraph, layer_graph
from tfpar.planner.sharding import critical_layers, plan_sharding
from tfpar.planner.sharding_costs import Mesh, Problem

DEVICE = Hardware("test", tflops=0.05, memory_gb=16, intra_node_gbps=10)
KINDS = ("matmul", "elementwise", "other", "matmul", "xent")


def random_graph(seed, count, skip_edges):
    rng = random.Random(seed)
    layers = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)] if i < count - 1 else "xent"
        params = rng.choice([0.0, 4e4, 4e6]) if kind == "matmul" else 0.0
        layers.append(Layer(f"l{i}", kind, flops=rng.uniform(1e3, 1e7),
                            out_bytes=rng.choice([64.0, 4096.0, 65536.0]),
                            activation_bytes=rng.uniform(64, 65536), param_bytes=params,
                            input_bytes=8.0 if i == 0 else 0.0, ops=(i,),
                            signature=(f"l{i}",)))
    edges = {(i, i + 1): rng.choice([64.0, 4096.0, 65536.0]) for i in range(count - 1)}
    for _ in range(skip_edges):
        i = rng.randrange(count - 2)
        edges[i, rng.randrange(i + 2, count)] = rng.choice([64.0, 4096.0])
    return LayerGraph(tuple(layers), tuple((i, j, s) for (i, j), s in sorted(edges.items())))


def brute_force(graph, mesh, memory_limit=float("inf")):
    problem = Problem(graph, mesh)
    feasible = [c for c in itertools.product(*problem.allowed())
                if problem.memory(c) <= memory_limit]
    return min(problem.objective(c).seconds for c in feasible)


@pytest.mark.parametrize("seed,count,skips", [(0, 5, 0), (1, 6, 1), (2, 7, 2), (3, 6, 3),
                                              (4, 8, 1)])
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_solvers_equal_brute_force(seed, count, skips, level):
    graph = random_graph(seed, count, skips)
    mesh = Mesh(devices=4, tensor=2, batch=32, hardware=DEVICE)
    plan = plan_sharding(graph, mesh, memory_limit=1e12, opt_level=level)
    found = Problem(graph, mesh).objective(plan.candidates).seconds
    assert found == pytest.approx(brute_force(graph, mesh), rel=1e-4)


def test_whole_graph_ilp_respects_memory_exactly():
    graph = random_graph(5, 7, 2)
    mesh = Mesh(devices=4, tensor=4, batch=32, hardware=DEVICE)
    problem = Problem(graph, mesh)
    everything_dp = problem.memory(["dp"] * 7)
    limit = 0.7 * everything_dp
    plan = plan_sharding(graph, mesh, memory_limit=limit, opt_level="O3")
    assert plan.memory_bytes <= limit
    found = problem.objective(plan.candidates).seconds
    assert found == pytest.approx(brute_force(graph, mesh, limit), rel=1e-3)


def test_segment_dp_forces_the_largest_weights_sharded_until_it_fits():
    """Rhino §4.4: the cheapest plan keeps weights replicated; a tight memory
    limit shards the largest ones first."""
    layers = tuple(Layer(f"fc{i}", "matmul", flops=1e3, out_bytes=64.0, activation_bytes=64.0,
                         param_bytes=size, input_bytes=0.0, ops=(i,), signature=(i,))
                   for i, size in enumerate([1e3, 8e6, 1e3]))
    graph = LayerGraph(layers, ((0, 1, 64.0), (1, 2, 64.0)))
    mesh = Mesh(devices=2, tensor=2, batch=4, hardware=Hardware("fast", 1.0, 16, 1e4))
    free = plan_sharding(graph, mesh, memory_limit=1e12)
    assert free.candidates == ("dp", "dp", "dp")
    tight = plan_sharding(graph, mesh, memory_limit=0.6 * free.memory_bytes)
    assert tight.candidates[1] in sharding.SHARDED
    assert tight.memory_bytes <= 0.6 * free.memory_bytes
    assert plan_sharding(graph, mesh, memory_limit=1.0) is None


def test_critical_layers_are_the_ones_no_edge_jumps_over():
    graph = LayerGraph(tuple(Layer(str(i), "other", 1, 1, 1, 0, 0, (i,), (i,)) for i in range(6)),
                       ((0, 1, 1), (1, 2, 1), (1, 3, 1), (2, 3, 1), (3, 4, 1), (4, 5, 1), (3, 5, 1)))
    assert critical_layers(graph) == [0, 1, 3, 5]


def repeated_blocks(count):
    """A view of ``count`` identical residual MLP blocks (TAP's shared subgraphs)."""
    names, types, flops, acts, params, edges = [], [], [], [], [], []
    previous = None
    for b in range(count):
        start = len(names)
        for name, kind, flop, param in (("fc1/MatMul", "MatMul", 4e4, 64 * 256 * 4.0),
                                        ("fc1/Relu", "Relu", 256, 0.0),
                                        ("fc2/MatMul", "MatMul", 4e4, 256 * 64 * 4.0),
                                        ("add", "AddV2", 64, 0.0)):
            names.append(f"block{b}/{name}")
            types.append(kind)
            flops.append(flop)
            acts.append(1024.0)
            params.append(param)
        edges += [(start, start + 1, 1024.0), (start + 1, start + 2, 1024.0),
                  (start + 2, start + 3, 256.0)]
        if previous is not None:
            edges += [(previous, start, 256.0), (previous, start + 3, 256.0)]
        previous = start + 3
    return ModelView(flops=flops, activation_bytes=acts, param_bytes=params, edges=edges,
                     names=names, types=types)


def masked_mlp(blocks, width=1024):
    """``repeated_blocks``' residual MLP blocks, wider, whose activations all
    read one mask op, as a causal mask built once is read by every layer of
    many GPT and BERT scripts: no layer between the mask and the loss is
    critical, so O2's one segment is the whole model, solved by the ILP."""
    names, types, flops, acts, params, edges = ["mask/Const"], ["Const"], [0.0], [0.0], [0.0], []
    row, previous = 4.0 * width, None
    for b in range(blocks):
        first = len(names)
        for name, kind, flop, param in (
                ("fc1/MatMul", "MatMul", 8.0 * width ** 2, 16.0 * width ** 2),
                ("act/Mul", "Mul", 4.0 * width, 0.0),
                ("fc2/MatMul", "MatMul", 8.0 * width ** 2, 16.0 * width ** 2),
                ("add/AddV2", "AddV2", width, 0.0)):
            names.append(f"block{b}/{name}")
            types.append(kind)
            flops.append(flop)
            acts.append(row)
            params.append(param)
        edges += [(first, first + 1, 4 * row), (0, first + 1, row),
                  (first + 1, first + 2, 4 * row), (first + 2, first + 3, row)]
        if previous is not None:
            edges += [(previous, first, row), (previous, first + 3, row)]
        previous = first + 3
    names.append("loss/xent")
    types.append("SparseSoftmaxCrossEntropyWithLogits")
    flops, acts, params = flops + [width], acts + [8.0], params + [0.0]
    edges.append((previous, len(names) - 1, row))
    inputs = [0.0] * len(names)
    inputs[1], inputs[-1] = row, 8.0
    return ModelView(flops=flops, activation_bytes=acts, param_bytes=params, edges=sorted(edges),
                     names=names, types=types, input_bytes=inputs)


def test_the_plan_says_whether_the_search_proved_it():
    """Before, ``optimal`` was computed and never shown, and why a plan was
    not proved optimal was not said at all."""
    mesh = Mesh(devices=4, tensor=2, batch=32, hardware=DEVICE)
    graph = random_graph(1, 6, 1)
    o2 = plan_sharding(graph, mesh, memory_limit=1e12, opt_level="O2")
    assert o2.outcome.describe() == "optimal (O2 segments)" and o2.optimal
    o3 = plan_sharding(graph, mesh, memory_limit=1e12, opt_level="O3")
    assert o3.outcome.describe() == "optimal (O3 whole-graph ILP)" and o3.optimal
    layers = tuple(Layer(f"fc{i}", "matmul", flops=1e3, out_bytes=64.0, activation_bytes=64.0,
                         param_bytes=size, input_bytes=0.0, ops=(i,), signature=(i,))
                   for i, size in enumerate([1e3, 8e6, 1e3]))
    tight = LayerGraph(layers, ((0, 1, 64.0), (1, 2, 64.0)))
    small = Mesh(devices=2, tensor=2, batch=4, hardware=Hardware("fast", 1.0, 16, 1e4))
    forced = plan_sharding(tight, small, memory_limit=0.6 * Problem(tight, small).memory(
        ["dp"] * 3))
    assert (forced.outcome.path, forced.outcome.timed_out, forced.optimal) == (
        "feasible", False, False)
    assert "Rhino §4.4" in forced.outcome.why and "auto.opt_level O3" in forced.outcome.why


def test_a_deadline_bounds_the_sharding_search(monkeypatch):
    """96 masked blocks on 8 devices: O2's one segment of 386 layers takes
    CP-SAT 2.6-3.5 s here to solve (24 blocks once took 75 s, six ILP solves
    of up to 10 s each, whatever the search's time limit, before CP-SAT's
    presolve was left out of these ILPs); variable elimination, 0.05 s, the
    same plan. With CP-SAT solving it (``elimination.MAX_ENTRIES`` 0: no
    segment eliminated), no solve runs past the caller's deadline (0.5 s)
    and the plan says a time limit decided it."""
    graph = layer_graph(masked_mlp(96))
    last = len(graph.layers) - 1
    assert critical_layers(graph) == [0, last - 1, last]  # the mask, the last block, the loss
    mesh = Mesh(devices=8, tensor=8, batch=64, hardware=Hardware("gpu", 100.0, 80.0, 300, 25))
    eliminated = plan_sharding(graph, mesh, 1e12, "O2", deadline=time.monotonic() + 2.0)
    assert (eliminated.outcome.path, eliminated.optimal) == ("optimal", True)
    monkeypatch.setattr(elimination, "MAX_ENTRIES", 0)
    start = time.monotonic()
    plan = plan_sharding(graph, mesh, 1e12, "O2", deadline=start + 0.5)
    assert time.monotonic() - start < 6.0  # a loaded machine runs late; before: 75 s
    assert (plan.outcome.path, plan.outcome.timed_out, plan.optimal) == ("feasible", True, False)
    assert plan.outcome.why.startswith("segment ILPs")


def test_repeated_blocks_are_solved_once(monkeypatch):
    """Plan reuse (TAP §IV-C): segments with the same signature share one solve,
    so 24 blocks cost as many segment solves as 4."""
    solved = []
    original = sharding._solve_segment
    monkeypatch.setattr(sharding, "_solve_segment",
                        lambda *args: solved.append(args[2:]) or original(*args))
    mesh = Mesh(devices=8, tensor=4, batch=64, hardware=DEVICE)
    counts = []
    for blocks in (4, 24):
        solved.clear()
        graph = layer_graph(repeated_blocks(blocks))
        assert [layer.scope for layer in graph.layers[:3]] == ["block0/fc1", "block0/fc2",
                                                               "block0/add"]
        o2 = plan_sharding(graph, mesh, memory_limit=1e12, opt_level="O2")
        counts.append(len(solved))
        o3 = plan_sharding(graph, mesh, memory_limit=1e12, opt_level="O3")
        problem = Problem(graph, mesh)
        assert problem.objective(o2.candidates).seconds == pytest.approx(
            problem.objective(o3.candidates).seconds, rel=1e-4)
    assert counts[0] == counts[1] <= 4


def test_scopes_feeding_each_other_are_one_layer_naming_both():
    """a -> b -> a: the scopes merge into one layer, and a plan that splits it
    names both scopes (so a pinned build splits every op of it)."""
    view = ModelView(flops=[4e6, 1e3, 1e3], activation_bytes=[4096.0] * 3,
                     param_bytes=[4e7, 0.0, 0.0], edges=[(0, 1, 4096.0), (1, 2, 4096.0)],
                     names=["a/MatMul", "b/Relu", "a/add"], types=["MatMul", "Relu", "AddV2"])
    graph = layer_graph(view)
    assert [(layer.scopes, layer.ops) for layer in graph.layers] == [(("a", "b"), (0, 1, 2))]
    best = search(view, 4, Hardware("fast", 10.0, 80.0, 1e4), global_batch=8, num_micro_batch=1,
                  pipeline=1)
    assert best.tensor > 1 and {scope for scope, _ in best.split_scopes} == {"a", "b"}


def test_batch_free_edges_tie_no_segments_together():
    """A tensor every layer reads that has no batch rows (a causal mask
    built once: 0 bytes per row in the model view) costs nothing to reshard;
    before, its edges jumped over every layer, so the search was one ILP over
    the whole model (16 GPT layers: 58 s instead of 1 s). Its edges now leave
    the critical layers and the plan's cost as they are without them."""
    chain = random_graph(5, 8, 0)
    mask = Layer("mask", "other", 1e3, 0.0, 0.0, 0.0, 0.0, (99,), ("mask",))
    layers = (mask,) + tuple(dataclasses.replace(layer, ops=(i + 1,))
                             for i, layer in enumerate(chain.layers))
    shifted = tuple((i + 1, j + 1, s) for i, j, s in chain.edges)
    masked = LayerGraph(layers, tuple(sorted(shifted + tuple((0, j, 0.0) for j in (2, 4, 6)))))
    unmasked = LayerGraph(layers, tuple(sorted(shifted + ((0, 1, 64.0),))))
    assert critical_layers(masked) == [0] + [k + 1 for k in critical_layers(chain)]
    mesh = Mesh(devices=4, tensor=2, batch=32, hardware=DEVICE)
    for graph in (masked, unmasked):
        plan = plan_sharding(graph, mesh, memory_limit=1e12, opt_level="O2")
        assert plan.optimal
        assert Problem(graph, mesh).objective(plan.candidates).seconds == pytest.approx(
            brute_force(graph, mesh), rel=1e-9)


def _gpt_layers(layers, mask):
    """The layer graph of ``tfpar.models``' GPT (hidden 64, 4 heads, 16 tokens)
    with its causal ``mask`` built once ("shared") or per block."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 1})
        gpt_train_op(layers, 64, 16, 96, 4, batch=8, mask=mask)
        _, view = model_view(GraphIndex(graph), existing_capture(graph))
    wh.reset()
    return layer_graph(view)


def test_a_causal_mask_every_layer_reads_costs_the_search_nothing(monkeypatch):
    """A GPT written the usual way builds its causal mask once: before, the
    mask's edges left no critical layer, and a tensor-8 mesh of 16 blocks
    was one ILP (58 s, 1 s with a mask per block). Now the search solves as
    many segments for 4 blocks as for 8, shared mask or not, and plans the
    shared-mask model as the per-block one."""
    solved = []
    original = sharding._solve_segment
    monkeypatch.setattr(sharding, "_solve_segment",
                        lambda *args: solved.append(args[2:]) or original(*args))
    mesh = Mesh(devices=8, tensor=8, batch=8, hardware=Hardware("gpu", 100.0, 80.0, 300, 25))
    counts, plans, graphs = {}, {}, {}
    for mask in ("shared", "per_layer"):
        for layers in (4, 8):
            solved.clear()
            graph = graphs[mask, layers] = _gpt_layers(layers, mask)
            assert len(critical_layers(graph)) > 2 * layers  # segments within every block
            plans[mask, layers] = plan_sharding(graph, mesh, 1e12, "O2")
            counts[mask, layers] = len(solved)
            assert plans[mask, layers].optimal
    assert counts["shared", 4] == counts["shared", 8] == counts["per_layer", 8]
    for layers in (4, 8):
        shared, per_layer = ({layer.scope: c for layer, c in zip(graphs[mask, layers].layers,
                                                                 plans[mask, layers].candidates)}
                             for mask in ("shared", "per_layer"))
        common = set(shared) & set(per_layer)
        assert len(common) > 20 * layers
        assert {s: shared[s] for s in common} == {s: per_layer[s] for s in common}
