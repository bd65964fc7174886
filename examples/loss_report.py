"""Shared by the examples: their common flags, and the per-step losses of the
single-device and tfpar runs side by side."""
import argparse
import contextlib

import tensorflow as tf
from tensorflow.python.eager import context

import tfpar as wh


def example_parser(doc: str, devices: int, batch: int, steps=None) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line with the flags every example
    takes: --devices, --batch, and --steps when it trains by steps."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--devices", type=int, default=devices)
    parser.add_argument("--batch", type=int, default=batch)
    if steps is not None:
        parser.add_argument("--steps", type=int, default=steps)
    return parser


def train_steps(loss, train_op, feeds):
    """Initialize, run a training step per feed dict; returns (losses, where
    the last step ran: ``tfpar.step_devices`` of its trace)."""
    options, metadata = traced_step_options()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        losses = [sess.run([loss, train_op], feed)[0] for feed in feeds[:-1]]
        losses.append(sess.run([loss, train_op], feeds[-1], options=options,
                               run_metadata=metadata)[0])
    return losses, wh.step_devices(metadata)


def traced_step_options():
    """(options, run_metadata) that make a Session.run trace the step it runs."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    return options, tf.compat.v1.RunMetadata()


class TracedStepHook(tf.compat.v1.train.SessionRunHook):
    """Traces every step of an Estimator / MonitoredTrainingSession; keeps where
    the last one ran (``tfpar.step_devices``) in ``devices``."""

    def __init__(self):
        self.devices = {}

    def before_run(self, run_context):
        return tf.compat.v1.train.SessionRunArgs(None, options=traced_step_options()[0])

    def after_run(self, run_context, run_values):
        self.devices = wh.step_devices(run_values.run_metadata, run_context.session.graph)


@contextlib.contextmanager
def traced_functions():
    """Inside, TensorFlow keeps the placed graphs of the tf.functions an eager
    script runs (run metadata and graph collection on), which
    ``devices_that_worked`` reads."""
    eager = context.context()
    eager.enable_run_metadata()
    eager.enable_graph_collection()
    try:
        yield
    finally:
        eager.disable_graph_collection()
        eager.disable_run_metadata()


def devices_that_worked() -> list:
    """Devices of the ops the tf.functions run so far (in ``traced_functions``)
    were placed on (TensorFlow's partition graphs; data transfers left out)."""
    metadata = context.context().export_run_metadata()
    return sorted({node.device.split("device:")[-1] for fn in metadata.function_graphs
                   for graph in fn.partition_graphs for node in graph.node
                   if node.op not in ("_Arg", "_Retval", "_Send", "_Recv", "_HostSend",
                                      "_HostRecv", "Const", "NoOp", "Identity")})


def print_devices(counts) -> None:
    """The ops a traced step ran per TaskGraph and device (``tfpar.step_devices``)."""
    print("traced step ran:")
    for owner, devices in counts.items():
        print(f"  {owner}: " + ", ".join(f"{d} ({n})" for d, n in devices.items()))


def report(plain, parallel, label="tfpar", tolerance=1e-4) -> int:
    """Print the table and the verdict; returns the exit code (0 if equivalent)."""
    print(f"\n{'step':>4}  {'1 device':>10}  {label:>10}  {'|diff|':>9}")
    for i, (a, b) in enumerate(zip(plain, parallel)):
        print(f"{i:>4}  {a:>10.6f}  {b:>10.6f}  {abs(a - b):>9.2e}")
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(plain, parallel))
    print(f"\nlargest relative difference: {worst:.2e} "
          f"({'equivalent' if worst < tolerance else 'NOT equivalent'})")
    return 0 if worst < tolerance else 1
