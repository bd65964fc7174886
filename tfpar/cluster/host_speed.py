"""What this host's CPU sustains, measured (no TensorFlow): on logical CPU
devices it stands in for a catalog entry when ``cluster.hardware`` is unset."""
import dataclasses
import functools
import time

import numpy as np

from tfpar.cluster.hardware import HOST_CPU, Hardware

__all__ = ["host_cpu", "matmul_tflops"]

_SIZE = 512  # a float32 product this wide runs at the BLAS's full speed, in milliseconds


@functools.lru_cache(maxsize=None)
def matmul_tflops(repeats: int = 8) -> float:
    """TFLOP/s of a float32 ``_SIZE`` x ``_SIZE`` matrix product on this host
    (the best of ``repeats`` timings), measured once per process."""
    rng = np.random.RandomState(0)
    a = rng.rand(_SIZE, _SIZE).astype(np.float32)
    b = rng.rand(_SIZE, _SIZE).astype(np.float32)
    np.dot(a, b)  # warm up the BLAS's threads
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.dot(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * _SIZE ** 3 / max(best, 1e-9) / 1e12


def host_cpu() -> Hardware:
    """The generic host CPU entry with this host's measured matmul
    throughput as its peak (efficiency 1)."""
    tflops = matmul_tflops()
    return dataclasses.replace(HOST_CPU, name=f"host-CPU (measured {tflops * 1e3:.0f} GFLOP/s)",
                               tflops=tflops, efficiency=1.0)
