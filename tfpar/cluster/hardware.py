"""Hardware catalog: what ``cluster.hardware`` names mean (no TensorFlow).

Numbers are vendor peak figures: dense FP16/BF16 tensor throughput, device
memory, and intra-node (NVLink, or PCIe for T4) bandwidth per device.
"""
import dataclasses
from typing import Any, List, Mapping, Optional, Sequence

from tfpar.errors import ConfigError

__all__ = ["CATALOG", "HOST_CPU", "Hardware", "device_hardware"]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device type: peak TFLOPS, memory (GB), intra-node bandwidth (GB/s)."""

    name: str
    tflops: float
    memory_gb: float
    intra_node_gbps: float = 16.0


CATALOG = {hw.name: hw for hw in (
    Hardware("P100-16GB", 18.7, 16, 80),
    Hardware("V100-32GB", 125, 32, 150),
    Hardware("T4", 65, 16, 16),
    Hardware("A100-80GB", 312, 80, 300),
    Hardware("H100-80GB", 989, 80, 450),
)}


# What the planner assumes when cluster.hardware is unset (a logical CPU device).
HOST_CPU = Hardware("host-CPU", tflops=0.05, memory_gb=16, intra_node_gbps=10)


def _resolve(spec: Any) -> Hardware:
    if isinstance(spec, Mapping):
        return Hardware(spec["name"], float(spec["tflops"]), float(spec["memory_gb"]))
    if spec not in CATALOG:
        raise ConfigError(f"cluster.hardware: unknown device '{spec}'; catalog names are "
                          f"{', '.join(CATALOG)}, or give {{name, tflops, memory_gb}}")
    return CATALOG[spec]


def device_hardware(specs: Optional[Sequence[Any]], num_devices: int) -> Optional[List[Hardware]]:
    """``cluster.hardware`` resolved per device: None when unset, one entry for
    every device alike, else one entry per device."""
    if specs is None:
        return None
    if len(specs) not in (1, num_devices):
        raise ConfigError(f"cluster.hardware lists {len(specs)} devices but there are "
                          f"{num_devices}; give one entry per device or a single one for all")
    resolved = [_resolve(s) for s in specs]
    return resolved * num_devices if len(resolved) == 1 else resolved
