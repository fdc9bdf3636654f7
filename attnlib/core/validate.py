"""Argument checking shared by every entry point.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind,
wrong value) with a message that names the argument and what was wrong.  Nothing here
copies or writes to the inputs.
"""

from __future__ import annotations

import math
import numbers
import os
import platform

import numpy as np

#: The largest lazy-rescale threshold: weights stay below exp(100) ~ 2.7e43, so sums over even
#: 2**63 keys stay far below float64's 1.8e308.
MAX_THRESHOLD = 100.0

ALIGNS = ("bottom_right", "top_left")


def positive_int(x, name: str) -> int:
    """``x`` as a positive Python int; bools and non-integral numbers are refused."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be a positive integer, got {x!r}")
    if x <= 0:
        raise ValueError(f"{name} must be a positive integer, got {x!r}")
    return int(x)


def count(x, name: str) -> int:
    """``x`` as a non-negative Python int."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be a non-negative integer, got {x!r}")
    if x < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {x!r}")
    return int(x)


def chunk(x):
    """``attention_chunk``: a positive int, or None for no chunks (0 and None, as
    FlashAttention's ``attention_chunk=0``).

    A chunk ``>= 2**62`` is returned as ``2**62``: wider than any array numpy can hold, it is
    one chunk from the first valid key for every position (as any such size is), and the
    mask arithmetic (``floor((i + o - s) / C)`` in int64) stays far from wrapping around, as
    for a window side that wide (`window`)."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"attention_chunk must be a non-negative integer or None, got {x!r}")
    if x < 0:
        raise ValueError(f"attention_chunk must be a non-negative integer or None (0: no chunks), got {x!r}")
    return min(int(x), _WINDOW_UNBOUNDED) or None


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):  # Windows
        return None


def check_allocation(nbytes: int, what: str) -> None:
    """ValueError when an array the call would make, ``what``, needs more than this
    machine's memory: said before the allocation, rather than a MemoryError (or numpy's
    "array is too big") part way through."""
    limit = physical_memory()
    if limit is not None and nbytes > limit:
        raise ValueError(f"{what} would take {nbytes / 2**30:.3g} GiB, more than this machine's "
                         f"{limit / 2**30:.3g} GiB")


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows
        return os.cpu_count() or 1


def cpu_name() -> str:
    """This machine's CPU model (from /proc/cpuinfo, else what the platform says): benchmarks
    name it beside their figures, since the CPU changes between runs."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def workers(x) -> int:
    """Thread count: a positive integer; None or -1 for every available CPU (the default
    of the kernels; -1 is SciPy's spelling)."""
    if x is None:
        return available_cpus()
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral) or not (x >= 1 or x == -1):
        raise ValueError(f"workers must be a positive integer, -1 or None (all CPUs), got {x!r}")
    return available_cpus() if x == -1 else int(x)


def threshold(x) -> float:
    """A lazy-rescale threshold in natural-log units, ``0 <= x <= MAX_THRESHOLD``."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"rescale_threshold must be a real number, got {x!r}")
    if not (0 <= x <= MAX_THRESHOLD):
        raise ValueError(
            f"rescale_threshold must be in [0, {MAX_THRESHOLD:g}] (natural-log units; larger "
            f"would let exp(s - m) overflow), got {x!r}")
    return float(x)


def flag(x, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {x!r}")
    return bool(x)


def causal_align(x) -> str:
    if x not in ALIGNS:
        raise ValueError(f"causal_align must be one of {ALIGNS}, got {x!r}")
    return x


#: A window side this wide is unbounded for any array numpy can hold; mapping it to None keeps
#: the mask arithmetic (``i + o + right`` in int64) far from wrapping around.
_WINDOW_UNBOUNDED = 1 << 62


def window(x, limit: int | None = None):
    """``(left, right)``: each a non-negative integer or None (unbounded); None = no window.

    A side ``>= limit`` (give ``Sq + Sk``: no pair is that far apart, whatever the
    alignment) or ``>= 2**62`` is returned as None, since it bounds nothing: so that
    ``window=(None, sys.maxsize)`` or ``(10**30, None)`` means exactly no window instead of
    overflowing the int64 index arithmetic.
    """
    if x is None:
        return (None, None)
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise ValueError(f"window must be a pair (left, right) or None, got {x!r}")
    sides = []
    for side, value in zip(("left", "right"), x):
        if value is None:
            sides.append(None)
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise ValueError(f"window {side} must be a non-negative integer or None, got {value!r}")
        value = int(value)
        if value < 0:
            raise ValueError(f"window {side} must be a non-negative integer or None, got {value!r}")
        unbounded = value >= _WINDOW_UNBOUNDED or (limit is not None and value >= limit)
        sides.append(None if unbounded else value)
    return tuple(sides)


def window_side(text: str) -> int:
    """One ``--window`` side of the command lines: an integer ``>= 0``, or -1 for unbounded
    (argparse reports anything else as a usage error, exit status 2)."""
    import argparse

    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if x < -1:
        raise argparse.ArgumentTypeError(f"{x} is not a window side: give an integer >= 0, or -1 for "
                                         "an unbounded side")
    return x


def cli_window(values):
    """``--window L R`` of the command lines as `window` takes it: -1 is an unbounded side
    (FlashAttention's convention); None stays None."""
    if values is None:
        return None
    return tuple(None if x < 0 else x for x in values)


def add_mask_flags(p, qv: bool = False) -> None:
    """The contract's masking and score options that fit a command line, as flags of the
    argparse parser ``p`` (every CLI's: `cli_options` reads them back); ``qv``: the CLI takes
    MLA's ``--qv``, which changes the default scale."""
    p.add_argument("--causal", action="store_true")
    p.add_argument("--align", choices=("bottom_right", "top_left"), default="bottom_right",
                   help="causal alignment when seqlen_q != seqlen_k (default bottom_right, FlashAttention's)")
    p.add_argument("--window", nargs=2, type=window_side, metavar=("L", "R"),
                   help="sliding window: keys i-L .. i+R visible; -1 = unbounded")
    p.add_argument("--softcap", type=float, default=0.0, help="softcap C (0: off)")
    p.add_argument("--scale", type=float, default=None,
                   help="softmax scale (default 1/sqrt(headdim)"
                        + ("; with --qv 1/sqrt(headdim + Dv), the joined head dims, Dv being v's head dim" if qv else "")
                        + "); give the kernel's exact value, e.g. 0.08838834764831845 for 1/sqrt(128), not a "
                          "rounded one")
    p.add_argument("--kv-lengths", type=int, nargs="+", default=None, metavar="N",
                   help="valid keys per batch entry (padding)")
    p.add_argument("--q-lengths", type=int, nargs="+", default=None, metavar="N",
                   help="valid query rows per batch entry (padded rows must be 0)")
    p.add_argument("--key-leftpad", type=int, nargs="+", default=None, metavar="N",
                   help="left-padded keys: the first valid key per batch entry (FlashAttention's cache_leftpad)")
    p.add_argument("--attention-chunk", type=int, default=0, metavar="C",
                   help="chunked attention: a query sees the keys of its own chunk of C positions (0: off)")
    p.add_argument("--sink-token-length", type=int, default=0, metavar="N",
                   help="the first N keys stay visible through the window's left bound (sink tokens)")


def cli_options(args) -> dict:
    """The options of `add_mask_flags`' flags in ``args``, as `attnlib.attention` takes them."""
    return dict(causal=args.causal, causal_align=args.align, window=cli_window(args.window),
                softcap=args.softcap or None, scale=args.scale, kv_lengths=args.kv_lengths,
                q_lengths=args.q_lengths, key_leftpad=args.key_leftpad,
                attention_chunk=args.attention_chunk or None, sink_token_length=args.sink_token_length)


def _integers(x, name):
    arr = np.asarray(x)
    if arr.size == 0 and arr.dtype == np.float64 and not isinstance(x, np.ndarray):
        arr = arr.astype(np.int64)  # an empty list: no value to be anything but an integer
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr


def lengths(x, name: str, batch: tuple, limit: int, limit_name: str):
    """Per-batch-entry lengths: integers of shape ``batch`` in ``[0, limit]``."""
    if x is None:
        return None
    arr = _integers(x, name)
    if arr.shape != batch:
        raise ValueError(f"{name} must have the batch shape {batch}, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > limit):
        raise ValueError(
            f"{name} must be in [0, {limit_name}={limit}], got values in [{arr.min()}, {arr.max()}]")
    return arr


def segment_ids(q_ids, kv_ids, batch: tuple, sq: int, sk: int):
    """Document ids ``(*batch, Sq)`` and ``(*batch, Sk)``: both or neither."""
    if q_ids is None and kv_ids is None:
        return None, None
    if q_ids is None or kv_ids is None:
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    q_ids = _integers(q_ids, "q_segment_ids")
    kv_ids = _integers(kv_ids, "kv_segment_ids")
    if q_ids.shape != batch + (sq,):
        raise ValueError(f"q_segment_ids must have shape {batch + (sq,)} (batch axes, Sq), got {q_ids.shape}")
    if kv_ids.shape != batch + (sk,):
        raise ValueError(f"kv_segment_ids must have shape {batch + (sk,)} (batch axes, Sk), got {kv_ids.shape}")
    return q_ids, kv_ids


def softcap(x):
    """``c > 0`` caps scores as ``c * tanh(s / c)``; None or 0 means no cap (FlashAttention's 0.0)."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"softcap must be a real number or None, got {x!r}")
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {x!r}")
    return float(x) if x > 0 else None
