"""auto.auto_parallel's sharding search, end to end: plans found on a model
built plainly, pinned, built split, and trained like one device."""
import tensorflow as tf

from equivalence import assert_equivalent, dense, layer, make_data, plan_of, train

v1 = tf.compat.v1
CLASSES = 8000


def classifier(x, y):
    """A small backbone and a wide classification head, no scopes."""
    features = dense(x, 256, "features", seed=1, activation=tf.nn.tanh)
    logits = layer(features, CLASSES, "logits", seed=2)
    loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
    return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)


def test_wide_head_is_split_and_backbone_replicated():
    config = {"auto.auto_parallel": True, "cluster.num_devices": 4}
    plan = plan_of(classifier, config)
    print(plan.summary())
    assert plan.sharding["layers"]["logits"] == "column"
    data = make_data(steps=3, batch=8, classes=CLASSES)
    pinned = {**config, "plan": plan.to_dict()}
    assert_equivalent(train(classifier, data), train(classifier, data, pinned))
    built = plan_of(classifier, pinned)
    print(built.summary())
