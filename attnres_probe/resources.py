"""What this machine can hold: available memory, and sizes written for people.

Used to refuse work whose memory estimate exceeds what is available, before allocating it.
Only the standard library.
"""

from __future__ import annotations

import os

__all__ = ["address_space_room", "available_memory", "cgroup_room", "human_bytes", "memory_limits"]


def available_memory() -> int | None:
    """Bytes this process may still allocate: the least of the machine's available memory (Linux
    ``MemAvailable``, else free pages), the room left in its cgroup (``memory.max`` or v1's
    ``memory.limit_in_bytes``, minus what the group uses) and the address space left under its own
    ``RLIMIT_AS``. None if none of them is known."""
    return min(memory_limits().values(), default=None)


def memory_limits() -> dict[str, int]:
    """The limits :func:`available_memory` takes the least of, by name ("physical memory",
    "cgroup memory.max", "RLIMIT_AS"), in bytes still free under each; unknown ones are left out."""
    out = {}
    phys = _physical_available()
    if phys is not None:
        out["physical memory"] = phys
    group = cgroup_room()
    if group is not None:
        out["cgroup memory.max"] = group
    space = address_space_room()
    if space is not None:
        out["RLIMIT_AS"] = space
    return out


def _physical_available() -> int | None:
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


def address_space_room() -> int | None:
    """Bytes of address space left under this process's soft ``RLIMIT_AS`` (its limit minus its
    ``VmSize``); None without a limit (or off Linux)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    return max(soft - (_status_bytes("VmSize") or 0), 0)


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


CGROUP_ROOT = "/sys/fs/cgroup"
_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def cgroup_room(root: str | None = None, proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes left in this process's memory cgroup and its parents (the least of limit minus usage),
    cgroup v2 (``memory.max``, ``memory.current``) or v1 (``memory.limit_in_bytes``,
    ``memory.usage_in_bytes``); None where no limit is set or none can be read."""
    root = root or CGROUP_ROOT
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:  # v2: the unified hierarchy
            base, files = root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        rooms += _cgroup_rooms(base, path, files)
    return min(rooms) if rooms else None


def _cgroup_rooms(base: str, path: str, files: tuple[str, str]) -> list[int]:
    """Limit minus usage of each folder from the process's group up to ``base`` (a container sees
    its own group as the root of the mount, so the root itself is read too)."""
    rooms, seen = [], set()
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        folder = os.path.join(base, *parts[:depth])
        if folder in seen or not os.path.isdir(folder):
            continue
        seen.add(folder)
        limit, used = (_read_int(os.path.join(folder, name)) for name in files)
        if limit is not None and limit < _NO_LIMIT:
            rooms.append(max(limit - (used or 0), 0))
    return rooms


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KB'``; decimal units up to EB."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} EB"
