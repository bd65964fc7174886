"""The runtime the hooks call at each seam: ``tfpar.runtime.engine``, set by
``tf_patches.install`` (None while tfpar is off) and looked up at every call.
It provides:

  session_config: (ConfigProto-or-None, graph-or-None) -> ConfigProto for
    new sessions.
  session_target: target -> target for new sessions (a cluster's server).
  before_run: graph -> fetch translator (or None); called before each run,
    before a keras callable is made and before a graph is finalized.
  run_options: (RunOptions-or-None, graph) -> RunOptions for each run (a
    deadline, a trace to profile the step);
  after_run: (graph, RunMetadata-or-None, feed_dict) -> None, after each run that
    succeeded;
  made_callable: graph -> None, after a callable's fetches were translated;
  run_failed: called with the TensorFlow error a run raised (may raise a
    clearer one).
  rewrites_next: graph -> whether its next run rewrites it.
  rewritten: graph -> whether tfpar has rewritten it.
  ran_before_rewrite: (graph, number of variables carried) -> whether a
    session that ran the graph before its rewrite must be reopened
    (called after the rewrite; may raise).
  eager_dataset: dataset -> the dataset eager code iterates over (a
    Horovod process's shard with io.shard_dataset).
  make_iterator: (dataset, make) -> iterator, where ``make(dataset)`` is
    TensorFlow's; may shard the dataset or make more iterators.
  setup_capture: prepares the capture of each new graph (a pinned plan's
    split layers).
  function_gradients: called with the default graph when a tf.GradientTape,
    or tf.gradients inside a tf.function, computes gradients that tfpar
    does not record.
  keras_3_steps: (model name, keras version, jit_compile) -> bool, as a Keras
    3 model makes its train or test function: whether to make it of a
    tf.function called from eager code per batch (tfpar parallelises those).
  rewrite_function: called with each tf.function traced from eager code,
    before TensorFlow makes it a function (it may rewrite the graph).
  before_call: FuncGraph -> None, before each call of a tf.function from
    eager code (a Horovod job's first call of a step broadcasts its variables).
  measured_call: FuncGraph -> None, or ``measure(call, tensor_inputs)``
    that runs a call of its function (``call()``) and measures it; asked
    at every call of a tf.function.
  retraces_relaxed: FuncGraph -> whether to trace its function again
    with the batch dimension of its arguments unknown.
  retrace_failed: (FuncGraph, error) -> None, when that trace raised (the
    first trace then runs; may raise).
  loss_scaled: graph -> whether its gradients are loss-scaled (fp16; may
    raise).
  sync_batch_norm: () -> whether every BatchNormalization layer made now
    is synchronized (``batch_norm.sync``).
"""
from typing import Any

runtime: Any = None
