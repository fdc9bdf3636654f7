"""Inputs for experiments: seeded random q/k/v and adversarial logit families.

Every generator is deterministic in its ``seed`` and returns float64 arrays in the
contract's layout ``(*batch, H, S, D)`` (``(S, D)`` when ``batch=()`` and one head is
asked for with ``heads=None``).

The adversarial families build q and k so that the scaled logits ``s = scale * q k^T``
have a chosen structure with magnitude ``peak`` (default 1e4) on top of noise of order 1:

q_i = A * w_i + sigma * z_i,    k_j = A * u_j + sigma * z'_j,    A = sqrt(peak / scale)

so that ``s_ij = peak * (w_i . u_j) + O(1)`` noise (``z, z'`` standard normal, ``sigma``
chosen to make the noise's standard deviation about 1).  ``w`` and ``u`` say which logits
are large; see `FAMILIES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..core import validate


def _shape(batch, heads, s, d):
    return tuple(batch) + ((heads,) if heads is not None else ()) + (s, d)


def _check_sizes(sq, sk, d, dv):
    for value, name in ((sq, "sq"), (sk, "sk")):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    validate.positive_int(d, "d")
    validate.positive_int(dv, "dv")


def _heads(heads, kv_heads):
    if heads is None:
        if kv_heads is not None:
            raise ValueError("kv_heads needs heads")
        return None, None
    heads = validate.positive_int(heads, "heads")
    kv_heads = heads if kv_heads is None else validate.positive_int(kv_heads, "kv_heads")
    if heads % kv_heads:
        raise ValueError(f"heads must be a multiple of kv_heads, got {heads} and {kv_heads}")
    return heads, kv_heads


def random_qkv(sq, sk=None, d=64, dv=None, *, batch=(), heads=None, kv_heads=None, seed=0):
    """Standard normal ``(q, k, v)``.

    Shapes: ``q (*batch, heads, sq, d)``, ``k (*batch, kv_heads, sk, d)``,
    ``v (*batch, kv_heads, sk, dv)``; the head axis is left out when ``heads`` is None.
    ``sk`` defaults to ``sq``, ``dv`` to ``d``, ``kv_heads`` to ``heads``.
    """
    sk = sq if sk is None else sk
    dv = d if dv is None else dv
    _check_sizes(sq, sk, d, dv)
    heads, kv_heads = _heads(heads, kv_heads)
    shapes = [_shape(batch, heads, sq, d), _shape(batch, kv_heads, sk, d), _shape(batch, kv_heads, sk, dv)]
    validate.check_allocation(8 * sum(math.prod(s) for s in shapes),
                           f"random_qkv's q {shapes[0]}, k {shapes[1]} and v {shapes[2]} (float64)")
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s) for s in shapes)  # q, k, v in turn


#: What an adversarial family measures.  "overflow safety": the softmax puts (nearly) all
#: its weight on one key, so a correct result is exact and the family shows that nothing
#: overflows and stale sums are wiped out cleanly; "accuracy": many keys share the weight at
#: logits of magnitude ``peak``, so the error is a real rounding error, not 0 by construction.
PURPOSES = ("overflow safety", "accuracy")


@dataclass(frozen=True)
class Family:
    """One adversarial family: its name, letter, what it measures and what it stresses."""

    name: str
    letter: str
    stresses: str
    purpose: str = "overflow safety"


FAMILIES = {f.name: f for f in (
    Family("first_tile", "a",
           "One logit near +peak per row, at key 0 (in the first visible key tile); "
           "every later tile holds only O(1) noise. The max is found at once and "
           "never grows again: zero rescales, and the later tiles' weights "
           "exp(noise - peak) underflow to 0."),
    Family("last_tile", "b",
           "One logit near +peak per row, at the first key of the row's last visible "
           "key tile; earlier tiles hold O(1) noise. A late, huge rescale: "
           "alpha = exp(noise - peak) underflows to 0 and must wipe out everything "
           "accumulated before."),
    Family("growing", "c",
           "The first key of key tile b has logit peak * (b + 1) / n_k_tiles, above "
           "O(1) noise: every row's max grows in every visible tile after its first, "
           "the maximal number of rescales, each by exp(-peak / n_k_tiles)."),
    Family("negative", "d",
           "All logits near -peak (plus O(1) noise). Without the max shift every "
           "exp underflows to 0 and the softmax becomes 0/0; the weight stays spread "
           "over many keys.", "accuracy"),
    Family("plateau", "e",
           "All logits near +peak (plus O(1) noise): every key of every tile is near "
           "the max, the weight is spread over all visible keys, and each score carries "
           "a rounding error of about eps * peak.", "accuracy"),
    Family("ramp", "f",
           "Logits peak + 2 * j / block_k (plus O(1) noise): a slow ramp that raises the "
           "max by about 2 in every key tile, so nearly every tile rescales while the "
           "weight stays spread over the last few tiles.", "accuracy"),
    Family("ties", "g",
           "Every key is the same vector (no key noise), so each row's logits, near "
           "+peak, tie exactly across all its tiles: no rescale after the first tile, "
           "and the output is the plain mean of the visible values.", "accuracy"),
    Family("sink", "h",
           "An attention sink: key 0 at peak + 25, every other key near +peak (plus "
           "O(1) noise). The sink holds the max, yet the other keys' weights, each "
           "about exp(-25) ~ 1e-11, add up to a share float64 resolves: a kernel that "
           "skips tiles far below the running max is caught here.", "accuracy"),
)}


def _last_visible_key(sq, sk, causal, causal_align):
    """Per query row, the last key it sees (``-1`` for rows that see none)."""
    if not causal:
        return np.full(sq, sk - 1)
    o = sk - sq if causal_align == "bottom_right" else 0
    return np.minimum(np.arange(sq) + o, sk - 1)


def _directions(family, sq, sk, d, block_k, causal, causal_align, peak):
    """``(w, u)``: row and key directions; ``peak * w @ u.T`` are the big logits."""
    w = np.zeros((sq, d))
    u = np.zeros((sk, d))
    if sk == 0:
        return w, u
    n_tiles = -(-sk // block_k)
    starts = np.arange(n_tiles) * block_k  # first key of each key tile
    sees = _last_visible_key(sq, sk, causal, causal_align) >= 0
    if family not in ("first_tile", "last_tile"):  # every row along channel 0
        w[:, 0] = 1.0
    if family == "negative":
        u[:, 0] = -1.0
    elif family in ("plateau", "ties", "sink"):
        u[:, 0] = 1.0
        if family == "sink":
            u[0, 0] += 25.0 / peak
    elif family == "ramp":  # + 2 logit units per key tile on top of peak
        u[:, 0] = 1.0 + (2.0 / peak) * np.arange(sk) / block_k
    elif family == "growing":
        u[starts, 0] = (np.arange(n_tiles) + 1) / n_tiles
    elif family == "first_tile":
        w[sees, 0] = 1.0
        u[0, 0] = 1.0
    else:  # last_tile: one channel per key tile, the row points at its last visible one
        # With more tiles than channels, tile b shares channel b % d with the earlier tile
        # b - d; its weight gamma grows with b, so the target still holds the row's max.
        tiles = np.arange(n_tiles)
        gamma = np.ones(n_tiles) if n_tiles <= d else 0.5 + 0.5 * (tiles + 1) / n_tiles
        u[starts, tiles % d] = gamma
        target = _last_visible_key(sq, sk, causal, causal_align)[sees] // block_k
        w[np.flatnonzero(sees), target % d] = 1.0
    return w, u


def adversarial_qkv(family, sq, sk=None, d=64, dv=None, *, causal=True,
                    causal_align="bottom_right", block_k=64, peak=1e4,
                    batch=(), heads=None, kv_heads=None, seed=0):
    """``(q, k, v)`` whose scaled logits follow one of the `FAMILIES`.

    Parameters
    ----------
    family : {"first_tile", "last_tile", "growing", "negative", "plateau", "ramp", "ties", "sink"}
        Families (a)-(h); ``FAMILIES[family].stresses`` says what each one tests and
        ``.purpose`` whether it measures overflow safety or accuracy.
    sq, sk, d, dv, batch, heads, kv_heads, seed
        As in `random_qkv`; the logit pattern is the same for every batch entry and head,
        the noise is not.
    causal, causal_align
        The mask the inputs are meant for: "first"/"last visible tile" are found with it.
    block_k : int
        The key tile size the inputs are meant for (tile starts carry the big logits).
    peak : float
        Magnitude of the large logits (scale ``1/sqrt(d)`` assumed).
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    block_k = validate.positive_int(block_k, "block_k")
    validate.causal_align(causal_align)
    if not (isinstance(peak, (int, float)) and math.isfinite(peak) and peak > 0):
        raise ValueError(f"peak must be a positive finite number, got {peak!r}")
    # The noise z, z' and the values: standard normal, exactly as random_qkv draws them.
    z, z_k, v = random_qkv(sq, sk, d, dv, batch=batch, heads=heads, kv_heads=kv_heads, seed=seed)
    scale = 1.0 / math.sqrt(d)
    amp = math.sqrt(peak / scale)
    # Noise: the cross term scale * amp * sigma * (w . z') has standard deviation ~1.
    sigma = 1.0 / (scale * amp)
    w, u = _directions(family, sq, z_k.shape[-2], d, block_k, bool(causal), causal_align, peak)
    if family == "ties":  # identical keys: exact ties within every row
        z_k = np.zeros_like(z_k)
    return amp * w + sigma * z, amp * u + sigma * z_k, v


@dataclass(frozen=True)
class Case:
    """One randomized attention problem: shapes, mask, tiles and the seed of its inputs."""

    sq: int
    sk: int
    d: int
    dv: int
    heads: int
    kv_heads: int
    causal: bool
    causal_align: str
    block_q: int
    block_k: int
    batch: tuple = ()
    seed: int = 0
    # The contract's other options (`feature_cases` sets them; None / 0 / 1: off).
    window: tuple | None = None
    softcap: float | None = None
    alibi_slopes: tuple | None = None
    kv_lengths: tuple | None = None
    q_lengths: tuple | None = None
    documents: int = 0  # > 0: q and k packed with this many documents (segment ids)
    shared_documents: bool = False  # q and k one packed sequence (Sq = Sk): the same boundaries
    kv_splits: int = 1
    rescale_threshold: float = 0.0
    sinks: tuple | None = None  # attention-sink logits, one per query head
    key_leftpad: tuple | None = None  # the first valid key per batch entry
    attention_chunk: int | None = None
    sink_token_length: int = 0  # keys exempt from the window's left bound
    qv: bool = False  # MLA: q holds [q, qv] and k [k, v] (`qkv`); the kernel is called with qv=
    topk: int = 0  # > 0: top-k sparse keys, lists of this many entries (`gather_kv_indices`)
    topk_per_head: bool = False  # the lists per kv head, else shared by the heads

    def qkv(self):
        """The case's ``(q, k, v)`` from `random_qkv`; with ``qv``, the joined problem of MLA's
        scores (`attnlib.core.mla`): ``q = [q, qv]``, ``k = [k, v]`` along the head dim, the
        first ``d`` dimensions being the kernel's own ``q`` and ``k`` (`split_qv`)."""
        q, k, v = random_qkv(self.sq, self.sk, self.d, self.dv, batch=self.batch,
                             heads=self.heads, kv_heads=self.kv_heads, seed=self.seed)
        if not self.qv:
            return q, k, v
        qv = np.random.default_rng(self.seed + 11).standard_normal(q.shape[:-1] + v.shape[-1:])
        return np.concatenate([q, qv], -1), np.concatenate([k, v], -1), v

    def split_qv(self, q, k):
        """``(q, k, qv)`` as the kernel takes them, from `qkv`'s joined ``q`` and ``k``."""
        return q[..., :self.d], k[..., :self.d], q[..., self.d:]

    def mask_kwargs(self) -> dict:
        """Keyword arguments shared by `attention` and `reference_attention`: the masks and
        score options of the contract (only those the case sets besides the causal ones)."""
        kwargs = dict(causal=self.causal, causal_align=self.causal_align)
        for name in ("window", "softcap", "alibi_slopes", "kv_lengths", "q_lengths", "sinks", "key_leftpad",
                     "attention_chunk"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.sink_token_length:
            kwargs["sink_token_length"] = self.sink_token_length
        if self.documents:
            kwargs["q_segment_ids"], kwargs["kv_segment_ids"] = self.segment_ids()
        if self.topk:
            kwargs["gather_kv_indices"] = self.gather_kv_indices()
        return kwargs

    def gather_kv_indices(self):
        """The top-k lists ``(*batch, [kv_heads,] sq, topk)``: seeded keys in ``[-1, sk)``, so
        that about ``1/sk`` of the entries are -1 (no key) and some repeat."""
        heads = (self.kv_heads,) if self.topk_per_head else ()
        rng = np.random.default_rng(self.seed + 13)
        return rng.integers(-1, self.sk, self.batch + heads + (self.sq, self.topk))

    def segment_ids(self):
        """``(q_ids (*batch, sq), kv_ids (*batch, sk))``: ``documents`` sorted documents each,
        with seeded random boundaries (the same for q and k with ``shared_documents``)."""
        rng = np.random.default_rng(self.seed + 7)

        def ids(s):
            cuts = np.sort(rng.integers(0, s + 1, (*self.batch, self.documents - 1)), axis=-1)
            return (np.arange(s) >= cuts[..., None]).sum(axis=-2)

        q_ids = ids(self.sq)
        return (q_ids, q_ids.copy()) if self.shared_documents else (q_ids, ids(self.sk))

    def tile_kwargs(self) -> dict:
        return dict(block_q=self.block_q, block_k=self.block_k)

    def kernel_kwargs(self) -> dict:
        """The tiled kernel's own arguments: tiles, split-KV and the lazy-rescale threshold."""
        return dict(self.tile_kwargs(), kv_splits=self.kv_splits,
                    rescale_threshold=self.rescale_threshold)

    @property
    def mask_name(self) -> str:
        return f"causal/{self.causal_align}" if self.causal else "none"

    @property
    def features(self) -> str:
        """The options the case sets, e.g. ``"window, alibi, kv_splits=4"`` ("-" for none)."""
        names = [name for name, on in (
            ("window", self.window is not None), ("softcap", self.softcap is not None),
            ("alibi", self.alibi_slopes is not None), ("kv_lengths", self.kv_lengths is not None),
            ("q_lengths", self.q_lengths is not None), (f"documents={self.documents}", self.documents),
            (f"kv_splits={self.kv_splits}", self.kv_splits > 1),
            (f"lazy tau={self.rescale_threshold:g}", self.rescale_threshold > 0),
            ("sinks", self.sinks is not None), ("key_leftpad", self.key_leftpad is not None),
            (f"chunk={self.attention_chunk}", self.attention_chunk is not None),
            (f"sink tokens={self.sink_token_length}", self.sink_token_length > 0),
            ("qv", self.qv), (f"topk={self.topk}" + (" per head" if self.topk_per_head else ""), self.topk))
            if on]
        return ", ".join(names) or "-"


def _corner(c, sq, sk, shortest, max_len):
    """Case ``c``'s ``(Sq, Sk)``: the first three pin the corners ``Sq = Sk = max_len``, ``Sq > Sk``
    and ``Sq < Sk`` (no length below ``shortest``), any later one keeps its ``(sq, sk)``."""
    corners = ((max_len, max_len), (max_len, max(shortest, max_len // 3)), (max(shortest, max_len // 5), max_len))
    return corners[c] if c < len(corners) else (sq, sk)


HEAD_DIMS = (16, 32, 59, 64, 128, 256)
BLOCK_SIZES = (16, 32, 48, 64, 100, 128, 256)


def random_cases(n: int = 50, *, seed: int = 0, max_len: int = 4096) -> list[Case]:
    """``n`` seeded random cases for the differential test.

    ``Sq, Sk`` in ``1..max_len`` (log-uniform, so short and long both appear, and rarely
    tile multiples), ``D`` from `HEAD_DIMS` (``Dv`` usually ``D``, sometimes another),
    GQA ratio 1, 2 or ``Hq``, no mask or causal with either alignment, random tiles.
    The first cases pin the corners: ``Sq = Sk = max_len``, ``Sq > Sk`` and ``Sq < Sk``.
    """
    n = validate.positive_int(n, "n")
    max_len = validate.positive_int(max_len, "max_len")
    rng = np.random.default_rng(seed)
    cases = []
    for c in range(n):
        sq, sk = (int(x) for x in np.exp(rng.uniform(0, np.log(max_len), 2)).round())
        sq, sk = _corner(c, max(1, min(sq, max_len)), max(1, min(sk, max_len)), 1, max_len)
        d = int(rng.choice(HEAD_DIMS))
        dv = d if rng.random() < 0.75 else int(rng.choice(HEAD_DIMS))
        heads = int(rng.choice((1, 2, 4)))
        kv_heads = heads // int(rng.choice((1, 2, heads))) if heads > 1 else 1
        mask = int(rng.integers(3))
        cases.append(Case(
            sq=sq, sk=sk, d=d, dv=dv, heads=heads, kv_heads=max(1, kv_heads),
            causal=mask > 0, causal_align="top_left" if mask == 2 else "bottom_right",
            block_q=int(rng.choice(BLOCK_SIZES)), block_k=int(rng.choice(BLOCK_SIZES)),
            seed=seed * 1000 + c,
        ))
    return cases


#: Key tile sizes of the differential run (`differential_cases`).
DIFFERENTIAL_BLOCKS = (32, 64, 128, 256)


def longest_row(sq: int, sk: int, causal: bool, causal_align: str) -> int:
    """The most keys any query row sees (a prefix ``0 .. L-1`` under a causal mask)."""
    if not causal or causal_align == "bottom_right":
        return sk if sq else 0
    return min(sq, sk)  # top_left: the last row sees keys 0 .. sq - 1


def differential_cases(n: int = 50, *, seed: int = 0, max_len: int = 4096, d: int = 64,
                       min_len: int = 64) -> list[Case]:
    """``n`` seeded cases of the differential run: head dim ``d``, lengths up to ``max_len``.

    ``Sq, Sk`` log-uniform in ``min_len..max_len``; 1, 2 or 4 query heads sharing 1, 2 or
    4 kv heads; no mask or causal in either alignment; ``block_q`` and ``block_k`` from
    `DIFFERENTIAL_BLOCKS`, with ``block_k`` at most half the longest row, so that rows
    cross at least two key tiles (three for the longest) and the rescale path runs.  The
    first three cases pin the corners ``Sq = Sk = max_len``, ``Sq > Sk`` and ``Sq < Sk``.
    """
    n = validate.positive_int(n, "n")
    max_len = validate.positive_int(max_len, "max_len")
    d = validate.positive_int(d, "d")
    min_len = validate.positive_int(min_len, "min_len")
    if min_len > max_len or 2 * DIFFERENTIAL_BLOCKS[0] > min_len:
        raise ValueError(f"min_len must be in [{2 * DIFFERENTIAL_BLOCKS[0]}, max_len], "
                         f"got {min_len} with max_len {max_len}")
    rng = np.random.default_rng(seed)
    cases = []
    for c in range(n):
        sq, sk = (int(x) for x in np.exp(rng.uniform(np.log(min_len), np.log(max_len), 2)).round())
        sq, sk = _corner(c, min(max(sq, min_len), max_len), min(max(sk, min_len), max_len), min_len, max_len)
        mask = int(rng.integers(3))
        causal, align = mask > 0, "top_left" if mask == 2 else "bottom_right"
        longest = longest_row(sq, sk, causal, align)
        fitting = [b for b in DIFFERENTIAL_BLOCKS if 2 * b <= longest]
        heads = int(rng.choice((1, 2, 4)))
        kv_heads = heads // int(rng.choice((1, 2, heads))) if heads > 1 else 1
        cases.append(Case(
            sq=sq, sk=sk, d=d, dv=d, heads=heads, kv_heads=max(1, kv_heads),
            causal=causal, causal_align=align,
            block_q=int(rng.choice(DIFFERENTIAL_BLOCKS)), block_k=int(rng.choice(fitting)),
            seed=seed * 1000 + c,
        ))
    return cases


#: The options `feature_cases` cycles through, each on in every ``len(FEATURES)``-th case.
FEATURES = ("window", "softcap", "alibi", "kv_lengths", "q_lengths", "documents", "kv_splits", "lazy",
            "sinks")
#: The 2026 variants: case ``c`` with ``c % 3 == 0`` pins ``VARIANTS[(c // 3) % 5]``, any case
#: draws each with probability 1/6 (from a generator of its own: the draws above stay).
VARIANTS = ("key_leftpad", "attention_chunk", "sink_token_length", "qv", "gather_kv_indices")


def feature_cases(n: int = 50, *, seed: int = 0, max_len: int = 2048) -> list[Case]:
    """``n`` seeded random cases that exercise the contract's options, several at a time.

    Shapes as `random_cases` but lengths log-uniform in ``32..max_len`` and a batch of 1
    or 2 (GQA, both causal alignments, ragged tiles), and on top: a sliding window, a softcap, ALiBi slopes, key
    and query padding, packed documents, split-KV, lazy rescaling and attention sinks (logits
    ``N(0, 2^2)`` per head, beside scores of about ``N(0, 1)``: from negligible to dominant).  Case ``c`` always
    sets feature ``FEATURES[c % len(FEATURES)]`` and each other one with probability 1/3,
    so every option is exercised and most in combination; the case pinned to ALiBi has no
    causal mask, so that keys lie on both sides of its queries.  The `VARIANTS` (left-padded
    keys, chunks, sink tokens inside a window, MLA's qv, top-k lists) join as that constant says.
    """
    n = validate.positive_int(n, "n")
    max_len = validate.positive_int(max_len, "max_len")
    rng = np.random.default_rng(seed)
    cases = []
    for c in range(n):
        base = random_cases(4, seed=seed * 7919 + c, max_len=max_len)[3]  # past the pinned corners
        if FEATURES[c % len(FEATURES)] == "alibi":
            # Keys on both sides of the query: only there does ALiBi's |i + o - j| differ from
            # the signed distance (a causal row sees j <= i + o).
            base = replace(base, causal=False)
        sq, sk = (int(x) for x in np.exp(rng.uniform(np.log(32), np.log(max(32, max_len)), 2)).round())
        batch = (int(rng.integers(1, 3)),)
        on = {f for f in FEATURES if rng.random() < 1 / 3} | {FEATURES[c % len(FEATURES)]}
        w = int(rng.integers(1, max(2, sk // 2)))
        cases.append(replace(
            base, sq=sq, sk=sk, batch=batch, seed=seed * 1000 + c,
            window=(w, None if base.causal else int(rng.integers(0, w + 1))) if "window" in on else None,
            softcap=float(rng.choice((5.0, 30.0))) if "softcap" in on else None,
            alibi_slopes=tuple(2.0 ** (-8 * (np.arange(base.heads) + 1) / base.heads))
            if "alibi" in on else None,
            kv_lengths=tuple(int(x) for x in rng.integers(1, sk + 1, batch)) if "kv_lengths" in on else None,
            q_lengths=tuple(int(x) for x in rng.integers(1, sq + 1, batch)) if "q_lengths" in on else None,
            documents=int(rng.integers(2, 5)) if "documents" in on else 0,
            kv_splits=int(rng.integers(2, 5)) if "kv_splits" in on else 1,
            rescale_threshold=float(rng.choice((2.0, 8.0))) if "lazy" in on else 0.0,
            sinks=tuple(float(x) for x in 2.0 * rng.standard_normal(base.heads)) if "sinks" in on else None,
        ))
        cases[-1] = _with_variants(cases[-1], c, np.random.default_rng((seed, c, 2026)))
    return cases


def _with_variants(case: Case, c: int, rng) -> Case:
    """``case`` with the `VARIANTS` it pins or draws (see there)."""
    on = {name for name in VARIANTS if rng.random() < 1 / 6}
    if c % 3 == 0:
        on.add(VARIANTS[(c // 3) % len(VARIANTS)])
    changes = {}
    if "key_leftpad" in on:
        end = case.kv_lengths if case.kv_lengths is not None else (case.sk,) * case.batch[0]
        changes["key_leftpad"] = tuple(int(rng.integers(0, e + 1)) for e in end)
    if "attention_chunk" in on:
        changes["attention_chunk"] = int(rng.integers(1, max(2, case.sk // 2)))
    if "sink_token_length" in on:
        changes["sink_token_length"] = int(rng.integers(1, 9))
        if case.window is None or case.window[0] is None:  # sink tokens live inside a window's left bound
            w = int(rng.integers(1, max(2, case.sk // 4)))
            changes["window"] = (w, None if case.causal else int(rng.integers(0, w + 1)))
    if "qv" in on:
        changes["qv"] = True
    if "gather_kv_indices" in on:  # from a few keys to more than Sk (repeats, -1: the set's edges)
        changes["topk"] = int(np.exp(rng.uniform(0, np.log(case.sk + 8))))
        changes["topk_per_head"] = bool(rng.random() < 0.5)
    return replace(case, **changes)


def sink_cases(n: int = 12, *, seed: int = 0, max_len: int = 1024) -> list[Case]:
    """``n`` `feature_cases` with attention sinks in every one (logits ``N(0, 2^2)`` per
    head), beside whatever other options each draws: GQA, both alignments, windows,
    padding, documents, softcap, ALiBi, split-KV, lazy rescaling, the 2026 mask variants
    (not MLA's qv: its joined head dims, up to 512, lie beyond the range the backward
    defects of the gradients report are sized for, and a qv row there is the joined plain
    problem's, which the feature run covers).  Drawn from a seed of their own, so that none is a
    problem of ``feature_cases(seed=seed)`` (some of which draw sinks themselves)."""
    rng = np.random.default_rng(seed + 104729)
    cases = [c if c.sinks is not None else replace(c, sinks=tuple(float(x) for x in 2.0 * rng.standard_normal(c.heads)))
             for c in feature_cases(n, seed=seed + 104729, max_len=max_len)]
    return [replace(c, qv=False) for c in cases]


#: Query and key tile sizes of `document_cases`: a tile holds several documents, so that its
#: PARTIAL tiles are computed document block by document block (`attnlib.core.tiles.document_blocks`:
#: b blocks of a 256 x 256 tile never save 16384 pairs each, of a 256 x 512 one for 2 to 6).
DOCUMENT_TILES = ((256, 512), (512, 1024))
#: The options `document_cases` adds: problem ``c >= 2`` sets ``DOCUMENT_OPTIONS[(c - 2) % 6]``
#: and each other one with probability 1/3 (not padding: a packed sequence's rows see no key
#: of another, and bottom-right causal rows on fewer keys would see none of their own).
DOCUMENT_OPTIONS = ("window", "softcap", "alibi", "sinks", "kv_splits", "lazy")


def document_cases(n: int = 8, *, seed: int = 0, max_len: int = 4096) -> list[Case]:
    """``n`` seeded problems of packed documents in tiles large enough to be computed document
    block by document block (`attnlib.core.tiles.document_blocks`), as the feature run's
    small tiles of 2 to 4 documents never are.

    One packed sequence per batch entry (``Sq = Sk`` log-uniform in ``max_len / 2 .. max_len``,
    q and k sharing their documents), documents of 48 to 256 tokens on average (random
    boundaries: from empty to several times that), tiles from `DOCUMENT_TILES`, a batch of 1
    or 2, 1 or 2 query heads over 1 kv head, head dim 64 or 128; causal (problems 0, 2, ...)
    or not, and the `DOCUMENT_OPTIONS` (a sliding window with sink tokens, softcap, ALiBi,
    attention sinks, split-KV, lazy rescaling) as that constant says.  Problems 0 and 1 are
    the documents alone, causal and not.
    """
    n = validate.positive_int(n, "n")
    max_len = validate.positive_int(max_len, "max_len")
    rng = np.random.default_rng((seed, 4096))
    cases = []
    for c in range(n):
        s = int(np.exp(rng.uniform(np.log(max(1, max_len // 2)), np.log(max_len))).round())
        heads = int(rng.choice((1, 2)))
        batch = (int(rng.integers(1, 3)),)
        causal = c % 2 == 0
        on = ({f for f in DOCUMENT_OPTIONS if rng.random() < 1 / 3} | {DOCUMENT_OPTIONS[(c - 2) % len(DOCUMENT_OPTIONS)]}
              if c > 1 else set())
        w = int(rng.integers(16, max(17, s // 4)))
        d = int(rng.choice((64, 128)))
        cases.append(Case(
            sq=s, sk=s, d=d, dv=d, heads=heads, kv_heads=1, causal=causal,
            causal_align="bottom_right", block_q=int(rng.choice(DOCUMENT_TILES[0])),
            block_k=int(rng.choice(DOCUMENT_TILES[1])), batch=batch, seed=seed * 1000 + 500 + c,
            documents=max(2, s // int(rng.integers(48, 257))), shared_documents=True,
            window=(w, None if causal else int(rng.integers(0, w + 1))) if "window" in on else None,
            sink_token_length=int(rng.integers(1, 9)) if "window" in on else 0,
            softcap=float(rng.choice((5.0, 30.0))) if "softcap" in on else None,
            alibi_slopes=tuple(2.0 ** (-8 * (np.arange(heads) + 1) / heads)) if "alibi" in on else None,
            sinks=tuple(float(x) for x in 2.0 * rng.standard_normal(heads)) if "sinks" in on else None,
            kv_splits=int(rng.integers(2, 5)) if "kv_splits" in on else 1,
            rescale_threshold=float(rng.choice((2.0, 8.0))) if "lazy" in on else 0.0,
        ))
    return cases


#: The option sets `varlen_cases` and `paged_cases` cycle through (ALiBi and sinks per head).
LAYOUT_OPTIONS = {
    "causal": dict(causal=True),
    "causal, top_left": dict(causal=True, causal_align="top_left"),
    "none": dict(),
    "window": dict(window=(48, 8)),
    "causal, sinks": dict(causal=True, sinks="per head"),
    "softcap, alibi": dict(softcap=20.0, alibi_slopes="per head"),
}


def _layout_options(name, heads, rng):
    """`LAYOUT_OPTIONS` entry ``name`` with its per-head values drawn."""
    options = dict(LAYOUT_OPTIONS[name])
    if options.get("sinks") == "per head":
        options["sinks"] = 2.0 * rng.standard_normal(heads)
    if options.get("alibi_slopes") == "per head":
        options["alibi_slopes"] = 2.0 ** (-8 * (np.arange(heads) + 1) / heads)
    return options


@dataclass(frozen=True)
class Packed:
    """One varlen problem: sequence lengths, the keys each uses, heads and the options."""

    lens_q: tuple
    lens_k: tuple
    seqused_k: tuple | None
    heads: int
    kv_heads: int
    d: int
    options: str  # a key of LAYOUT_OPTIONS
    seed: int = 0

    def arrays(self):
        """``(q (total_q, Hq, D), k, v (total_k, Hk, D), cu_seqlens_q, cu_seqlens_k, options)``."""
        rng = np.random.default_rng(self.seed)
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(n, dtype=np.int64)]).astype(np.int32)
                      for n in (self.lens_q, self.lens_k))
        q = rng.standard_normal((int(cu_q[-1]), self.heads, self.d))
        k, v = (rng.standard_normal((int(cu_k[-1]), self.kv_heads, self.d)) for _ in range(2))
        return q, k, v, cu_q, cu_k, _layout_options(self.options, self.heads, rng)


def varlen_cases(n: int = 12, *, seed: int = 0, max_len: int = 1024) -> list[Packed]:
    """``n`` seeded varlen problems: 1 to 6 sequences of log-uniform lengths in
    ``8..max_len`` (a fifth of them empty on the query or the key side), ``Sq != Sk`` per
    sequence in half of them (decode-like), ``seqused_k`` in a third, GQA, head dim 32 or 64,
    and the options of `LAYOUT_OPTIONS` in turn."""
    n = validate.positive_int(n, "n")
    rng = np.random.default_rng(seed + 31337)
    names = list(LAYOUT_OPTIONS)
    cases = []
    for c in range(n):
        b = int(rng.integers(1, 7))

        def lengths():
            x = np.exp(rng.uniform(np.log(min(8, max_len)), np.log(max_len), b)).astype(int)
            return np.where(rng.random(b) < 0.2, 0, x)

        lq = lengths()
        lk = lengths() if rng.random() < 0.5 else lq.copy()
        used = tuple(int(x) for x in rng.integers(0, lk + 1)) if rng.random() < 1 / 3 else None
        kv_heads = int(rng.choice([1, 2]))
        cases.append(Packed(tuple(int(x) for x in lq), tuple(int(x) for x in lk), used,
                            kv_heads * int(rng.choice([1, 2])), kv_heads, int(rng.choice([32, 64])),
                            names[c % len(names)], seed * 1000 + c))
    return cases


@dataclass(frozen=True)
class Paged:
    """One paged-cache problem: the entries' key lengths, the page size, spare pages."""

    lens: tuple
    page_size: int
    sq: int
    heads: int
    kv_heads: int
    d: int
    options: str  # a key of LAYOUT_OPTIONS
    spare_pages: int = 16
    seed: int = 0

    def arrays(self):
        """``(q (batch, Hq, Sq, D), k_cache, v_cache, block_table, cache_seqlens, options)``:
        every entry's pages scattered at random among the cache's (the spare ones random
        too), unused table entries -1."""
        rng = np.random.default_rng(self.seed)
        need = [-(-n // self.page_size) for n in self.lens]
        num_blocks = sum(need) + self.spare_pages
        k_cache, v_cache = (rng.standard_normal((num_blocks, self.page_size, self.kv_heads, self.d)) for _ in range(2))
        order = rng.permutation(num_blocks)
        table = np.full((len(self.lens), max(need, default=0) + 1), -1, dtype=np.int32)
        for b, (m, start) in enumerate(zip(need, np.cumsum([0] + need))):  # entry b's pages: the next m of order
            table[b, :m] = order[start:start + m]
        q = rng.standard_normal((len(self.lens), self.heads, self.sq, self.d))
        return (q, k_cache, v_cache, table, np.array(self.lens, dtype=np.int32),
                _layout_options(self.options, self.heads, rng))


def paged_cases(n: int = 12, *, seed: int = 0, max_len: int = 1024) -> list[Paged]:
    """``n`` seeded paged-cache problems: 1 to 4 entries of log-uniform key lengths in
    ``16..max_len`` (some empty), ragged page sizes (1, 7, 16, 64, 256), decode (``Sq = 1``) and
    short prefill (``Sq`` up to 64), GQA, and the options of `LAYOUT_OPTIONS` in turn."""
    n = validate.positive_int(n, "n")
    rng = np.random.default_rng(seed + 271828)
    names = list(LAYOUT_OPTIONS)
    cases = []
    for c in range(n):
        b = int(rng.integers(1, 5))
        lens = np.exp(rng.uniform(np.log(min(16, max_len)), np.log(max_len), b)).astype(int)
        lens = np.where(rng.random(b) < 0.15, 0, lens)
        kv_heads = int(rng.choice([1, 2]))
        cases.append(Paged(tuple(int(x) for x in lens), int(rng.choice([1, 7, 16, 64, 256])),
                           int(rng.choice([1, 1, 4, 64])), kv_heads * int(rng.choice([1, 4])), kv_heads,
                           int(rng.choice([32, 64])), names[c % len(names)], seed=seed * 1000 + c))
    return cases
