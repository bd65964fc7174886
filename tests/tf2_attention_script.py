"""A TF2 script training ``keras_transformer``'s text classifier with ``fit``,
run by ``test_split_attention.py`` in a fresh process (TensorFlow makes logical
CPU devices only before its first op).

    python tf2_attention_script.py DEVICES HEADS DIR [MODE]

DEVICES 0 trains plainly; otherwise ``wh.init({"cluster.num_devices":
DEVICES})`` comes first and MODE says how the model is parallel: ``split``
(the default: the transformer block is made and called in ``wh.split()`` and
the layers before and after it in ``wh.replicate()``), ``replicas`` (no
scopes: data parallelism), ``sequence`` (as ``split``, with
``split.sequence_parallel``) or ``stages`` (the embeddings in one
``wh.replicate(1)`` stage, the rest in another, 4 micro-batches).
Saves a ``tf.train.Checkpoint`` of the model and its optimizer in DIR and
prints one JSON line: the losses, every value of that checkpoint
(split weights and their optimizer slots are saved whole under their
single-device keys), the devices that ran work in the step's placed graphs
(and those that ran LayerNormalization moments),
the plan's devices, TaskGraphs (strategy, device count) and the split
TaskGraph's patterns, and the devices of the attention kernels' shards.
"""
import contextlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

import tfpar as wh  # noqa: E402
from keras_transformer import block, fit, text_classifier  # noqa: E402
from tf2_script import planned_devices, strategies, working_devices  # noqa: E402


def stage():
    return wh.replicate(1)


MODES = {"split": ((wh.split, wh.replicate), {}), "replicas": ((), {}),
         "sequence": ((wh.split, wh.replicate), {"split.sequence_parallel": True}),
         "stages": ((stage, stage, contextlib.nullcontext), {"pipeline.num_micro_batch": 4})}


def main(devices: int, heads: int, directory: str, mode: str = "split") -> dict:
    scopes, config = MODES[mode] if devices else ((), {})
    if devices:
        wh.init({"cluster.num_devices": devices, **config})
    tf.keras.utils.set_random_seed(1)
    context.context().enable_run_metadata()
    context.context().enable_graph_collection()
    model = text_classifier(heads, *scopes)
    losses = fit(model)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        os.path.join(directory, "ckpt"))
    reader = tf.train.load_checkpoint(path)
    saved = {key: reader.get_tensor(key).tolist()
             for key in reader.get_variable_to_shape_map() if "OBJECT_GRAPH" not in key}
    attention = block(model).attention
    projections = (attention._query_dense, attention._key_dense, attention._value_dense,
                   attention._output_dense)
    metadata = context.context().export_run_metadata()
    return {"losses": losses, "saved": saved, "devices": working_devices(metadata),
            "norm_devices": sorted({node.device for function in metadata.function_graphs
                                    for graph in function.partition_graphs for node in graph.node
                                    if "layer_normalization/moments" in node.name}),
            "planned": planned_devices() if devices else [],
            "strategies": strategies() if devices else [],
            "patterns": [tg.patterns for tg in wh.current_plan().task_graphs
                         if tg.strategy == "split"] if devices else [],
            "shards": [sorted(shard.device for shard in layer.kernel)
                       for layer in projections if not isinstance(layer.kernel, tf.Variable)]}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:5])))
