"""Hardware catalog: what ``cluster.hardware`` names mean (no TensorFlow).

Numbers are vendor peak figures: dense FP16/BF16 tensor throughput, device
memory, intra-node (NVLink, or PCIe for T4) bandwidth per device, and the
inter-node network of the machines they usually come in (100 Gb/s for V100 /
P100 / T4 nodes, 200 Gb/s A100, 400 Gb/s H100).
"""
import dataclasses
from typing import Any, List, Mapping, Optional, Sequence

from tfpar.errors import ConfigError

__all__ = ["CATALOG", "HOST_CPU", "LINK_KEYS", "Hardware", "device_hardware"]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device type: peak TFLOPS, memory (GB), intra- and inter-node
    bandwidth (GB/s); ``devices_per_node`` (None: all on one node) tells which
    collectives cross nodes."""

    name: str
    tflops: float
    memory_gb: float
    intra_node_gbps: float = 16.0
    inter_node_gbps: float = 12.5
    devices_per_node: Optional[int] = None

    def bandwidth(self, span: int) -> float:
        """Bytes/s of a collective over ``span`` consecutive devices (a
        strided group, such as data-parallel replicas, spans all devices)."""
        within = self.devices_per_node is None or span <= self.devices_per_node
        return (self.intra_node_gbps if within else self.inter_node_gbps) * 1e9


CATALOG = {hw.name: hw for hw in (
    Hardware("P100-16GB", 18.7, 16, 80, 12.5),
    Hardware("V100-32GB", 125, 32, 150, 12.5),
    Hardware("T4", 65, 16, 16, 12.5),
    Hardware("A100-80GB", 312, 80, 300, 25),
    Hardware("H100-80GB", 989, 80, 450, 50),
)}


# What the planner assumes when cluster.hardware is unset (a logical CPU device).
HOST_CPU = Hardware("host-CPU", tflops=0.05, memory_gb=16, intra_node_gbps=10,
                    inter_node_gbps=1.25)
LINK_KEYS = ("intra_node_gbps", "inter_node_gbps")  # optional in explicit specs


def _resolve(spec: Any) -> Hardware:
    if isinstance(spec, Mapping):
        links = {key: float(spec[key]) for key in LINK_KEYS if key in spec}
        return Hardware(spec["name"], float(spec["tflops"]), float(spec["memory_gb"]), **links)
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
