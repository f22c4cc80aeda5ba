"""Memory figures for the epoch logs: host RSS and, on a GPU, TF's allocator figures."""

from __future__ import annotations

import os

_MB = 1024.0 * 1024.0


def host_rss_mb():
    """The process' current resident set size in MB, or None where it can't be read.

    Read from ``/proc/self/statm`` (resident pages times the page size: the
    current figure, not the peak). Where there is no /proc (macOS), falls back
    to ``resource.getrusage``'s ``ru_maxrss``, which is the peak RSS.
    """
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return float(resident_pages * os.sysconf("SC_PAGE_SIZE")) / _MB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak) / (_MB if sys.platform == "darwin" else 1024.0)  # bytes on macOS, KiB on Linux
    except Exception:
        return None


def memory_logs():
    """``memory_mb`` (host RSS) and, with a GPU, ``gpu_memory_mb``/``gpu_peak_memory_mb``: plain floats."""
    logs = {}
    rss = host_rss_mb()
    if rss is not None:
        logs["memory_mb"] = float(rss)
    try:
        import tensorflow as tf

        gpus = tf.config.list_logical_devices("GPU")
        if gpus:
            info = tf.config.experimental.get_memory_info(gpus[0].name)
            logs["gpu_memory_mb"] = float(info["current"]) / _MB
            logs["gpu_peak_memory_mb"] = float(info["peak"]) / _MB
    except Exception:  # no allocator figures on this device: host RSS only
        pass
    return logs
