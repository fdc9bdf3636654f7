"""Benchmarks: attnlib's kernels against dense numpy and (when installed) PyTorch.

Everything is timed in one process, interleaved (each repeat runs every implementation on
every case once, in turn), and summarised by medians and ratios, because this machine is
shared and noisy.  The parts:

- `timing`: the cases and the interleaved timer;
- `peers`: the implementations (attnlib by default and serial, dense numpy, torch SDPA);
- `roofline`: rates measured at the kernel's own tile shapes, and the roofline they give;
- `phases`: where the forward's time goes, phase by phase;
- `masks`: sliding window, documents, padding and GQA decode against torch with the
  equivalent explicit mask (SDPA, FlexAttention eager): time and peak RSS;
- `load`: the default call beside a CPU-bound process;
- `sweep`: the tile-size sweep.

``python -m attnlib bench`` prints the tables; torch is an optional peer
(``pip install attnlib[peers]``), never a dependency.
"""

from .cli import main
from .load import under_load
from .masks import mask_cases, time_masks
from .peers import DEFAULT, backward_implementations, implementations
from .phases import phase_breakdown
from .roofline import roofline_seconds, tile_rates
from .sweep import tile_sweep
from .timing import BACKWARD_CASES, CASES, QUICK_BACKWARD_CASES, QUICK_CASES, SHAPES, BenchCase, time_cases

__all__ = ["main", "under_load", "mask_cases", "time_masks", "DEFAULT", "implementations",
           "backward_implementations", "phase_breakdown", "roofline_seconds", "tile_rates",
           "tile_sweep", "BenchCase", "CASES", "QUICK_CASES", "BACKWARD_CASES",
           "QUICK_BACKWARD_CASES", "SHAPES", "time_cases"]
