"""Whether a dense reference fits this machine: the size the check and the reports plan by."""

from __future__ import annotations

from ..core import validate


def dense_bytes(sq: int, sk: int, heads: int = 1) -> int:
    """The dense reference's working memory: about three ``(heads, Sq, Sk)`` float64 arrays
    (scores, masked scores, their exp), as `peak_memory` measures it."""
    return 3 * 8 * heads * sq * sk


def physical_memory() -> int:
    """This machine's physical memory in bytes (0 if it cannot be read)."""
    return validate.physical_memory() or 0


def dense_fits(n: int, heads: int = 1, sk: int | None = None) -> bool:
    """Whether a dense ``n x sk`` run (``sk`` default ``n``) stays well inside this
    machine's memory (half of it)."""
    total = physical_memory()
    return total == 0 or dense_bytes(n, n if sk is None else sk, heads) <= total // 2
