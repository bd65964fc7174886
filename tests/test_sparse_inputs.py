"""SparseTensor batch inputs (issue 12, cause 3) are cut by rows: a
``VarLenFeature`` parsed in the input pipeline (it leaves the iterator as a
variant tensor) and a ``sparse_placeholder`` fed a ``SparseTensorValue``,
read by ``safe_embedding_lookup_sparse`` and ``sparse_dense_matmul``, with
Adagrad and FTRL (whose slots must end equal too), rows with no entries, an
uneven last batch, and a pipeline whose narrower stage reads several replicas'
rows of the sparse input at once. Before, the rewrite refused the variant
("composite tensor") and split a sparse placeholder's indices as if they were
rows."""
import numpy as np
import pytest
import tensorflow as tf

from equivalence import assert_equivalent

import tfpar as wh

v1 = tf.compat.v1
RNG = np.random.RandomState(3)
ROWS, BATCH, VOCAB, FEATURES = 28, 8, 12, 3
IDS = [RNG.choice(VOCAB, RNG.randint(0, 4), replace=False) for _ in range(ROWS)]  # some empty
DENSE = RNG.randn(ROWS, FEATURES).astype(np.float32)
LABELS = RNG.randint(0, 2, ROWS).astype(np.int64)
OPTIMIZERS = {"adagrad": lambda: v1.train.AdagradOptimizer(0.3),
              "ftrl": lambda: v1.train.FtrlOptimizer(0.3, l1_regularization_strength=0.01)}
CONFIGS = {"dp4": {"cluster.num_devices": 4},
           "accumulate": {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2}}


def examples():
    """The rows as serialized tf.Examples: a variable-length id list, dense features, a label."""
    records = []
    for ids, x, y in zip(IDS, DENSE, LABELS):
        feature = {"ids": tf.train.Feature(int64_list=tf.train.Int64List(value=ids)),
                   "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
                   "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y]))}
        records.append(tf.train.Example(features=tf.train.Features(feature=feature))
                       .SerializeToString())
    return records


def parsed_input(drop_remainder):
    spec = {"ids": tf.io.VarLenFeature(tf.int64),
            "x": tf.io.FixedLenFeature([FEATURES], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.int64)}
    ds = tf.data.Dataset.from_tensor_slices(examples()).batch(
        BATCH, drop_remainder=drop_remainder).map(lambda r: tf.io.parse_example(r, spec))
    return v1.data.make_one_shot_iterator(ds).get_next()


def sliced_input(drop_remainder):
    """The ids as one SparseTensor [ROWS, VOCAB] cut into batches by tf.data."""
    indices = [[r, i] for r, ids in enumerate(IDS) for i in sorted(ids)]
    ids = tf.SparseTensor(np.array(indices, np.int64), np.array([i for _, i in indices]),
                          [ROWS, VOCAB])
    ds = tf.data.Dataset.from_tensor_slices({"ids": ids, "x": DENSE, "y": LABELS}).batch(
        BATCH, drop_remainder=drop_remainder)
    return v1.data.make_one_shot_iterator(ds).get_next()


def embedding_model(ids, x, y, optimizer, stages=None):
    """Mean embedding of the ids next to the dense features, a logistic head;
    ``stages``: scope of the embedding and of the head."""
    embed_scope, head_scope = stages or (_nothing(), _nothing())
    with embed_scope:
        table = v1.get_variable("table", initializer=RNG.randn(VOCAB, 4).astype(np.float32))
        embedded = tf.nn.safe_embedding_lookup_sparse(table, ids, combiner="mean")
    with head_scope:
        h = tf.concat([embedded, x], 1)
        w = v1.get_variable("w", initializer=RNG.randn(4 + FEATURES, 2).astype(np.float32))
        loss = v1.losses.sparse_softmax_cross_entropy(y, tf.matmul(h, w))
    return loss, optimizer().minimize(loss), None


class _nothing:  # pylint: disable=invalid-name
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run(build, config):
    """(losses, variables) of training ``build()`` -> (loss, train_op, feeds)
    plainly or under ``config``, over ``feeds`` (feed dicts) or, for None,
    until the input ends."""
    graph = tf.Graph()
    with graph.as_default():
        RNG.seed(7)
        if config is not None:
            wh.init(config)
        loss, train_op, feeds = build()
        variables = v1.global_variables()
        losses = []
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for feed in feeds or iter(dict, None):
                try:
                    losses.append(sess.run([loss, train_op], feed)[0])
                except tf.errors.OutOfRangeError:
                    break
            values = {v.op.name: sess.run(v) for v in variables}
    if config is not None:
        wh.reset()
    return np.array(losses), values


@pytest.mark.parametrize("drop_remainder", [False, True], ids=["keep", "drop"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("source", ["parsed", "sliced"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_sparse_features_from_tf_data(config, source, optimizer, drop_remainder):
    """A VarLenFeature parsed from tf.Examples, or a SparseTensor cut into batches."""
    def build():
        features = (parsed_input if source == "parsed" else sliced_input)(drop_remainder)
        return embedding_model(features["ids"], features["x"], features["y"],
                               OPTIMIZERS[optimizer])
    plain = run(build, None)
    assert len(plain[0]) == (ROWS // BATCH if drop_remainder else -(-ROWS // BATCH))
    assert_equivalent(plain, run(build, CONFIGS[config]), rtol=1e-4, atol=1e-5)


def sparse_feeds(ids, x, y, values):
    """Feed dicts of ``BATCH`` rows each (the last one shorter); ``ids`` is fed
    the rows' ids as a [rows, VOCAB] matrix of ``values[id]``."""
    feeds = []
    for start in range(0, ROWS, BATCH):
        rows = IDS[start:start + BATCH]
        indices = [[r, k] for r, row in enumerate(rows) for k in range(len(row))]
        flat = np.concatenate(rows).astype(np.int64)
        feeds.append({ids: tf.compat.v1.SparseTensorValue(
            np.array(indices, np.int64).reshape(-1, 2),
            values[flat], [len(rows), VOCAB]),
            x: DENSE[start:start + BATCH], y: LABELS[start:start + BATCH]})
    return feeds


@pytest.mark.parametrize("config", list(CONFIGS))
def test_sparse_placeholder_through_sparse_dense_matmul(config):
    """A bag of weighted ids as a sparse [batch, vocab] matrix times a weight matrix."""
    weights = RNG.rand(VOCAB).astype(np.float32)

    def build():
        sp = v1.sparse_placeholder(tf.float32, [None, VOCAB], name="bag")
        x = v1.placeholder(tf.float32, [None, FEATURES])
        y = v1.placeholder(tf.int64, [None])
        w = v1.get_variable("w", initializer=RNG.randn(VOCAB, 2).astype(np.float32))
        v = v1.get_variable("v", initializer=RNG.randn(FEATURES, 2).astype(np.float32))
        logits = tf.sparse.sparse_dense_matmul(sp, w) + tf.matmul(x, v)
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, OPTIMIZERS["ftrl"]().minimize(loss), sparse_feeds(sp, x, y, weights)
    assert_equivalent(run(build, None), run(build, CONFIGS[config]), rtol=1e-4, atol=1e-5)


def test_a_narrow_stage_reads_the_rows_of_several_replicas():
    """Stage 0 (1 replica) holds the rows of both replicas of stage 1: its
    slice of the sparse input spans two pieces of the batch."""
    def build(parallel):
        features = parsed_input(False)
        stages = (wh.replicate(1), wh.replicate(2)) if parallel else None
        return embedding_model(features["ids"], features["x"], features["y"],
                               OPTIMIZERS["adagrad"], stages)
    assert_equivalent(run(lambda: build(False), None),
                      run(lambda: build(True), {"cluster.num_devices": 3}),
                      rtol=1e-4, atol=1e-5)
