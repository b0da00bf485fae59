"""Sizes as vramd writes them: parsed as configs write them, printed as vramctl prints them."""
import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a size as configs write it: "6GiB", "512MiB", "1.5GB", "1000"."""
    if isinstance(size, int) and size >= 0:
        return size
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(size))
    if not found or found.group(2).upper() not in _UNITS:
        raise ValueError(f"{size!r} is not a size such as 6GiB, 512MiB or 1000")
    return int(float(found.group(1)) * _UNITS[found.group(2).upper()])


def format_bytes(n: int) -> str:
    """"1.50 GiB", "512 B": binary units, two decimals above bytes, as vramctl and the daemon's
    messages print sizes."""
    if n < 1024:
        return f"{n} B"
    value, unit = float(n), 0
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    while value >= 1024 and unit + 1 < len(units):
        value /= 1024
        unit += 1
    return f"{value:.2f} {units[unit]}"


def format_exact(n: int) -> str:
    """format_bytes(n) with the exact count beside it, for a size to be met to the byte (the least
    limit a module needs): "1.06 KiB (1088 bytes)", "1000 B"."""
    return format_bytes(n) if n < 1024 else f"{format_bytes(n)} ({n} bytes)"
