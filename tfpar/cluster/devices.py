"""Device naming (no TensorFlow import)."""
from typing import List

__all__ = ["device_names", "short_name"]


def device_names(device_type: str, count: int, job: str = "localhost",
                 replica: int = 0, task: int = 0) -> List[str]:
    """Full TF device names ``/job:J/replica:R/task:T/device:TYPE:i`` for i < count."""
    return [f"/job:{job}/replica:{replica}/task:{task}/device:{device_type}:{i}"
            for i in range(count)]


def short_name(device: str) -> str:
    """``/job:localhost/replica:0/task:0/device:CPU:3`` -> ``CPU:3``."""
    return device.rsplit("device:", 1)[-1]
