"""tfpar online tuning of k (Ada-Grouper §5): what moving k buys and what it costs.

Simulated (the planner's models, nothing run; the paper's Fig. 10 setting): a
pipeline of ``--stages`` equal stages (forward 1 ms, backward 2 ms per
micro-batch) and ``--micro`` micro-batches trains through network phases of
``--phase-steps`` steps each, whose cross-stage transfer takes 0.1, 3, 6, 0.5
and 3 ms. Per phase: the step of 1F1B (k = 1); of the k tuned once, before the
first phase (what ``pipeline.group_size: "auto"`` gives without online tuning);
and of online tuning (``runtime.retune.GroupRetuner`` profiling every
``--every``-th step's simulated timeline, so a phase's first steps run the
previous phase's k). Memory fits k up to half the micro-batches.

Measured (TensorFlow, 4 logical CPU devices): a ``--layers``-layer transformer
(``benchmarks/startup.py``'s, hidden ``--hidden``) in 4 ``wh.replicate(1)``
stages with 8 micro-batches, kFkB with k = 1: its start-up (session, rewrite,
first step), step and traced step (what a profiled step costs); the first run
of the train op alone (TensorFlow makes an executor for every new set of
fetches: what any new fetch costs once); then what moving to k = 2 costs, as
the tuner does it (``FetchTranslator.use_group_size``): building the k = 2 pipeline, its first
step, its step; and the first step back at k = 1 (built before: nothing to
build). The losses of the moved steps must equal those of the same steps
without moving (a second run at k = 1 throughout, rtol 1e-5).

Targets (at most): online / 1F1B step over all phases 0.9 (the paper: 4-30%
faster than 1F1B under preemption); online / tuned-once 1.0; building a k
and its first step / start-up 1.0 (less than starting again, which would
also write and read a checkpoint); the first step back / a step 3.

    python benchmarks/retune.py [--quick] [--check] [--json]

(2 cores, 2026-11-25: about 15 seconds, ``--quick`` 10.)
"""
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from tfpar.runtime.graph_state import existing_state  # noqa: E402
from tfpar.planner.grouper import tune_group_size  # noqa: E402
from tfpar.ir.schedule import build_schedule  # noqa: E402
from tfpar.ir.simulate import simulate  # noqa: E402
from tfpar.runtime.retune import GroupRetuner  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import cell, meets, parse_sizes, ratio, report  # noqa: E402  (same directory)
import startup  # noqa: E402

v1 = tf.compat.v1
FORWARD_MS, BACKWARD_MS = 1.0, 2.0
PHASES_MS = (0.1, 3.0, 6.0, 0.5, 3.0)
TARGETS = {"online_1f1b": 0.9, "online_once": 1.0, "build_startup": 1.0, "back_step": 3.0}
SIZES = {"stages": (4, 4, "pipeline stages (simulated)"),
         "micro": (16, 8, "micro-batches (simulated)"),
         "phase_steps": (30, 12, "steps per network phase (simulated)"),
         "every": (5, 4, "profile one step in this many (simulated)"),
         "layers": (4, 2, "transformer layers (measured; >= 2)"),
         "hidden": (128, 32, "hidden size (measured; a multiple of 4)"),
         "seq": (32, 8, "sequence length (measured)"),
         "batch": (32, 32, "global batch (measured; a multiple of 32)"),
         "steps": (5, 3, "timed steps per k (measured)")}


def simulated(args):
    """Per phase: transfer ms and the mean step ms of 1F1B, the k tuned once
    and online tuning (with the k it ended the phase at)."""
    stages, micro = args.stages, args.micro
    forward, backward = [FORWARD_MS] * stages, [BACKWARD_MS] * stages
    # One micro-batch's activations weigh 1; k up to micro / 2 fits.
    memory = dict(fixed_bytes=[0.0] * stages, activation_bytes=[1.0] * stages,
                  memory_limit=float(micro // 2 * stages))
    once = tune_group_size(micro, forward, backward, PHASES_MS[0], **memory)
    retuner = GroupRetuner(micro, stages, once, every=args.every, tolerance=0.05, **memory)

    def length(k, transfer):
        return simulate(build_schedule("kfkb", stages, micro, k), forward, backward,
                        transfer)

    rows = []
    for transfer in PHASES_MS:
        online = []
        for _ in range(args.phase_steps):
            result = length(retuner.group_size, transfer)
            online.append(result.length)
            if retuner.profile_due():
                retuner.profiled(result.tasks)
        rows.append({"transfer_ms": transfer, "one_f_one_b_ms": length(1, transfer).length,
                     "once_ms": length(once, transfer).length, "once_k": once,
                     "online_ms": statistics.fmean(online), "online_k": retuner.group_size})
    return rows


def measured(args):
    """Start-up, steps and the cost of moving k on the transformer; and
    whether the moved steps' losses equal those of a run that did not move."""
    v1.disable_eager_execution()
    config = {"cluster.num_devices": 4, "pipeline.num_micro_batch": 8,
              "pipeline.schedule": "kfkb", "pipeline.group_size": 1}
    runs = [_run(args, config, move) for move in (True, False)]
    return {**runs[0][0], "same_loss": bool(np.allclose(runs[0][1], runs[1][1], rtol=1e-5))}


def _run(args, config, move):
    """(times, losses) of one run: k = 1; with ``move``, k = 2 then k = 1 again."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init(config)
        feed, loss, train = startup.build(args, startup.STAGES)  # the same batch every run
        init = v1.global_variables_initializer()
    losses = []

    def step(**traced):
        begin = time.perf_counter()
        losses.append(float(sess.run([loss, train], feed, **traced)[0]))
        return time.perf_counter() - begin

    def steady(**traced):
        return statistics.median(step(**traced) for _ in range(args.steps))

    start = time.perf_counter()
    sess = v1.Session(graph=graph, config=v1.ConfigProto(device_count={"CPU": 4}))
    sess.run(init)
    step()
    times = {"startup_s": time.perf_counter() - start, "step_s": steady()}
    times["traced_step_s"] = steady(  # what a profiled step costs
        options=v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE),
        run_metadata=v1.RunMetadata())
    begin = time.perf_counter()
    sess.run(train, feed)  # another fetch set: TensorFlow makes it an executor
    times["new_fetches_s"] = time.perf_counter() - begin
    if move:
        begin = time.perf_counter()
        existing_state(graph).rewrite.use_group_size(2, build_schedule("kfkb", 4, 8, 2))
        times["build_s"] = time.perf_counter() - begin
        times["first_k2_s"], times["step_k2_s"] = step(), steady()
        existing_state(graph).rewrite.use_group_size(1, build_schedule("kfkb", 4, 8, 1))
        times["first_back_s"] = step()
    else:
        for _ in range(args.steps + 2):
            step()
    sess.close()
    wh.reset()
    return times, losses


def targets(sim, real):
    def total(key):
        return sum(r[key] for r in sim)
    return [("online / 1F1B step (all phases)", ratio(total("online_ms"), total("one_f_one_b_ms")),
             TARGETS["online_1f1b"]),
            ("online / tuned-once step", ratio(total("online_ms"), total("once_ms")),
             TARGETS["online_once"]),
            ("(build k + its first step) / start-up",
             ratio(real["build_s"] + real["first_k2_s"], real["startup_s"]),
             TARGETS["build_startup"]),
            ("its first step / train_op's first run", ratio(real["first_k2_s"],
                                                             real["new_fetches_s"]), None),
            ("traced (profiled) step / step", ratio(real["traced_step_s"], real["step_s"]), None),
            ("first step back / step", ratio(real["first_back_s"], real["step_s"]),
             TARGETS["back_step"])]


def print_table(rows, found, args):
    sim, real = rows["simulated"], rows["measured"]
    print(f"simulated: {args.stages} stages, {args.micro} micro-batches, forward "
          f"{FORWARD_MS:g} ms, backward {BACKWARD_MS:g} ms, {args.phase_steps} steps per "
          f"phase, a profile every {args.every} steps")
    print(f"{'transfer ms':>11}  {'1F1B ms':>8}  {'once ms':>8}  {'k':>2}  {'online ms':>9}  "
          f"{'k':>2}  {'/ 1F1B':>6}")
    for r in sim:
        print(f"{r['transfer_ms']:>11g}  {r['one_f_one_b_ms']:>8.1f}  {r['once_ms']:>8.1f}  "
              f"{r['once_k']:>2}  {r['online_ms']:>9.1f}  {r['online_k']:>2}  "
              f"{r['online_ms'] / r['one_f_one_b_ms']:>6.2f}")
    print(f"measured: transformer {args.layers}x{args.hidden}, seq {args.seq}, batch "
          f"{args.batch}, 4 stages, 8 micro-batches, 4 logical CPUs")
    for title, key in (("start-up (k=1)", "startup_s"), ("step (k=1)", "step_s"),
                       ("traced step (k=1)", "traced_step_s"),
                       ("first run of train_op alone", "new_fetches_s"),
                       ("build the k=2 pipeline", "build_s"), ("its first step", "first_k2_s"),
                       ("step (k=2)", "step_k2_s"), ("first step back at k=1", "first_back_s")):
        print(f"{title:<26} {cell(real.get(key), '.3f'):>8} s")
    print(f"{'same losses as not moving':<26} {cell(real['same_loss'], ''):>8}")
    for name, value, limit in found:
        verdict = ("(information)" if limit is None else
                   f"<= {limit:<4}  {'met' if meets(value, limit) else 'NOT MET'}")
        print(f"{name:<40} {cell(value, '.3f'):>7}  {verdict}")


def main(argv=None):
    _, args = parse_sizes(__doc__.split("\n", 1)[0], SIZES, argv,
                          "exit 1 when a target is missed or a moved step's loss differs",
                          "small sizes (smoke test, about 20 seconds)")
    sim, real = simulated(args), measured(args)
    return report({"simulated": sim, "measured": real}, targets(sim, real), args, SIZES,
                  print_table, checks_ok=real["same_loss"])


if __name__ == "__main__":
    sys.exit(main())
