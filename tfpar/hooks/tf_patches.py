"""The TensorFlow seams tfpar intercepts, installed and removed together. Each
wrapper records, then forwards; each module named here patches one kind of
thing, and calls the runtime through ``seams``.

* ``Graph._create_op_internal``: a placeholder declared with a static batch
  dimension is made with that dimension unknown (``batch_shapes``,
  ``op_patches``).
* ``Graph._create_op_helper``: every new op joins the open scope / phase
  (``op_patches``).
* ``gradients_util._GradientsHelper``: ops made by ``tf.gradients`` (and hence
  ``Optimizer.compute_gradients``) are BACKWARD; the call is recorded, with the
  seeds ``gradients_util._DefaultGradYs`` returned for it (``gradient_patches``).
* ``Optimizer.apply_gradients`` (and subclasses' overrides) and keras'
  ``OptimizerV2.apply_gradients`` (``tf.keras.optimizers.legacy``, used by
  ``model.fit`` in graph mode): APPLY; recorded (keras' ``iterations`` counts
  as the global step) (``optimizer_patches``).
* With fp16 mixed precision, gradient seeds, gradients and updates are
  loss-scaled there (``loss_scaling``).
* ``backprop._gradient_function`` (a GradientTape's gradient of one op, in a
  tf.function step): built under ``_original_op(forward op)``, as
  ``tf.gradients`` builds it (``gradient_patches``).
* ``SparseTensor.__init__``: a SparseTensor made of fed placeholders
  (``sparse_placeholder``) is recorded, so the batch split cuts it by rows
  (``op_patches``).
* ``FunctionCaptures.capture_by_value``: a tensor of eager code a TF2 step
  reads as its batch is captured with its batch dimension unknown when the
  step is traced again with its batch relaxed; a traced step is rewritten
  before TensorFlow makes it a function (``function_patches``).
* ``BaseSession.__init__``: tfpar's devices are merged into the ConfigProto
  (``session_patches``).
* ``DatasetV1._make_one_shot_iterator`` / ``_make_initializable_iterator``:
  with ``io.shard_dataset`` each process / worker iterates over its shard
  (``dataset_patches``).
* ``BaseSession.run``, ``BaseSession._make_callable_from_options`` (keras'
  graph functions) and ``Graph.finalize``: the graph is rewritten before it
  first runs or freezes; fetches are translated to their parallel versions
  (``session_patches``).
* keras ``fit`` / ``train_on_batch`` / ``set_weights`` / ``load_weights``:
  the training function is built before they run the session (``keras_patches``).
* keras ``Layer.__init__`` / ``__call__``: a layer made or called in a scope
  entered in TF2 eager code is called in that scope in each step (``keras_scopes``).
* ``ResourceVariable.__init__``: a variable's declared aggregation is
  recorded (``variable_aggregation``).
* keras ``BatchNormalization``: synchronized layers (every one with
  ``batch_norm.sync``) sum their statistics over tfpar's replicas
  (``sync_batch_norm``).
* keras optimizers' slot variables and checkpoint children: slots of split
  weights are numbered as for the whole weight (``optimizer_slots``);
  checkpoint restores, which learn that a whole weight became split
  (``checkpoint_bindings``).
* keras ``Layer.weights`` / ``Model.weights`` and the weight lists of h5
  files: a split weight shows whole, as one device holds it (``keras_weights``).
"""
from typing import Any


from tfpar.compat import tf as internals
from tfpar.hooks import capture as cap_lib
from tfpar.hooks import seams
from tfpar.hooks.checkpoint_bindings import add_checkpoint_binding_patches
from tfpar.hooks.dataset_patches import add_dataset_patches
from tfpar.hooks.function_patches import add_function_patches
from tfpar.hooks.gradient_patches import add_gradient_patches
from tfpar.hooks.keras_patches import add_keras_patches
from tfpar.hooks.keras_scopes import add_keras_scope_patches
from tfpar.hooks.keras_weights import add_keras_weight_patches
from tfpar.hooks.op_patches import add_op_patches
from tfpar.hooks.optimizer_patches import add_optimizer_patches
from tfpar.hooks.optimizer_slots import add_optimizer_slot_patches
from tfpar.hooks.patching import PatchSet
from tfpar.hooks.session_close import add_session_close_patches
from tfpar.hooks.session_patches import add_session_patches
from tfpar.hooks.split_patches import add_split_patches
from tfpar.hooks.sync_batch_norm import add_sync_batch_norm_patches
from tfpar.hooks.variable_aggregation import add_variable_aggregation_patches

__all__ = ["install", "installed", "uninstall"]

_patches = PatchSet()


def installed() -> bool:
    return _patches.installed


def install(runtime: Any) -> None:
    """Install every patch (idempotent); ``runtime`` (``tfpar.runtime.engine``)
    provides the seams ``hooks.seams`` lists, looked up at each call."""
    seams.runtime = runtime
    cap_lib.set_capture_setup(runtime.setup_capture)
    if _patches.installed:
        return
    add_op_patches(_patches)
    add_session_patches(_patches)
    add_gradient_patches(_patches)
    add_optimizer_patches(_patches)
    add_function_patches(_patches)
    add_dataset_patches(_patches)
    add_split_patches(_patches)
    add_keras_patches(_patches, lambda: seams.runtime is not None)
    add_keras_scope_patches(_patches)
    add_keras_weight_patches(_patches)
    add_optimizer_slot_patches(_patches)
    add_checkpoint_binding_patches(_patches)
    add_variable_aggregation_patches(_patches)
    add_session_close_patches(_patches)
    add_sync_batch_norm_patches(_patches, lambda: seams.runtime is not None
                                and seams.runtime.sync_batch_norm())


def uninstall() -> None:
    _patches.remove()
    internals.register_tape_gradient_function()  # TensorFlow's own again
    cap_lib.set_capture_setup(None)
    seams.runtime = None
