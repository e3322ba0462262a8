"""Human units for the numbers shardlib prints (bytes as KiB/MiB/GiB)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``n`` bytes as "512 B", "1.50 KiB", ... "2.00 TiB" (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
