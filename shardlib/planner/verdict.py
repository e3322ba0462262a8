"""A memory verdict: an estimate or a compiled peak against one device's budget."""

from __future__ import annotations

MEMORY_MARGIN = 0.3
"""How far the analytic memory estimate may be off before a verdict needs a compile."""


def verdict(memory_bytes: int, budget: int, exact: bool, margin: float = MEMORY_MARGIN) -> str:
    """``fits`` / ``over`` / ``borderline`` (an estimate within the margin of the budget)."""
    if exact:
        return "fits" if memory_bytes <= budget else "over"
    if memory_bytes * (1 + margin) <= budget:
        return "fits"
    return "over" if memory_bytes > budget * (1 + margin) else "borderline"
