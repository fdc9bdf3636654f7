"""The verdict gate: what float64 rounding allows between two correct attention codes.

The contract's requirement is ``rel_error < 1e-9`` (`~attnlib.judge.metrics.BOUND`).  Correct
float64 code does far better, so a gate at 1e-9 lets a real defect through: an ``exp``
off by ``1e-11 * x`` gives ~1e-11.  This module derives, per query row, how far two
correct float64 computations of the contract (the tiled kernel and the dense reference)
can differ, from a first-order rounding analysis of the operations they both perform, and
`Gate` judges an ``(out, lse)`` pair against it.

The bound
---------
Write ``u = 2**-53`` (float64 unit roundoff).  For query row ``i`` with visible keys
``J_i`` (``n_i`` of them) let

    sigma_i = max_{j in J_i} |scale| * sum_c |q_ic| |k_jc|      (the scores' componentwise size)
    S_i     = sigma_i, or min(sigma_i, cap) with a softcap     (a bound on |s_ij|)
    A_i     = |slope_h| * (|o| + max(Sq, Sk))                   (ALiBi, 0 without: a bound on
                                                                 |slope| |i + o - j| and on the
                                                                 position terms slope * j and
                                                                 slope * (i + o) of the algebraically
                                                                 equal "position" form some
                                                                 implementations use)
    T       = ceil(Sk / block_k)                                (key tiles: sequential steps)

One correct implementation makes these errors, each turned into an error of the output
relative to ``P @ |V|`` (the size of what the row sums, the contract's ``rel_error``):

1. *Exponents.*  The score ``scale * q . k`` is a dot product of ``d`` terms plus one
   scaling: ``|ds| <= g(d + 1) * sigma_i``.  The ALiBi addition rounds once
   (``u (S_i + A_i)``), the shift ``s - m`` once (``u |s - m| <= 2 u (S_i + A_i)``), a
   softcap's divide, ``tanh`` and multiply three times (``3 u cap``).  So every exponent
   is off by at most ``delta_i = g(d + 1) sigma_i + u (3 (S_i + A_i) + 3 cap)``.  An
   absolute error ``e_j`` in an exponent is a relative error in ``p_j``, and perturbing
   the weights of ``out = sum p_j v_j / sum p_j`` by relative ``e_j`` moves it by
   ``|sum p_j e_j (v_j - out)| / sum p_j <= 2 max|e_j| (P @ |V|)_i``.
2. *exp* rounds each weight (relative ``C_EXP u``): ``2 C_EXP u``, by the same argument.
   The rescale factors ``alpha`` multiply ``acc`` and ``l`` alike, so their ``exp`` error
   cancels in ``acc / l`` (not in ``lse``: see 3).
3. *Sums.*  ``acc = sum p v`` and ``l = sum p`` sum ``n_i`` terms inside key tiles (BLAS
   dot products, pairwise sums: ``g(n_i)``) and then combine the ``T`` tiles one after the
   other, two roundings per step (``alpha * acc``, ``+ p @ v``) and an ``exp`` for alpha
   whose error cancels in ``acc / l`` but not in ``lse``.  The sequential steps are counted
   at their worst case: summed key by key (``block_k = 1``) on structured data (all but one
   weight below ``u``, or equal terms), rounding errors share one sign and grow as ``T u``,
   not ``sqrt(T) u``.  So ``acc`` and ``l`` are off by ``h_i = g(n_i) + 2 T u`` relative
   (``h_i (P @ |V|)`` and ``h_i |out|`` on ``out``), and ``l`` by
   ``h'_i = g(n_i) + (2 + C_EXP) T u`` as far as ``lse`` sees it.
4. The division ``acc / l``: ``u``.
5. *Underflow.*  A weight or product below the smallest normal number (2**-1022) rounds
   with an absolute error of up to ``eta = 2**-1075`` instead of a relative one; with
   ``l >= 1`` that is at most ``(2 n_i + 2 T + 1) eta max|v|`` on ``out``, absolute.  It is
   nothing on ordinary inputs and all there is where an output is made of subnormal weights.

    e_out_i = 2 delta_i + 2 C_EXP u + 2 h_i + u                          (relative to P @ |V|)
              + (2 n_i + 2 T + 1) eta max|v| / max(P @ |V|, 2**-1022)   (underflow)
    e_lse_i = delta_i + C_EXP u + h'_i + C_LOG u log(n_i) + u |lse_i|   (absolute)

(``lse = m + log l``: the exponents' errors, ``l``'s relative error, ``log``'s rounding
on ``log l <= log n_i`` and the final addition.)  Two implementations can differ by the
sum of their errors, so the gate is ``tol = 2 e`` for ``out`` and ``lse``.

``g(n)`` bounds the relative error of the ``n``-term sums inside tiles.  Their worst case
is ``n u``; the probabilistic analysis of Higham & Mary (2019) shows that with rounding
errors modelled as independent and mean zero, ``|error| <= lambda sqrt(n) u`` (to first
order) with probability at least ``1 - 2 n exp(-lambda**2 / 2)`` for an inner product of
``n`` terms.  With ``LAMBDA = 8`` that is ``1 - 2.5e-14 n`` per dot product.  The model
holds for the blocked, SIMD and pairwise sums of BLAS and numpy on the data of the reports;
it can fail for long strictly sequential sums of structured data, which is why the
sequential steps across tiles are counted at their worst case (pass ``block_k=1`` for an
implementation that accumulates key by key).  This is the gate's one modelling
assumption; the report shows how far below the bound the measured errors sit.  ``C_EXP = C_LOG = 8`` (4 ulp) is an allowance for numpy's ``exp``
and ``log``, which are within 4 ulp on the platforms numpy documents (the equivalence
report measures them on its machine).

Rows with no visible key have ``tol = 0``: their ``out`` must be exactly 0 and their
``lse`` exactly ``-inf``.  With attention sinks the sink is one more term of ``l``
(``n_i + 1`` terms above; its logit is exact), and a row with no visible key has
``lse = sink`` within the same ``e_lse``.

References
----------
N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., SIAM 2002,
ch. 3-4 (componentwise bounds of sums and dot products).
N. J. Higham and T. Mary, "A New Approach to Probabilistic Rounding Error Analysis",
SIAM J. Sci. Comput. 41(5), A2815-A2835, 2019.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..core import arrays, problem, validate, flex
from ..core.backend import NUMPY, backend_for
from ..core.masks import SKIP
from ..core.parallel import run_tiles
from .metrics import BOUND, TINY, reference_with_abs
from ..core.oracle import oracle_attention
from ..core.options import Options
from ..core.device import resolve as device_of
from ..core.reference import dense_options, reference_scores
from ..core.tilesizes import DEFAULT_TILES
from ..core.tiles import tile_scores

#: Unit roundoff of float64.
U = 2.0 ** -53
#: The largest absolute rounding error of a result below the smallest normal number.
ETA = 2.0 ** -1075
#: Confidence parameter of the probabilistic accumulation bound ``lambda sqrt(n) u``.
LAMBDA = 8.0
#: Allowances, in units of ``u``, for one ``exp`` and one ``log`` (4 ulp each).
C_EXP = 8.0
C_LOG = 8.0


def _g(n):
    """``lambda sqrt(n) u``: the probabilistic bound on ``n`` accumulated roundings."""
    return LAMBDA * np.sqrt(n) * U


@dataclass(frozen=True)
class Tolerance:
    """Per-row gate tolerances, shape ``(..., Hq, Sq)`` (``underflow``: ``(..., Hq, Sq, Dv)``).

    ``out``: on ``|out - ref| / (P @ |V|)``; ``underflow``: an absolute allowance on
    ``|out - ref|`` (divided by ``max(P @ |V|, 2**-1022)`` when judged); ``lse``: on
    ``|lse - ref_lse|`` (absolute).  ``sigma``, ``visible_keys``: the row's score size and
    key count they were built from.
    """

    out: np.ndarray
    lse: np.ndarray
    sigma: np.ndarray
    visible_keys: np.ndarray
    underflow: np.ndarray | float = 0.0
    delta: np.ndarray | float = 0.0  # (..., Hq, Sq): the exponents' error bound delta_i

    def allowed(self, ref_abs) -> np.ndarray:
        """``(..., Hq, Sq, Dv)``: the largest ``|out - ref|`` the gate allows per entry,
        ``tol_out max(P @ |V|, 2**-1022) + underflow`` (0 on rows with no visible key)."""
        seen = self.out[..., None] > 0
        return np.where(seen, self.out[..., None] * np.maximum(ref_abs, TINY) + self.underflow, 0.0)

    def halved(self) -> "Tolerance":
        """One implementation's share of a tolerance built for two."""
        return Tolerance(self.out / 2, self.lse / 2, self.sigma, self.visible_keys, self.underflow / 2,
                         self.delta)


def tolerance(q, k, v, ref_lse, *, block_q=None, block_k=None, options=None, device=None,
              **given) -> Tolerance:
    """The gate's per-row tolerances for ``attention(q, k, v, **options)`` (see module doc).

    ``ref_lse`` is the reference's ``lse`` (for the ``u |lse|`` term; None: 0); ``block_k`` the
    tiled kernel's key tile (default `DEFAULT_TILES`), which sets the number of rescale
    steps (``block_k=1`` for an implementation whose tiling is unknown: the worst case);
    ``given`` the masking and score arguments (or ``options``, an `~attnlib.core.options.Options`,
    with ``given`` on top; a ``score_mod_grad`` is ignored).  Memory: bounded in the sequence length
    (`row_stats` visits the score matrix tile by tile); the result is ``(..., Hq, Sq, Dv)``.
    ``device``: `row_stats`, the one pass over the scores, runs with torch there (torch
    inputs choose their own); the rest is ``O(Sq)`` per head, on the host.
    """
    dev = device_of(device, q, k)
    q_given, k_given = q, k  # read where they are by `row_stats` on a device
    q, k, v = (arrays.as_float_array(x, name) for x, name in zip((q, k, v), "qkv"))
    block_k = validate.positive_int(DEFAULT_TILES.block_k if block_k is None else block_k, "block_k")
    d, sq, sk = q.shape[-1], q.shape[-2], k.shape[-2]
    given.pop("score_mod_grad", None)  # the backward's: not a forward option
    opts = Options.parse(options, **given)
    scale = 1.0 / math.sqrt(d) if opts.scale is None else opts.scale
    cap = opts.softcap
    slopes = opts.alibi_slopes
    stats = row_stats(*((q, k) if dev is None else (q_given, k_given)), block_q=block_q,
                      options=replace(opts, scale=scale, alibi_slopes=None, sinks=None), device=dev)
    sigma, n_vis = stats[:2]
    # An overflowing size (|q| . |k| beyond the range) is held at the largest float: an
    # infinite one would allow any error, a gate without power.
    sigma = np.minimum(sigma, float(np.finfo(np.float64).max))
    # A score_mod's result is taken as rounded once, like a product: u |score_mod(s)| on
    # each exponent, with the same 3x as the scores (the max and the subtraction).
    mod_term = 3 * U * stats[2] if len(stats) == 3 else 0.0
    # A sink is one more term of l (its logit is exact, its weight exp(sink - m) rounds like
    # any other), and a row with no visible key then has lse = sink.
    terms = n_vis + (opts.sinks is not None)  # the terms of l
    s_max = sigma if cap is None else np.minimum(sigma, cap)
    a_max = 0.0
    if slopes is not None:
        # |slope_h| (|o| + max(Sq, Sk)) bounds |i + o - j|, |j| and |i + o| for any alignment.
        # The slopes come back from the scores of q = 0 with ALiBi at distance 1 (Sq = Sk = 2).
        pb_q, pb_k = np.zeros(q.shape[:-2] + (2, 1)), np.zeros(k.shape[:-2] + (2, 1))
        slope = np.abs(reference_scores(pb_q, pb_k, alibi_slopes=slopes, scale=1.0)[..., 0, 1])
        a_max = slope[..., None] * (abs(sk - sq) + max(sq, sk))  # (..., Hq, 1)
    # Each size times U first: 3 (s_max + a_max) itself overflows at scores of 1e308.
    delta = (_g(d + 1) * sigma + 3 * U * s_max + 3 * U * a_max + (3 * U * cap if cap is not None else 0.0)
             + mod_term)
    steps = -(-sk // block_k)
    h_out = _g(terms) + 2 * steps * U  # alpha's exp error cancels in acc / l ...
    h_lse = _g(terms) + (2 + C_EXP) * steps * U  # ... but not in log l
    e_out = 2 * delta + (2 * C_EXP + 1) * U + 2 * h_out
    lse_size = 0.0 if ref_lse is None else np.abs(np.where(terms > 0, ref_lse, 0.0))
    e_lse = (delta + C_EXP * U + h_lse + C_LOG * U * np.log(np.maximum(terms, 1))
             + U * lse_size)
    seen = n_vis > 0  # out: exactly 0 without a visible key, sink or not
    # Underflow: absolute, per value column: (2 n_i + 2 T + 1) eta max|v| over the keys.
    v_max = np.abs(v).max(axis=-2, initial=0.0)  # (..., Hk, Dv)
    v_max = np.repeat(v_max, q.shape[-3] // v_max.shape[-2], axis=-2) if q.ndim > 2 else v_max
    underflow = ((2 * terms + 2 * steps + 1) * ETA)[..., None] * v_max[..., None, :]
    return Tolerance(out=np.where(seen, 2 * e_out, 0.0), lse=np.where(terms > 0, 2 * e_lse, 0.0),
                     sigma=sigma, visible_keys=n_vis,
                     underflow=np.where(seen[..., None], 2 * underflow, 0.0), delta=delta)


def row_stats(q, k, *, block_q=None, block_k=None, options=None, device=None, dtype=np.float64, workers=None,
              **given):
    """``(sigma, n_vis)``, each ``(..., Hq, Sq)``: a row's score size and visible key count.

    ``sigma_i = max_j |scale| sum_c |q_ic| |k_jc|`` over the row's visible keys (0 for a
    row with none) and ``n_vis_i`` their number, computed tile by tile as the tiled kernel
    visits them (SKIP tiles never touched), so memory stays bounded at any length.
    ``given`` are the masking arguments of `~attnlib.attention` (or ``options``, an
    `~attnlib.core.options.Options`, with ``given`` on top); ``mask_mod`` (or a block mask's)
    joins them; ALiBi and sinks are not the scores' size and are not read.  With ``score_mod`` a third array comes back: ``max |score_mod(s)|``
    over the row's visible keys (``s`` the scores after ``softcap``), the size of what
    the modification computes.  ``dtype``: the type ``|q| . |k|`` is summed in (float32 for
    a size wanted to a few digits, the check's: half float64's time; float64 where it could
    overflow float32).  ``workers``: threads over the query tiles (default: every available CPU).
    """
    opts = dense_options(options, **given)  # contiguous keys, as the dense reference it bounds
    given_terms = sorted(opts.given(("alibi_slopes", "sinks")))
    if given_terms:  # `tolerance` bounds those itself; a row's score size is the q.k terms'
        raise ValueError(f"row_stats does not take {', '.join(given_terms)} (see tolerance)")
    dev = device_of(device, q, k)
    # Computed where q and k are (read back to the host), but programmable masks on the host.
    xp = NUMPY if dev is None or opts.has_mods else backend_for(dev, 1)
    q, k = xp.read(q, "q"), xp.read(k, "k")
    # group checks the shapes and groups the heads; a one-column v stands in for v.
    q5, k5, _, pb = problem.group(q, k, k[..., :1], scale=opts.scale)
    bq = validate.positive_int(DEFAULT_TILES.block_q if block_q is None else block_q, "block_q")
    bk = validate.positive_int(DEFAULT_TILES.block_k if block_k is None else block_k, "block_k")
    specs = opts.specs(pb)
    mask_mod = flex.visible_mod(opts.mask_mod, opts.block_mask)  # a block mask carries its own mask_mod
    if opts.gather_kv_indices is not None:  # top-k lists (never with a mask_mod): their pairs only
        mask_mod = opts.selection(pb)
    score_mod, cap = opts.score_mod, opts.softcap
    mod_size = np.zeros(q5.shape[:-1]) if score_mod is not None else None
    if xp is not NUMPY:  # a device's tensors in float64 (the host keeps the inputs' own type here)
        q5, k5 = xp.operand(q5), xp.operand(k5)
    qa = abs(q5) * abs(pb.scale)  # (*batch, hk, g, sq, d): scaled |q|, as the kernel scales q
    ka = abs(k5)  # (*batch, hk, 1, sk, d)
    if (np.dtype(dtype) != np.float64 and pb.sq and pb.sk
            and not problem.scores_may_overflow(q5, k5, pb.scale, dtype, q_max=pb.max_of("q", q5),
                                                k_max=pb.max_of("k", k5))):
        qa, ka = xp.astype(qa, dtype), xp.astype(ka, dtype)
    sigma = xp.zeros(tuple(q5.shape[:-1]))  # (*batch, hk, g, sq), float64
    n_vis = xp.zeros(tuple(q5.shape[:-1]), dtype=np.int64)
    def query_tile(item):  # one query tile's key tiles: its rows of sigma, n_vis, mod_size alone
        idx, spec, q0, (k_starts, k_ends, ranges) = item
        q1 = min(pb.sq, q0 + bq)
        kinds = spec.tile_kind(q0, q1, k_starts, k_ends, ranges)  # (n_k_tiles,)
        for t in np.flatnonzero(kinds != SKIP):
            a, b = int(k_starts[t]), int(k_ends[t])
            qi, ki = np.arange(q0, q1), np.arange(a, b)
            with xp.ignore_overflow():  # an overflowing size is an infinite one
                s, _ = tile_scores(qa[idx][..., q0:q1, :], ka[idx][..., a:b, :], spec, qi, ki, kinds[t], xp=xp)
            rows = (..., slice(q0, q1))
            if mask_mod is not None or score_mod is not None:
                mods = flex.Mods(mask_mod, score_mod, None, *flex.index_grids(pb, idx))
                vis = mods.visible(None, qi, ki)
                if vis is not None:
                    s = np.where(vis, s, -np.inf)
                if score_mod is not None:  # the modified scores' size, over visible pairs
                    with np.errstate(over="ignore", invalid="ignore"):
                        signed = np.matmul(q5[idx][..., q0:q1, :] * pb.scale,
                                           np.swapaxes(k5[idx][..., a:b, :], -1, -2))
                        if cap is not None:
                            signed = cap * np.tanh(signed / cap)
                        modded = np.abs(flex.score_values(score_mod, signed, *mods.grids(qi, ki)))
                    modded = np.where(np.isfinite(s) & np.isfinite(modded), modded, 0.0)
                    mod_size[idx][rows] = np.maximum(mod_size[idx][rows], modded.max(axis=-1, initial=0.0))
            # Masked pairs are -inf: they neither raise the max (sigma >= 0) nor count.
            sigma[idx][rows] = xp.maximum(sigma[idx][rows], xp.amax(s, -1))
            n_vis[idx][rows] += xp.isfinite(s).sum(-1)

    # idx = (): one mask for every batch entry.  The query tiles write rows of their own: on
    # the host's cores (a device's tiles in order, on its own stream).
    items = [(idx, spec, q0, spec.key_tiles(bk)) for idx, spec in specs.items() for q0 in range(0, pb.sq, bq)]
    run_tiles(query_tile, items, validate.workers(workers) if xp is NUMPY else 1)
    sizes = (xp.to_host(sigma), xp.to_host(n_vis)) + (() if mod_size is None else (mod_size,))
    return tuple(pb.merge_heads(x, 1) for x in sizes)


def _ratio(err, tol):
    """``max err / tol`` elementwise; where ``tol = 0`` any error at all is infinitely over."""
    with np.errstate(over="ignore"):  # a gross error over a tiny tolerance: inf, as it should
        over = np.divide(err, tol, out=np.where(err > 0, np.inf, 0.0), where=tol > 0)
    return float(over.max()) if over.size else 0.0


class Gate:
    """The dense reference of one problem with its tolerances; judges ``(out, lse)`` pairs.

    Building it runs the reference once (``out``, ``P @ |V|`` and ``lse``) and the
    tolerances; with ``oracle=True`` the reference is `~attnlib.core.oracle.oracle_attention`
    (extended precision) and the tolerance one implementation's, half the default; `judge` is then cheap, so many candidate outputs (the real kernel and
    injected defects) can be judged against one reference.

    Examples
    --------
    >>> import attnlib
    >>> from attnlib.judge.gate import Gate
    >>> q, k, v = attnlib.random_qkv(300, 400, 64, seed=0)
    >>> gate = Gate(q, k, v, block_k=64, causal=True)
    >>> out, lse = attnlib.attention(q, k, v, causal=True, block_k=64, return_lse=True)
    >>> gate.judge(out, lse)["passed"]
    True
    >>> gate.judge(out * (1 + 1e-11), lse)["passed"]
    False
    """

    def __init__(self, q, k, v, *, block_k=None, oracle=False, options=None, **given):
        self.options = Options.parse(options, **given)  # once, for every reference below
        self.ref, self.ref_abs, self.ref_lse = reference_with_abs(q, k, v, return_lse=True, options=self.options)
        self.tol = tolerance(q, k, v, self.ref_lse, block_k=block_k, options=self.options)
        self.oracle = bool(oracle)
        if self.oracle:
            # Against the extended-precision oracle only one implementation's error remains:
            # half the tolerance of two.  P @ |V| is a size and stays the float64 one.
            self.ref, self.ref_lse = oracle_attention(q, k, v, return_lse=True, **self.options.given())
            self.tol = self.tol.halved()

    def judge(self, out, lse) -> dict:
        """``rel_error``, ``lse_error`` and their ratios to the gate; ``passed`` when all hold.

        ``out_ratio = max |out - ref| / (P @ |V|) / tol_out`` over entries (``|out - ref|``
        where ``P @ |V| = 0``), ``lse_ratio = max |lse - ref_lse| / tol_lse`` over rows
        (equal infinities, ``-inf`` on rows with no key, count as no error).  Passes when
        ``rel_error < BOUND`` (the contract's requirement) and both ratios are ``<= 1``.
        """
        out = arrays.as_float_array(out, "out").astype(np.float64, copy=False)
        lse = arrays.as_float_array(lse, "lse").astype(np.float64, copy=False)
        if out.shape != self.ref.shape or lse.shape != self.ref_lse.shape:
            raise ValueError(f"out {out.shape} and lse {lse.shape} must have the reference's "
                             f"shapes {self.ref.shape} and {self.ref_lse.shape}")
        abs_err = np.abs(out - self.ref).astype(np.float64)  # the oracle's long double, too
        err = np.divide(abs_err, np.maximum(self.ref_abs, TINY), out=abs_err.copy(),
                        where=self.ref_abs > 0)
        with np.errstate(invalid="ignore"):  # inf - inf: both -inf, no error
            lse_err = np.where(lse == self.ref_lse, 0.0, np.abs(lse - self.ref_lse)).astype(np.float64)
        lse_err = np.where(np.isnan(lse_err), np.inf, lse_err)
        rel = float(err.max()) if err.size else 0.0
        out_ratio = _ratio(abs_err, self.tol.allowed(self.ref_abs))
        lse_ratio = _ratio(lse_err, self.tol.lse)
        return {"rel_error": rel, "lse_error": float(lse_err.max()) if lse_err.size else 0.0,
                "out_ratio": out_ratio, "lse_ratio": lse_ratio,
                "passed": bool(rel < BOUND and out_ratio <= 1 and lse_ratio <= 1)}


def gradient_rounding(delta, n, dv, cap=None) -> float:
    """``e_g``: a first-order bound on one float64 backward's error, relative to each
    gradient entry's own size ``|ref| + rss`` (`reference_attention_backward` with
    ``return_rss``: the root-sum-square of the terms it sums).

    With ``delta`` the largest exponent error of any row (`tolerance`), ``N = max(Sq, Sk)``
    and ``g(n) = lambda sqrt(n) u``: ``p = exp(s - lse)`` is off by ``2 delta + C_EXP u +
    g(N)`` relative (its exponent, ``exp``, and ``lse``'s sum), ``dp = dout . v`` by
    ``g(Dv)``, ``D`` by ``g(N)`` of its terms' size ``sum_j |p dp|`` (which ``rss`` carries
    in ``ds``), and the sum that makes each entry (``ds @ k``, ``ds^T @ q``, ``p^T @ dout``,
    of up to ``N`` terms) by ``g(N)`` and a final rounding::

        e_g = 4 delta + 2 C_EXP u + 4 g(N) + 2 g(Dv) + 3 u   (+ 2 delta / cap with a softcap)

    ``g(Dv)`` of ``dp`` and ``D`` is counted on what those dot products sum componentwise
    (``|dout| . |v|``, `reference_attention_backward` with ``return_rss="dot"``), since
    ``|dp|`` itself may cancel: the gate is ``2 (e_g (|ref| + rss) + 2 g(Dv) rss_dot)``.
    The sums are counted in units of ``rss``, with Higham & Mary's model of independent
    roundings applied to each partial sum: this assumes a sum's partial sums grow like its
    root-sum-square (a random walk) rather than like the sum of absolute values, which
    holds for the terms of both signs that gradients sum and is the one modelling
    assumption here (the gradients report shows how far below the bound correct code sits).
    The softcap's derivative ``1 - tanh**2`` carries ``2 delta / cap`` relative from its
    argument, and ``tanh``'s own rounding absolutely (``rss`` counts ``|1 - tanh**2| + 4 u``).
    """
    e = 4 * delta + 2 * C_EXP * U + 4 * _g(n) + 2 * _g(dv) + 3 * U
    return float(e + (2 * delta / cap if cap is not None else 0.0))


class GradientGate:
    """The dense float64 gradient of one problem with per-entry tolerances: what float64
    rounding allows between two correct backward passes (`gradient_rounding`), twice one
    implementation's ``e_g`` times each entry's own size ``|ref| + rss``; ``dlse``: a loss of
    the LSE too (`attnlib.attention_backward`'s).

    Examples
    --------
    >>> import attnlib
    >>> from attnlib.judge.gate import GradientGate
    >>> q, k, v = attnlib.random_qkv(200, 300, 32, seed=0)
    >>> dout = attnlib.random_qkv(200, 1, 32, seed=1)[0]
    >>> gate = GradientGate(q, k, v, dout, causal=True)
    >>> out, lse = attnlib.attention(q, k, v, causal=True, return_lse=True)
    >>> grads = attnlib.attention_backward(q, k, v, out, lse, dout, causal=True)
    >>> gate.judge(grads)["passed"]
    True
    >>> gate.judge([g * (1 + 3e-12) for g in grads])["passed"]
    False
    """

    def __init__(self, q, k, v, dout, *, dlse=None, sizes=False, options=None, **given):
        from ..core.backward import _score_mod_grad, dense_backward

        mod_grad = given.pop("score_mod_grad", None)
        self.options = Options.parse(options, **given)  # once, for both backwards and the tolerance
        mod_grad = _score_mod_grad(mod_grad, self.options)

        # rss: the terms' sizes with |dp| and D's terms; dot: with what the dot products
        # dp = dout . v and D sum, componentwise (|dp| may cancel), carrying only their g(Dv).
        # sizes: also `gradient_errors`'s P @ |V|-like sizes (``self.sizes``), from the same call.
        first = dense_backward(q, k, v, dout, self.options, mod_grad, return_rss=True, rss_accumulate=0.0,
                               return_abs=validate.flag(sizes, "sizes"), dlse=dlse)
        self.ref, rss = first[0], first[-1]
        self.sizes = first[1] if sizes else None
        _, dot = dense_backward(q, k, v, dout, self.options, mod_grad, return_rss="dot", dlse=dlse)
        self.names = ("dq", "dk", "dv", "dsinks")[:len(self.ref)]
        q, k, v = (arrays.as_float_array(x, name) for x, name in zip((q, k, v), "qkv"))
        rows = tolerance(q, k, v, None, block_k=1, options=self.options)
        # The (query row, key) pairs visible over every head and batch entry: 0 leaves nothing to
        # differentiate (every gradient exactly 0, whatever the kernel), a problem that tests nothing.
        self.visible_pairs = int(np.sum(rows.visible_keys))
        self.e = gradient_rounding(float(np.max(rows.delta, initial=0.0)), max(q.shape[-2], k.shape[-2]),
                                   v.shape[-1], self.options.softcap)
        e_dot = 2 * _g(v.shape[-1])  # dp's and D's sums of Dv terms, each implementation
        #: Each entry's size, what its rounding scales with: ``|ref|`` and its terms' root-sum-square.
        self.size = tuple(np.abs(r) + s for r, s in zip(self.ref, rss))
        self.tol = tuple(2 * (self.e * np.maximum(size, TINY) + e_dot * t) for size, t in zip(self.size, dot))

    def judge(self, grads) -> dict:
        """Per gradient, ``<name>_ratio = max |g - ref| / tol``; ``passed`` when every one is
        ``<= 1`` (NaN and inf are infinitely over)."""
        if len(grads) != len(self.ref):
            raise ValueError(f"grads must be {len(self.ref)} arrays ({', '.join(self.names)}), got {len(grads)}")
        result = {}
        for name, g, r, tol in zip(self.names, grads, self.ref, self.tol):
            g = arrays.as_float_array(g, name).astype(np.float64, copy=False)
            if g.shape != r.shape:
                raise ValueError(f"{name} must have the reference's shape {r.shape}, got {g.shape}")
            err = np.where(np.isfinite(g), np.abs(g - r), np.inf)
            result[f"{name}_ratio"] = _ratio(err, tol)
        result["passed"] = all(result[f"{n}_ratio"] <= 1 for n in self.names)
        return result


__all__ = ["Gate", "GradientGate", "Tolerance", "tolerance", "gradient_rounding", "row_stats", "U", "ETA",
           "TINY", "LAMBDA", "C_EXP", "C_LOG"]
