"""What this machine can hold: available memory, and sizes written for people.

Used to refuse work whose memory estimate exceeds what is available, before allocating it.
Only the standard library.
"""

from __future__ import annotations

import os

__all__ = ["available_memory", "human_bytes"]


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``, else free pages); None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KB'``; decimal units up to EB."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} EB"
