"""A verdict on someone else's attention kernel, from the tensors it read and wrote.

``ref`` is attnlib's float64 tiled kernel on the kernel's own inputs (any length, bounded
memory).  Each output entry gets an allowance, the largest error a correct kernel shows
there, and the kernel passes when every ``|kernel - ref|`` is within it:

* below float64, FlashAttention's test rule, ``(2 r + 2)`` ulps of each entry's own size,
  with ``r`` the largest error of plain attention in the kernel's precision (``naive``) in
  those ulps, over the tensor (per head for gradients): no constant ``atol``;
* for float64 kernels, the verdict gate's float64 rounding bound per row (`attnlib.judge.gate`),
  since a float64 "naive" rounds as much as the kernel does.

When the output fails, the check names the likely causes, row by row: NaN and inf, rows
without a visible key that are not 0, other scales, masks and layouts the failing rows
match (with the fraction they explain), key-tile boundaries, single heads.

The parts: `rule` (the allowances), `diagnosis`, `text` (what the CLI prints), `cli`
(``python -m attnlib check``), `shapes` (layouts), `verdict` (`check_kernel`).
"""

from ..core.arrays import UnreadableInput
from .cli import NOTEBOOK_PARAMETERS, load_and_check, main, save_json
from .rule import TensorVerdict
from .shapes import LAYOUTS, TENSORS, UnusableInput, to_bhsd
from .text import format_text
from .verdict import KernelCheck, check_kernel, check_sources

__all__ = ["check_kernel", "check_sources", "KernelCheck", "TensorVerdict", "UnusableInput", "UnreadableInput", "format_text",
           "load_and_check", "save_json", "main", "NOTEBOOK_PARAMETERS", "LAYOUTS", "TENSORS",
           "to_bhsd"]
