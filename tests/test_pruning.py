"""TAP shared-subgraph pruning and stages that break between repeated blocks."""
from tfpar.planner.partition import partition_stages
from tfpar.planner.pruning import block_labels, shared_blocks


def transformer_names(layers=4):
    """Op names and types of an embedding, ``layers`` identical blocks and a head."""
    names, types = ["embedding/Gather"], ["GatherV2"]
    for i in range(layers):
        for part in ("q", "k", "v", "out"):
            names += [f"layer_{i}/{part}/MatMul", f"layer_{i}/{part}/add"]
            types += ["MatMul", "AddV2"]
        names += [f"layer_{i}/Softmax", f"layer_{i}/add"]
        types += ["Softmax", "AddV2"]
    names += ["head/MatMul", "loss/Mean"]
    types += ["MatMul", "Mean"]
    return names, types


def test_repeated_blocks_are_found_from_the_deepest_level_up():
    names, types = transformer_names()
    levels = shared_blocks(names, types)
    assert sorted(levels[0]) == sorted(f"layer_{i}/{p}" for i in range(4)
                                       for p in ("q", "k", "v", "out"))
    assert sorted(levels[-1]) == [f"layer_{i}" for i in range(4)]
    labels = block_labels(names, types)
    assert labels[0] is None and labels[1] == "layer_0" and labels[-1] is None


def test_no_repeats_no_blocks():
    assert block_labels(["a/x", "b/y"], ["MatMul", "Relu"]) == [None, None]
    assert shared_blocks([], []) == []


def test_stages_break_between_blocks():
    names, types = transformer_names()
    costs = [1.0] * len(names)
    edges = [(i, i + 1, 1.0) for i in range(len(names) - 1)]
    stages = partition_stages(costs, edges, 2, 5.0, block_labels(names, types)).stages
    by_block = {}
    for label, stage in zip(block_labels(names, types), stages):
        if label is not None:
            by_block.setdefault(label, set()).add(stage)
    assert all(len(s) == 1 for s in by_block.values())  # no block is cut
    assert stages == sorted(stages) and set(stages) == {0, 1}
