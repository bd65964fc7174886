"""Bad input gets a tfpar error naming the culprit, never a hang."""
import numpy as np
import pytest
import tensorflow as tf

from equivalence import mlp_classifier

import tfpar as wh
from tfpar.ir.sharding import ShardingUnit
from tfpar.patterns.attention import ATTENTION_PATTERNS
from tfpar.patterns.matcher import choose


def test_scope_asking_for_too_many_devices():
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2})
        with pytest.raises(wh.AnnotationError, match=r"replicate\(3, name='head'\).*only 2"):
            with wh.replicate(3, name="head"):
                pass


@pytest.mark.parametrize("count", [0, -1, 1.5, True, "2"])
def test_bad_device_counts(count):
    with pytest.raises(wh.AnnotationError, match="positive integer"):
        wh.replicate(count)


def test_nested_scopes_rejected():
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2})
        with wh.replicate(2):
            with pytest.raises(wh.AnnotationError, match="nested"):
                with wh.split(2):
                    pass


def test_scope_before_init():
    with tf.Graph().as_default():
        with pytest.raises(wh.AnnotationError, match=r"before wh.init\(\)"):
            with wh.replicate(2):
                pass


def test_bad_config_names_the_key():
    with pytest.raises(wh.ConfigError, match="pipeline.num_micro_batch"):
        wh.init({"pipeline.num_micro_batches": 2})
    with pytest.raises(wh.ConfigError, match="cluster.num_devices"):
        wh.init({"cluster": {"num_devices": -2}})


def test_errors_are_value_errors():
    for err in (wh.ConfigError, wh.AnnotationError, wh.PlanError, wh.ShardingError):
        assert issubclass(err, ValueError)


def test_forced_pattern_that_cannot_shard_the_unit_is_a_sharding_error():
    """split.patterns forcing the cross-entropy's pattern on a dense layer: the matcher
    raises ShardingError, which ``except ConfigError`` / ``except PlanError`` also catch."""
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2, "split.patterns": {"logits": "distributed"}})
        x = tf.compat.v1.placeholder(tf.float32, [None, 6])
        try:
            with pytest.raises(wh.ShardingError, match="split.patterns forces 'distributed' on "
                                                       "ShardingUnit 'logits'.*match it: column, "
                                                       "row") as info:
                with wh.split(2):
                    tf.compat.v1.layers.dense(x, 4, name="logits")
        finally:
            wh.reset()
    assert isinstance(info.value, wh.ConfigError) and isinstance(info.value, wh.PlanError)


def test_a_pattern_the_pinned_plan_forces_and_the_unit_cannot_take_names_the_plan():
    """A keras MultiHeadAttention of 2 heads forced 'heads' by a pinned plan
    on more devices than heads: the error says the plan forced it (before:
    "split.patterns forces", a key the user never set)."""
    class Pinned:
        forced, decisions = {}, {}

        @staticmethod
        def forced_pattern(unit):
            return "heads"
    unit = ShardingUnit("multi_head_attention", "attention", (), {"heads": False, "gathered": 96})
    with pytest.raises(wh.ShardingError, match="the pinned plan forces 'heads' on ShardingUnit "
                                               "'multi_head_attention'.*match it: gather$"):
        choose(Pinned(), unit, ATTENTION_PATTERNS)


def test_an_empty_batch_fails_fast():
    """A batch smaller than the replicas trains (replicas without rows weigh 0,
    test_user_graphs); an empty one is named."""
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 4})
        x = tf.compat.v1.placeholder(tf.float32, [None, 6])
        y = tf.compat.v1.placeholder(tf.int64, [None])
        loss, train_op = mlp_classifier()(x, y)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            with pytest.raises(tf.errors.InvalidArgumentError, match="has no rows"):
                sess.run(train_op, {x: np.zeros((0, 6), np.float32), y: np.zeros(0, np.int64)})


def test_unsupported_pipeline_settings_raise_plan_error():
    """The config refuses an unbuilt schedule (ConfigError); a pinned plan's is
    checked by the planner (PlanError)."""
    def two_stage_plan(config):
        with tf.Graph().as_default():
            wh.init({"cluster.num_devices": 2, "pipeline.num_micro_batch": 2, **config})
            x = tf.compat.v1.placeholder(tf.float32, [None, 6])
            with wh.replicate(1):
                h = tf.compat.v1.layers.dense(x, 4)
            with wh.replicate(1):
                tf.compat.v1.layers.dense(h, 4)
            return wh.current_plan()

    with pytest.raises(wh.ConfigError, match="must be one of .*got 'interleaved'"):
        two_stage_plan({"pipeline.schedule": "interleaved"})
    plan = two_stage_plan({}).to_dict()
    plan["pipeline"]["schedule"] = "interleaved"
    with pytest.raises(wh.PlanError, match="interleaved' is not implemented"):
        two_stage_plan({"plan": plan})


def test_feed_without_batch_input_is_named():
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2})
        w = tf.compat.v1.get_variable("w", initializer=np.ones(3, np.float32))
        loss = tf.reduce_sum(w * w)
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf.compat.v1.Session() as sess:
            with pytest.raises(wh.PlanError, match="no batch input"):
                sess.run(train_op)
