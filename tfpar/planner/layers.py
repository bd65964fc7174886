"""The sharding search's graph: forward ops grouped into layers (no TensorFlow).

A layer is the ops of one name scope (a keras/v1 layer, a loss), the
outermost one holding at most one weighted contraction, or a single op: the
unit tfpar can split at build time, since the hooks match scopes, and the
granularity of Rhino's per-node sharding candidates (§4.2).
Variable reads join the layer that consumes them. Layers that depend on each
other both ways (interleaved scopes) are merged, so the layer graph is a DAG.

Each layer has a kind, from its op types:
  * ``matmul``: a contraction with a weight (column / row shardable);
  * ``xent``: softmax cross-entropy (distributed over split classes);
  * ``embedding``: a lookup in a weight (vocabulary-shardable);
  * ``elementwise``: only per-element ops (acts on shards as they are);
  * ``attention``: an attention core's op (a split into Q, K, V, the
    reshapes and transposes to and from heads, a weightless contraction, the
    softmax) between weighted contractions (``attention_layers``): may run on
    a group's heads (Megatron's head-parallel attention);
  * ``other``: everything else (needs whole rows).

An attention core inside a keras ``MultiHeadAttention`` is one tfpar's split
builds by heads (``Layer.heads``, from ``ModelView.attention_heads``); other
cores split by heads only in plans (``auto.split_heads``).
"""
import collections
import dataclasses
import functools
from typing import Dict, Iterable, List, Mapping, Sequence, Set, Tuple

import networkx as nx

from tfpar.ir.contractions import CONTRACTIONS
from tfpar.planner.memory import state_per_weight

__all__ = ["HEAD_OPS", "KERAS_PROJECTIONS", "Layer", "LayerGraph", "attention_layers",
           "critical_positions", "heads_units", "keras_attention", "layer_graph", "subgraphs"]

XENT = frozenset({"SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits"})
LOOKUPS = frozenset({"GatherV2", "ResourceGather"})
ELEMENTWISE = frozenset({"Relu", "Relu6", "Elu", "Selu", "Gelu", "Tanh", "Sigmoid", "Softplus",
                         "Identity", "Cast", "Neg", "Square", "Sqrt", "Rsqrt", "Exp", "Erf",
                         "Mul", "AddV2", "Add", "Sub", "RealDiv", "BiasAdd", "Const",
                         "IdentityN"})  # IdentityN: a custom gradient's (tf.nn.silu's) outputs
READS = frozenset({"ReadVariableOp", "Identity"})
# What an attention core is made of, between its Q K V projection and its output
# projection (dropout, masks and rotary embeddings' half swaps included; a
# fused projection's q, k and v taken by split, by index (GPT-2's
# ``qkv[:, :, 0]``) or by unstack).
HEAD_OPS = CONTRACTIONS | ELEMENTWISE | READS | frozenset({
    "Split", "SplitV", "ConcatV2", "Reshape", "Transpose", "Softmax", "Select", "SelectV2",
    "Maximum", "Minimum", "Greater", "GreaterEqual", "RandomUniform", "Floor", "StridedSlice",
    "Slice", "Unpack", "Squeeze", "ExpandDims"})
# The sublayers keras names a MultiHeadAttention's projections.
KERAS_PROJECTIONS = ("query", "key", "value", "attention_output")


@dataclasses.dataclass(frozen=True)
class Layer:
    """One node of the sharding search.

    Attributes:
      scope: the name scope its ops share (a single op: its name).
      scopes: every name scope among its ops (more than ``scope`` when scopes
        that feed each other both ways were merged): what a plan names to
        build the layer split.
      kind: ``matmul``, ``xent``, ``embedding``, ``elementwise``, ``attention``
        or ``other``.
      flops: forward FLOPs per batch row.
      out_bytes: bytes per row it hands to later layers (its largest output edge).
      activation_bytes: bytes per row its ops keep for the backward pass
        (``ModelView.kept``).
      param_bytes: bytes of the weights it reads.
      input_bytes: bytes per row it reads from the model's inputs (which
        arrive split by rows, as data parallelism feeds them).
      ops: indices of its ops in the model view.
      signature: kind, costs and op types as the layer was read from the
        graph (``identity`` is what makes equal subproblems).
      heads: the heads of the attention core a layer is in (0: none or
        unknown): of its keras MultiHeadAttention (``keras_heads``: tfpar's
        split builds them by heads), or of its raw ops' ``Q K^T`` (split by
        heads with ``auto.split_heads``, when the group's devices divide them:
        each must hold whole heads).
    """

    scope: str
    kind: str
    flops: float
    out_bytes: float
    activation_bytes: float
    param_bytes: float
    input_bytes: float
    ops: Tuple[int, ...]
    signature: Tuple
    scopes: Tuple[str, ...] = ()
    heads: int = 0
    keras_heads: bool = False

    @property
    def identity(self) -> Tuple:
        """Equal identities are equal subproblems: the signature with the
        kind and the inputs from outside as they are now (``attention_layers``
        and ``subgraph`` change them)."""
        return (self.signature, self.kind, self.input_bytes, self.heads, self.keras_heads)


@dataclasses.dataclass(frozen=True)
class LayerGraph:
    """Layers in topological order and (i, j, bytes per row) edges, i < j;
    ``state_per_weight``: bytes of weights, gradients and optimizer slots per
    byte of weights (``memory.state_per_weight``)."""

    layers: Tuple[Layer, ...]
    edges: Tuple[Tuple[int, int, float], ...]
    state_per_weight: float = 4.0

    @functools.cached_property
    def classes(self) -> Tuple[int, ...]:
        """Per layer, a number shared by the layers of equal ``identity``."""
        numbers: Dict[Tuple, int] = {}
        return tuple(numbers.setdefault(layer.identity, len(numbers)) for layer in self.layers)


def layer_graph(view) -> LayerGraph:
    """Group the ops of an ``model_view.ModelView`` (with names and types) into layers."""
    names, types, edges, param_bytes = view.names, view.types, view.edges, view.param_bytes
    consumers: Dict[int, List[int]] = collections.defaultdict(list)
    for i, j, _ in edges:
        consumers[i].append(j)
    key = _layer_keys(names, _weighted_contractions(view))
    for i in reversed(range(len(names))):  # reads of reads follow their final consumer
        if types[i] in READS and param_bytes[i] and consumers[i]:
            key[i] = key[consumers[i][0]]
    dag = nx.DiGraph()
    dag.add_nodes_from(dict.fromkeys(key))
    dag.add_edges_from((key[i], key[j]) for i, j, _ in edges if key[i] != key[j])
    merged = nx.condensation(dag)
    group_of = {scope: merged.graph["mapping"][scope] for scope in dag}
    members: Dict[int, List[int]] = collections.defaultdict(list)
    for i, scope in enumerate(key):
        members[group_of[scope]].append(i)
    order = list(nx.lexicographical_topological_sort(merged, key=lambda g: members[g][0]))
    position = {g: p for p, g in enumerate(order)}
    volume: Dict[Tuple[int, int], float] = collections.defaultdict(float)
    for i, j, size in edges:
        a, b = position[group_of[key[i]]], position[group_of[key[j]]]
        if a != b:
            volume[a, b] += size
    outgoing = collections.defaultdict(float)
    for (a, _), size in volume.items():
        outgoing[a] = max(outgoing[a], size)
    layers = tuple(_layer(tuple(dict.fromkeys(key[i] for i in members[g])), members[g], view,
                          outgoing[position[g]]) for g in order)
    edges = tuple((a, b, s) for (a, b), s in sorted(volume.items()))
    keras, raw = dict(view.attention_heads), dict(view.core_heads)
    core = {}
    for group in attention_layers(layers, edges, view.types):
        parents = {_parent(scope) for k in group for scope in layers[k].scopes or
                   (layers[k].scope,)}
        found = [raw[p] for p in parents if p in raw]
        for k in group:
            parent = _parent(layers[k].scope)
            core[k] = ({"heads": keras[parent], "keras_heads": True} if parent in keras
                       else {"heads": min(found, default=0)})
    layers = tuple(dataclasses.replace(layer, kind="attention", **core[k])
                   if k in core and layer.kind == "other" else layer
                   for k, layer in enumerate(layers))
    return LayerGraph(layers, edges, state_per_weight(view.optimizer_slots))


def keras_attention(scopes: Iterable[str]) -> Set[str]:
    """The name scopes of keras MultiHeadAttention layers among the layer
    scopes ``scopes``: those with all four ``KERAS_PROJECTIONS`` inside."""
    found: Dict[str, Set[str]] = collections.defaultdict(set)
    for scope in scopes:
        parent, _, name = scope.rpartition("/")
        if name in KERAS_PROJECTIONS:
            found[parent].add(name)
    return {parent for parent, names in found.items() if len(names) == len(KERAS_PROJECTIONS)}


def heads_units(planned: Mapping[str, str]) -> Dict[str, str]:
    """A plan's layers split by ``heads`` (``planned``: scope -> candidate)
    as tfpar's split builds them (scope -> "heads"): a keras
    MultiHeadAttention's core as the layer it is in, an attention core of
    raw ops (``auto.split_heads``) as its own ops' scopes (the split of
    their inputs by heads carries through them: ``hooks/head_patches.py``)."""
    keras = keras_attention(planned)
    heads = [scope for scope, how in planned.items() if how == "heads"]
    return {(_parent(scope) if _parent(scope) in keras else scope): "heads" for scope in heads}


def _parent(scope: str) -> str:
    return scope.rpartition("/")[0]


def attention_layers(layers: Sequence[Layer], edges: Sequence[Tuple[int, int, float]],
                     types: Sequence[str]) -> List[List[int]]:
    """The layers of each attention core: weightless layers of ``HEAD_OPS``
    connected (by edges that carry rows) into a group that holds a weightless
    contraction (``Q K^T``), is fed only by weighted contractions (the Q K V
    projection: not by the model's inputs) and feeds only weighted
    contractions (the output projection).
    Split by heads, such a group needs no collective: Megatron's attention
    (Shoeybi et al. 2019, §3), the projections split by columns and rows."""
    fits = {k for k, layer in enumerate(layers) if not layer.param_bytes
            and layer.kind in ("other", "elementwise")
            and all(types[i] in HEAD_OPS for i in layer.ops)}
    carrying = [(i, j) for i, j, size in edges if size]
    groups = nx.Graph()
    groups.add_nodes_from(fits)
    groups.add_edges_from((i, j) for i, j in carrying if i in fits and j in fits)
    producers, consumers = collections.defaultdict(list), collections.defaultdict(list)
    for i, j in carrying:
        producers[j].append(i)
        consumers[i].append(j)
    core = []
    for group in nx.connected_components(groups):
        contracts = any(types[i] in CONTRACTIONS for k in group for i in layers[k].ops)
        feeders = [layers[i].kind for k in group for i in producers[k] if i not in group]
        fed = feeders and set(feeders) == {"matmul"} and not any(
            layers[k].input_bytes for k in group)
        feeds = all(layers[j].kind == "matmul" for k in group for j in consumers[k]
                    if j not in group)
        if contracts and fed and feeds:
            core.append(sorted(group))
    return core


def subgraphs(graph: LayerGraph, groups: Sequence[Sequence[int]]) -> List[LayerGraph]:
    """Per group of layers (each in order, the groups disjoint) its layers and
    the edges among them, the edges read once for all groups; edges from
    other layers become model inputs of their consumer (a pipeline stage
    receives them from the previous stage, split by rows)."""
    where = {m: (g, k) for g, members in enumerate(groups) for k, m in enumerate(members)}
    edges: List[List[Tuple[int, int, float]]] = [[] for _ in groups]
    outside: List[Dict[int, float]] = [collections.defaultdict(float) for _ in groups]
    for i, j, size in graph.edges:
        to = where.get(j)
        if to is None:
            continue
        source = where.get(i)
        if source is not None and source[0] == to[0]:
            edges[to[0]].append((source[1], to[1], size))
        else:
            outside[to[0]][to[1]] += size

    def receiving(g: int, k: int, layer: Layer) -> Layer:
        extra = outside[g].get(k)
        return dataclasses.replace(layer, input_bytes=layer.input_bytes + extra) if extra else layer

    return [LayerGraph(tuple(receiving(g, k, graph.layers[m]) for k, m in enumerate(members)),
                       tuple(edges[g]), graph.state_per_weight)
            for g, members in enumerate(groups)]


def critical_positions(count: int, edges: Sequence[Tuple[int, int, float]]) -> List[int]:
    """Nodes of a DAG in topological order (edges i < j) that no edge jumps
    over, so every path from the first to the last passes them (Rhino's
    critical nodes, §4.3.1); the first and last included."""
    jumped = [0] * (count + 1)
    for i, j, _ in edges:
        if j > i + 1:
            jumped[i + 1] += 1
            jumped[j] -= 1
    critical, running = [], 0
    for k in range(count):
        running += jumped[k]
        if running == 0:
            critical.append(k)
    return critical


def _weighted_contractions(view) -> List[bool]:
    """Ops that contract with a weight (read directly or through a read op)."""
    reads_weights = [view.types[i] in READS and view.param_bytes[i] > 0
                     for i in range(len(view.names))]
    weighted = [view.types[i] in CONTRACTIONS and view.param_bytes[i] > 0
                for i in range(len(view.names))]
    for i, j, _ in view.edges:
        if reads_weights[i] and view.types[j] in CONTRACTIONS:
            weighted[j] = True
    return weighted


def _layer_keys(names: List[str], weighted: List[bool]) -> List[str]:
    """Each op's layer: the outermost name scope around it holding at most one
    weighted contraction (a whole keras / v1 layer, with its shape ops and
    activation); an op with no such scope (at the root, or loose in a block
    of several layers) is a layer of its own."""
    contractions: Dict[str, int] = collections.Counter()
    for name, flag in zip(names, weighted):
        if flag:
            parts = name.split("/")
            for depth in range(1, len(parts)):
                contractions["/".join(parts[:depth])] += 1
    outermost: Dict[str, str] = {}  # by the op's scope ("" when none holds it)
    keys = []
    for name in names:
        scope = name.rpartition("/")[0]
        if scope not in outermost:
            parts = scope.split("/") if scope else []
            outermost[scope] = next(("/".join(parts[:depth]) for depth in range(1, len(parts) + 1)
                                     if contractions["/".join(parts[:depth])] <= 1), "")
        keys.append(outermost[scope] or name)
    return keys


def _layer(scopes: Tuple[str, ...], ops: List[int], view, out_bytes: float) -> Layer:
    types = view.types
    kinds = {types[i] for i in ops}
    weights = sum(view.param_bytes[i] for i in ops)
    if kinds & XENT:
        kind = "xent"
    elif kinds & CONTRACTIONS and weights:
        kind = "matmul"
    elif kinds & LOOKUPS and weights:
        kind = "embedding"
    elif kinds <= ELEMENTWISE | READS:
        kind = "elementwise"
    else:
        kind = "other"
    cost = sum(view.flops[i] for i in ops)
    kept = sum(view.kept[i] for i in ops)
    inputs = sum(view.input_bytes[i] for i in ops) if view.input_bytes else 0.0
    signature = (kind, cost, out_bytes, kept, weights, inputs,
                 tuple(sorted(collections.Counter(types[i] for i in ops).items())))
    return Layer(scopes[0], kind, cost, out_bytes, kept, weights, inputs, tuple(ops), signature,
                 scopes)
