"""Planning on names and numbers (no TensorFlow import)."""
from tfpar.planner.from_annotations import plan_from_annotations

__all__ = ["plan_from_annotations"]
