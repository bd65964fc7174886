"""Shared equivalence harness: train a model plainly and under tfpar, compare.

``build(x, y)`` must create the model in the current default graph from the
input tensors and return ``(loss, train_op)``. The same seeded initial values
are used in both runs, so only parallelisation can make the numbers differ.
"""
import contextlib

import numpy as np
import tensorflow as tf

import tfpar as wh
from proof import assert_parallel

__all__ = ["assert_equivalent", "assert_same_variables", "checkpoint_session", "deep_mlp", "dense",
           "fed_graph", "initialized", "make_data", "mlp_classifier", "plan_of", "rewritten_op_types", "train",
           "variable_values"]


def dense(x, units, name, seed, activation=None):
    """A dense layer whose initial values come from numpy (deterministic across graphs)."""
    rng = np.random.RandomState(seed)
    fan_in = int(x.shape[-1])
    with tf.compat.v1.variable_scope(name):
        kernel = tf.compat.v1.get_variable(
            "kernel", initializer=(rng.randn(fan_in, units) / np.sqrt(fan_in)).astype(np.float32))
        bias = tf.compat.v1.get_variable(
            "bias", initializer=(0.1 * rng.randn(units)).astype(np.float32))
        out = tf.matmul(x, kernel) + bias
    return activation(out) if activation is not None else out


def layer(h, units, name, seed, activation=None):
    """tf.compat.v1.layers.dense with numpy initial values (same in every run)."""
    rng = np.random.RandomState(seed)
    kernel = (rng.randn(int(h.shape[-1]), units) / np.sqrt(int(h.shape[-1]))).astype(np.float32)
    return tf.compat.v1.layers.dense(
        h, units, activation, name=name,
        kernel_initializer=tf.compat.v1.constant_initializer(kernel),
        bias_initializer=tf.compat.v1.constant_initializer(0.1 * rng.randn(units)))


def mlp_classifier(optimizer=lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5),
                   hidden=8, classes=3, global_step=False):
    """build(x, y) for a 2-layer MLP with a mean softmax cross-entropy loss
    (and, with ``global_step``, the graph's global step counting its steps)."""
    def build(x, y):
        h = dense(x, hidden, "hidden", seed=1, activation=tf.nn.tanh)
        logits = dense(h, classes, "logits", seed=2)
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
        step = tf.compat.v1.train.get_or_create_global_step() if global_step else None
        return loss, optimizer().minimize(loss, global_step=step)
    return build


def deep_mlp(layers, make=None):
    """build(x, y) for ``layers`` tanh layers of width 8 and a 3-class head, no
    scopes (for tfpar's automatic partitions), plain SGD; each layer made by
    ``make`` (``dense``, matmuls on variables, when None; ``layer``:
    ``tf.compat.v1.layers.dense``)."""
    make = make or dense

    def build(x, y):
        h = x
        for i in range(layers):
            h = make(h, 8, f"layer{i}", seed=i, activation=tf.nn.tanh)
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, make(h, 3, "logits", seed=9))
        return loss, tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


def make_data(steps, batch, features=6, classes=3, seed=0):
    rng = np.random.RandomState(seed)
    xs = rng.randn(steps, batch, features).astype(np.float32)
    ys = rng.randint(0, classes, size=(steps, batch)).astype(np.int64)
    return xs, ys


def train(build, data, tfpar_config=None, use_dataset=False, session="plain",
          scope=None, static_batch=False, timelines=None):
    """Train for len(data[0]) steps; return (losses, {var name: value}).

    ``data`` is (xs, ys): ``xs[step]`` is the batch fed to ``x`` (any dtype and
    rank), ``ys[step]`` the int64 labels fed to ``y``.

    Args:
      tfpar_config: None for plain TF, else a config for wh.init.
      use_dataset: feed through a tf.data iterator instead of feed_dict.
      session: "plain" (tf.compat.v1.Session) or "monitored".
      scope: optional callable returning a context manager around the model.
      static_batch: declare the batch size in the graph (placeholders of shape
        ``[B, ...]``, ``batch(B, drop_remainder=True)``).
      timelines: a list; each step of a graph tfpar rewrote appends its
        ``wh.step_timeline`` (the tasks each stage device ran, in order).
    """
    xs, ys = data
    graph = tf.Graph()
    with graph.as_default():
        if tfpar_config is not None:
            wh.init(tfpar_config)
        if use_dataset:
            ds = tf.data.Dataset.from_tensor_slices(
                (xs.reshape(-1, *xs.shape[2:]), ys.reshape(-1))).batch(
                    xs.shape[1], drop_remainder=static_batch)
            x, y = tf.compat.v1.data.make_one_shot_iterator(ds).get_next()
            feeds = [None] * len(xs)
        else:
            rows = xs.shape[1] if static_batch else None
            x = tf.compat.v1.placeholder(tf.as_dtype(xs.dtype), [rows, *xs.shape[2:]], name="x")
            y = tf.compat.v1.placeholder(tf.int64, [rows], name="y")
            feeds = [{x: a, y: b} for a, b in zip(xs, ys)]
        if scope is not None:
            with scope():
                loss, train_op = build(x, y)
        else:
            loss, train_op = build(x, y)
        variables = tf.compat.v1.global_variables()
        losses = []
        if session == "monitored":
            with tf.compat.v1.train.MonitoredTrainingSession() as sess:
                for feed in feeds:
                    losses.append(_step(sess, [loss, train_op], feed, timelines))
                values = variable_values(sess, variables)
        else:
            init = tf.compat.v1.global_variables_initializer()
            with tf.compat.v1.Session() as sess:
                sess.run(init)
                for feed in feeds:
                    losses.append(_step(sess, [loss, train_op], feed, timelines))
                values = variable_values(sess, variables)
    if tfpar_config is not None:
        wh.reset()
    return np.array(losses), values


def _step(sess, fetches, feed, timelines):
    """The loss of one step (``fetches``: loss, train op); with ``timelines``,
    the step traced and, if tfpar rewrote the graph, its timeline appended
    (a graph left alone appends nothing: ``assert_equivalent`` says so)."""
    if timelines is None:
        return sess.run(fetches, feed)[0]
    metadata = tf.compat.v1.RunMetadata()
    loss = sess.run(fetches, feed, run_metadata=metadata, options=tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE))[0]
    try:
        timelines.append(wh.step_timeline(metadata))
    except wh.PlanError:
        pass
    return loss


def checkpoint_session(build, path_in, path_out, config, data, saver_after_first_run=False):
    """Restore ``path_in`` (or initialize), train ``build`` on ``data``, save to
    ``path_out``; returns (losses, {variable name: value}) like ``train``."""
    graph = tf.Graph()
    with graph.as_default():
        if config:
            wh.init(config)
        x = tf.compat.v1.placeholder(tf.float32, [None, data[0].shape[-1]])
        y = tf.compat.v1.placeholder(tf.int64, [None])
        loss, train_op = build(x, y)
        init = tf.compat.v1.global_variables_initializer()
        saver = None if saver_after_first_run else tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(init)
            if saver is None:
                saver = tf.compat.v1.train.Saver()
            if path_in:
                saver.restore(sess, path_in)
            losses = [sess.run([loss, train_op], {x: a, y: b})[0] for a, b in zip(*data)]
            if path_out:
                saver.save(sess, path_out)
            values = variable_values(sess, tf.compat.v1.global_variables())
    if config:
        wh.reset()
    return np.array(losses), values


def variable_values(sess, variables):
    """{single-device name: value}; the slices of a partitioned (split) variable
    are put back together under the name of the whole."""
    raw = sess.run({v.op.name: v for v in variables})
    values = {}
    for v in variables:
        info = getattr(v, "_save_slice_info", None)
        if info is None:
            values[v.op.name] = raw[v.op.name]
            continue
        whole = values.setdefault(info.full_name, np.zeros(info.full_shape, raw[v.op.name].dtype))
        whole[tuple(slice(o, o + n) for o, n in zip(info.var_offset, info.var_shape))] = \
            raw[v.op.name]
    return values


def plan_of(build, tfpar_config, dtype=tf.float32, shape=(None, 6)):
    """wh.current_plan() of ``build`` (inputs of ``dtype``/``shape`` and int64
    labels), built in a fresh graph without running it."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init(tfpar_config)
        build(tf.compat.v1.placeholder(dtype, list(shape)),
              tf.compat.v1.placeholder(tf.int64, [None]))
        plan = wh.current_plan()
    wh.reset()
    return plan


def rewritten_op_types(build, tfpar_config, features=6):
    """Types of every op in the graph tfpar made of ``build`` (rewritten at the
    first run: the initializer)."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init(tfpar_config)
        x = tf.compat.v1.placeholder(tf.float32, [None, features])
        y = tf.compat.v1.placeholder(tf.int64, [None])
        build(x, y)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
    wh.reset()
    return [op.type for op in graph.get_operations()]


def traced_first_step(train_op, feed):
    """The RunMetadata of one fully traced run of ``train_op`` fed ``feed``,
    in a new session of the default graph, after the variables' initializer."""
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        metadata = tf.compat.v1.RunMetadata()
        sess.run(train_op, feed, run_metadata=metadata, options=tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
    return metadata


def assert_same_variables(reference, candidate, rtol=1e-5, atol=1e-6):
    """``reference`` and ``candidate`` are {variable name: value}; every graph
    tfpar rewrote since the last check must have run its plan."""
    assert_equivalent((np.zeros(1), reference), (np.zeros(1), candidate), rtol, atol)


def assert_equivalent(reference, candidate, rtol=1e-5, atol=1e-6, parallel=True):
    """Same losses and variables, and (unless ``parallel`` is False: two plain
    runs compared) every graph tfpar rewrote since the last check ran its plan,
    at least one did (``proof.assert_parallel``)."""
    if parallel:
        assert_parallel()
    ref_losses, ref_vars = reference
    losses, values = candidate
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol, atol=atol,
                               err_msg="per-step losses differ")
    assert sorted(values) == sorted(ref_vars), "different variables"
    for name in ref_vars:
        np.testing.assert_allclose(values[name], ref_vars[name], rtol=rtol, atol=atol,
                                   err_msg=f"variable {name} differs")


@contextlib.contextmanager
def fed_graph(config):
    """A new default graph, with ``wh.init(config)`` first unless ``config`` is
    None, holding placeholders x ``[None, 6]`` and y ``[None]``: yields
    (graph, x, y); ``wh.reset()`` on exit."""
    graph = tf.Graph()
    try:
        with graph.as_default():
            if config is not None:
                wh.init(config)
            yield (graph, tf.compat.v1.placeholder(tf.float32, [None, 6]),
                   tf.compat.v1.placeholder(tf.int64, [None]))
    finally:
        if config is not None:
            wh.reset()


@contextlib.contextmanager
def initialized(build, config):
    """The graph of ``build`` on ``fed_graph``'s placeholders, built under
    ``config`` and initialized once (tfpar rewrites it then); ``wh.reset()`` on
    exit."""
    with fed_graph(config) as (graph, x, y):
        build(x, y)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
        yield graph
