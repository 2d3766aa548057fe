"""CPU time of another process, to the nanosecond where the kernel keeps it.

``/proc/PID/stat``'s utime + stime count clock ticks (10 ms at 100 Hz) and,
on a kernel with tick-based accounting, are *sampled* at those ticks: a
2-second slice of a gateway at half a CPU holds ~100 samples, so its figure
moves by ~10% from one slice to the next for nothing. ``/proc/PID/task/TID/
schedstat`` holds each thread's time on a CPU as the scheduler measured it,
in nanoseconds; the sum over the threads is the process's CPU time with no
sampling error (threads that ended are not in it: the gateways measured here
keep theirs). Where schedstat is missing, the tick figure is used.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cpu_seconds"]

TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` (all its live threads, not its children)."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / TCK
