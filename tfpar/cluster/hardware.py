"""Hardware catalog: what ``cluster.hardware`` names mean (no TensorFlow).

Throughput is the vendor's dense peak per compute dtype (TFLOPS, no
structured sparsity), and memory bandwidth the vendor's peak, both times an
achievable-efficiency factor. Peaks, from the NVIDIA datasheets (P100 PCIe,
V100 SXM2, T4, A100 SXM4, H100 SXM5):

  =========  =====  =====  =====  ============  ======  ========================
  device     fp64   fp32   tf32   fp16 / bf16   memory  note
                                                GB/s
  =========  =====  =====  =====  ============  ======  ========================
  P100-16GB  4.7    9.3    -      18.7 / -      732     no tensor cores: fp16 2x
  V100-32GB  7.8    15.7   -      125 / -       900     fp16 tensor cores
  T4         0.25   8.1    -      65 / -        320     fp16 tensor cores
  A100-80GB  19.5   19.5   156    312 / 312     2039    fp64 on tensor cores
  H100-80GB  67     67     494.5  989 / 989     3350    dense (datasheet / 2)
  =========  =====  =====  =====  ============  ======  ========================

A dtype a device has no units for ("-": TF32 before Ampere, bf16 before
Ampere) runs at its fp32 rate, the entry's ``tflops``. ``EFFICIENCY``: the
fraction of both peaks the ops sustain, 0.7 (cuBLAS matrix products at
transformer widths reach 70-80% of the tensor-core peak; streaming kernels
70-90% of the memory bandwidth). With memory-bound ops on the roofline
(``planner.roofline``), pipeline bubbles and collectives, that puts
Megatron-LM's published GPT configurations at 0.95-1.09 of the per-GPU
throughput they measured, 137-163 TFLOP/s, 44-52% of the A100's peak
(Narayanan et al., SC'21, Table 1; ``benchmarks/plan_scale.py``). Judged
on runs that choice never saw (MT-NLG 530B, Smith et al. 2022: DeepSpeed's
pipelines) the estimates are 0.86-0.88 of the measured step. Memory,
intra-node (NVLink, or PCIe for T4) bandwidth per device, and the
inter-node network of the machines these usually come in (100 Gb/s
for V100 / P100 / T4 nodes, 200 Gb/s A100, 400 Gb/s H100). ``NODE_SIZES``:
the devices of such a node (DGX / HGX: 8 SXM GPUs), which a described
cluster of more devices is assumed to be made of when it does not say.
"""
import dataclasses
import json
import re
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

from tfpar.errors import ConfigError

__all__ = ["CATALOG", "DTYPES", "EFFICIENCY", "HOST_CPU", "LINK_KEYS", "NODE_SIZES", "OPTIONAL_KEYS",
           "PEAK_KEYS", "Hardware", "default_node", "device_hardware", "device_kind", "expand",
           "slowest"]

DTYPES = ("fp64", "fp32", "tf32", "fp16", "bf16")
EFFICIENCY = 0.7
PEAK_KEYS = tuple(f"tflops_{dtype}" for dtype in DTYPES)  # optional in explicit specs
LINK_KEYS = ("intra_node_gbps", "inter_node_gbps")
OPTIONAL_KEYS = LINK_KEYS + PEAK_KEYS + ("efficiency", "memory_gbps")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device type: peak TFLOPS (``tflops`` for every dtype without its
    own entry in ``peaks``), the fraction of peak it sustains, memory (GB),
    intra- and inter-node bandwidth (GB/s); ``devices_per_node`` (None: all
    on one node) tells which collectives cross nodes; ``memory_gbps``: the
    device memory's peak bandwidth (None: unknown, ops timed by FLOPs)."""

    name: str
    tflops: float
    memory_gb: float
    intra_node_gbps: float = 16.0
    inter_node_gbps: float = 12.5
    devices_per_node: Optional[int] = None
    peaks: Tuple[Tuple[str, float], ...] = ()
    efficiency: float = EFFICIENCY
    memory_gbps: Optional[float] = None

    def peak(self, dtype: str) -> float:
        """Peak TFLOPS for ``dtype`` (one of ``DTYPES``): its entry; TF32
        without one at the fp32 entry's rate; else ``tflops``."""
        table = dict(self.peaks)
        if dtype == "tf32" and dtype not in table:
            dtype = "fp32"
        return table.get(dtype, self.tflops)

    def peak_name(self, dtype: str) -> str:
        """The dtype whose peak ``dtype`` runs at: itself, or "fp32" for a
        16-bit or TF32 dtype a device runs at its fp32 peak (no units of
        its own for it)."""
        if dtype in ("fp32", "fp64") or self.peak(dtype) != self.peak("fp32"):
            return dtype
        return "fp32"

    def flops_per_s(self, dtype: str) -> float:
        """The FLOP/s the planner assumes: peak x efficiency."""
        return self.peak(dtype) * self.efficiency * 1e12

    def memory_bytes_per_s(self) -> float:
        """The memory bandwidth the planner assumes: peak x efficiency
        (infinite when unknown)."""
        if self.memory_gbps is None:
            return float("inf")
        return self.memory_gbps * self.efficiency * 1e9

    def link(self, span: int) -> float:
        """Bytes/s from one device to another in a block of ``span``
        consecutive devices: within a node or, across nodes, a device's share
        of its node's links."""
        within = self.devices_per_node is None or span <= self.devices_per_node
        return (self.intra_node_gbps if within else self.inter_node_gbps) * 1e9

    def bandwidth(self, n: int, stride: int = 1) -> float:
        """Bytes/s of a collective over ``n`` devices ``stride`` apart (1:
        consecutive), as the bandwidth of a ring over the ``n`` that takes as
        long. Within a node: ``intra_node_gbps``. Across nodes the collective
        is hierarchical (Horovod's hierarchical all-reduce; NCCL's trees run
        between nodes): the g members on each node reduce-scatter among
        themselves, each all-reduces its 1/g with its peers on the other N
        nodes over its own share of the node's links (``inter_node_gbps`` is
        per device), and they all-gather: per byte of a ring's 2 (n-1)/n,
        2 (g-1)/g over the intra- and 2 (N-1)/N / g over the inter-node
        bandwidth (an all-gather moves half of each)."""
        if n < 2 or self.devices_per_node is None or n * stride <= self.devices_per_node:
            return self.link(n * stride)
        members = max(1, min(n, self.devices_per_node // stride))
        nodes = n / members
        per_byte = (2 * (members - 1) / members / self.intra_node_gbps
                    + 2 * (nodes - 1) / nodes / members / self.inter_node_gbps)
        return 2 * (n - 1) / n / per_byte * 1e9


CATALOG = {hw.name: hw for hw in (
    Hardware("P100-16GB", 9.3, 16, 80, 12.5, peaks=(("fp64", 4.7), ("fp16", 18.7)),
             memory_gbps=732),
    Hardware("V100-32GB", 15.7, 32, 150, 12.5, peaks=(("fp64", 7.8), ("fp16", 125)),
             memory_gbps=900),
    Hardware("T4", 8.1, 16, 16, 12.5, peaks=(("fp64", 0.25), ("fp16", 65)), memory_gbps=320),
    Hardware("A100-80GB", 19.5, 80, 300, 25,
             peaks=(("fp64", 19.5), ("tf32", 156), ("fp16", 312), ("bf16", 312)),
             memory_gbps=2039),
    Hardware("H100-80GB", 67, 80, 450, 50,
             peaks=(("fp64", 67), ("tf32", 494.5), ("fp16", 989), ("bf16", 989)),
             memory_gbps=3350),
)}


NODE_SIZES = {"V100-32GB": 8, "A100-80GB": 8, "H100-80GB": 8}


def default_node(devices: Sequence[Hardware]) -> Optional[int]:
    """Devices per node of ``devices`` when every one of them comes in
    nodes of that size (``NODE_SIZES``), else None."""
    sizes = {NODE_SIZES.get(d.name) for d in devices}
    return sizes.pop() if len(sizes) == 1 else None


# What the planner assumes when cluster.hardware is unset (a logical CPU
# device): 0.05 TFLOPS is what one sustains, so efficiency 1.
HOST_CPU = Hardware("host-CPU", tflops=0.05, memory_gb=16, intra_node_gbps=10,
                    inter_node_gbps=1.25, efficiency=1.0)


def device_kind(hardware: Hardware) -> Optional[str]:
    """"GPU" for a catalog entry (calibrated or not), "CPU" for the host CPU
    (generic, measured or calibrated), None for an entry of another name."""
    name = hardware.name.split(" (")[0]
    return "GPU" if name in CATALOG else "CPU" if name == HOST_CPU.name else None


def _resolve(spec: Any) -> Hardware:
    if isinstance(spec, Mapping):
        links = {key: float(spec[key]) for key in LINK_KEYS if key in spec}
        peaks = tuple((dtype, float(spec[key])) for dtype, key in zip(DTYPES, PEAK_KEYS)
                      if key in spec)
        bandwidth = float(spec["memory_gbps"]) if "memory_gbps" in spec else None
        return Hardware(spec["name"], float(spec["tflops"]), float(spec["memory_gb"]), **links,
                        peaks=peaks, efficiency=float(spec.get("efficiency", EFFICIENCY)),
                        memory_gbps=bandwidth)
    if isinstance(spec, str) and spec.endswith(".json"):
        return _resolve(_entry_file(spec))
    if spec not in CATALOG:
        raise ConfigError(f"cluster.hardware: unknown device '{spec}'; catalog names are "
                          f"{', '.join(CATALOG)}, or give {{name, tflops, memory_gb}}")
    return CATALOG[spec]


def _entry_file(path: str) -> Mapping:
    """The device entry (a dict) a JSON file holds (``measure.calibrate`` writes one)."""
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cluster.hardware: cannot read the device entry {path!r}: {e}") from None
    if not isinstance(entry, Mapping) or not {"name", "tflops", "memory_gb"} <= set(entry):
        raise ConfigError(f"cluster.hardware: {path!r} must hold a JSON object with name, "
                          "tflops and memory_gb")
    return entry


_COUNTED = re.compile(r"\s*(\d+)\s*[xX*]\s*(\S.*?)\s*$")


def expand(specs: Union[str, Sequence[Any]]) -> List[Any]:
    """``cluster.hardware`` with its compact entries ("1024 x A100-80GB": that
    many of a catalog device) written out; a string is one entry."""
    expanded: List[Any] = []
    for spec in [specs] if isinstance(specs, str) else specs:
        counted = _COUNTED.fullmatch(spec) if isinstance(spec, str) else None
        expanded += [counted.group(2)] * int(counted.group(1)) if counted else [spec]
    return expanded


def device_hardware(specs: Union[None, str, Sequence[Any]],
                    num_devices: int) -> Optional[List[Hardware]]:
    """``cluster.hardware`` resolved per device: None when unset, one entry for
    every device alike, else one entry per device (compact entries expanded)."""
    if specs is None:
        return None
    specs = expand(specs)
    if len(specs) not in (1, num_devices):
        raise ConfigError(f"cluster.hardware lists {len(specs)} devices but there are "
                          f"{num_devices}; give one entry per device or a single one for all")
    resolved = [_resolve(s) for s in specs]
    return resolved * num_devices if len(resolved) == 1 else resolved


def slowest(devices: Sequence[Hardware], devices_per_node: Optional[int] = None) -> Hardware:
    """One device no better than any of ``devices`` in any respect (each
    dtype's peak, efficiency, memory and its bandwidth, links): the device
    itself when they are alike, named "cluster" when there are several."""
    bandwidths = [d.memory_gbps for d in devices]
    return Hardware("cluster" if len(set(devices)) > 1 else devices[0].name,
                    min(d.tflops for d in devices), min(d.memory_gb for d in devices),
                    min(d.intra_node_gbps for d in devices),
                    min(d.inter_node_gbps for d in devices), devices_per_node,
                    tuple((dtype, min(d.peak(dtype) for d in devices)) for dtype in DTYPES),
                    min(d.efficiency for d in devices),
                    None if None in bandwidths else min(bandwidths))
