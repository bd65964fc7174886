"""Ops as they are made: each joins the open scope and phase; a placeholder
declared with a static batch dimension is made with it unknown
(``batch_shapes``); SparseTensors of fed placeholders are recorded."""
from tfpar.compat.tf import ops, sparse_tensor
from tfpar.hooks import batch_shapes
from tfpar.hooks import capture as cap_lib
from tfpar.hooks.function_patches import retracing
from tfpar.hooks.patching import PatchSet
from tfpar.hooks.recording import recorded

__all__ = ["add_op_patches"]


def add_op_patches(patches: PatchSet) -> None:
    patches.add(ops.Graph, "_create_op_internal", _wrap_create_op_internal)
    patches.add(ops.Graph, "_create_op_helper", _wrap_create_op)
    patches.add(sparse_tensor.SparseTensor, "__init__", _wrap_sparse_tensor_init)


def _wrap_create_op(original):
    def _create_op_helper(self, op, compute_device=True):
        original(self, op, compute_device)
        if not cap_lib.is_paused() and recorded(self):
            # tf.gradients builds each gradient function under _original_op(forward op).
            cap_lib.capture_for(self).record_op(op, self._default_original_op)
    return _create_op_helper


def _wrap_create_op_internal(original):
    def _create_op_internal(self, op_type, inputs, dtypes=None, input_types=None, name=None,
                            attrs=None, op_def=None, compute_device=True):
        declared = None
        retraced = self is getattr(retracing, "graph", None)
        if (op_type == "Placeholder" and attrs is not None and not cap_lib.is_paused()
                and (not self.building_function or retraced and retracing.arguments)):
            attrs, declared = batch_shapes.relaxed_placeholder_attrs(attrs)
        op = original(self, op_type, inputs, dtypes, input_types, name, attrs, op_def,
                      compute_device)
        if declared is not None:
            cap_lib.capture_for(self).declared_batch[op.name] = declared
        return op
    return _create_op_internal


def _wrap_sparse_tensor_init(original):
    def __init__(self, indices, values, dense_shape):
        original(self, indices, values, dense_shape)
        components = (self.indices, self.values, self.dense_shape)
        if (not isinstance(self.indices, ops.EagerTensor)
                and self.indices.op.type in _FEED_TYPES and self.values.op.type in _FEED_TYPES):
            capture = cap_lib.capture_for(self.indices.graph)
            if not any(group[0] is self.indices for group in capture.sparse_feeds):
                capture.sparse_feeds.append(components)
    return __init__


_FEED_TYPES = ("Placeholder", "PlaceholderWithDefault")
