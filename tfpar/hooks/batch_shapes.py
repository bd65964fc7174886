"""Batch sources are built with their batch dimension unknown.

A script that declares its batch statically (``placeholder([32, D])``, a
``tf.data`` batch with ``drop_remainder=True``) lets TensorFlow bake 32 into
the graph as it is built: ``tf.shape(x)`` becomes a constant, gradients tile
and divide by constants, code such as BERT's ``get_shape_list`` reshapes to
``[32 * T, H]``. Each replica or micro-batch then computes on fewer rows than
those constants say. So while tfpar is active the batch dimension of every
feed placeholder and dataset iterator is made unknown when it is created (the
rows fed are unchanged): everything downstream is built for any batch size,
as with ``placeholder([None, D])``, and computes what one device computes on
each piece. Code that needs the batch as a Python number (``x.shape[0] * T``)
then sees None and must use ``tf.shape(x)[0]``. The declared sizes are recorded
in the capture's ``declared_batch`` (no error message reads them yet).
"""
from typing import Dict, Optional, Tuple

from tfpar.compat.tf import array_ops, attr_value_pb2, dataset_ops, nest, sparse_tensor, tensor_lib

__all__ = ["relaxed_dataset", "relaxed_placeholder_attrs"]


def relaxed_placeholder_attrs(attrs: Dict[str, attr_value_pb2.AttrValue]
                              ) -> Tuple[Dict[str, attr_value_pb2.AttrValue], Optional[int]]:
    """A Placeholder's attrs with dimension 0 of ``shape`` unknown, and the
    size it had (None when unknown already, or the placeholder is a scalar)."""
    shape = attrs.get("shape")
    if shape is None or shape.shape.unknown_rank or not shape.shape.dim:
        return attrs, None
    declared = shape.shape.dim[0].size
    if declared < 0:
        return attrs, None
    relaxed = attr_value_pb2.AttrValue()
    relaxed.CopyFrom(shape)
    relaxed.shape.dim[0].size = -1
    return {**attrs, "shape": relaxed}, declared


def relaxed_dataset(ds: dataset_ops.DatasetV2) -> Tuple[dataset_ops.DatasetV2, Optional[int]]:
    """``ds`` with dimension 0 of its dense and sparse components unknown (an
    identity map), and the static batch it declared; ``ds`` itself when it
    declares none."""
    specs = nest.flatten(ds.element_spec)
    static = [s.shape[0] for s in specs
              if isinstance(s, (tensor_lib.TensorSpec, sparse_tensor.SparseTensorSpec))
              and s.shape.rank and s.shape[0] is not None]
    if not static:
        return ds, None

    def relax(t):
        if (not isinstance(t, (tensor_lib.Tensor, sparse_tensor.SparseTensor))
                or not t.shape.rank or t.shape[0] is None):
            return t
        shape = [None] + t.shape[1:].as_list()
        if isinstance(t, tensor_lib.Tensor):
            return array_ops.placeholder_with_default(t, shape)
        relaxed = sparse_tensor.SparseTensor(
            t.indices, t.values, array_ops.placeholder_with_default(t.dense_shape, [len(shape)]))
        relaxed.set_shape(shape)
        return relaxed

    def relax_element(*element):
        return nest.map_structure(relax, element[0] if len(element) == 1 else element)
    return ds.map(relax_element), static[0]
