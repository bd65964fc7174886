"""Plain-data intermediate representation (no TensorFlow)."""
from tfpar.ir.plan import Plan, TaskGraphPlan
from tfpar.ir.taskgraph import Phase, Strategy, TaskGraphSpec

__all__ = ["Phase", "Plan", "Strategy", "TaskGraphPlan", "TaskGraphSpec"]
