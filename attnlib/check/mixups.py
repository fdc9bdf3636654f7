"""How often the check names a mix-up: the 2026 conventions and variants a kernel gets wrong.

Each mix-up is a kernel that computed a neighbouring problem exactly (the float64 answer to it
rounded once to the kernel's type, as in `attnlib.check.power`; the fp8 ones attnlib's fp8
arithmetic on the mishandled descales): an LSE in another convention
(base 2, the sink in or out, the other infinity on empty rows), FlexAttention's ``max_scores``
in base 2 or with the sink taken as a score, a variant left out
(``attention_chunk``, ``sink_token_length``, ``key_leftpad``), top-k lists ignored or their
``-1`` entries read as a key (the last, wrapped; or key 0, clamped), MLA's ``qv`` ignored or its
``Dv`` left out of the default scale, fp8 descales ignored, applied twice or per tensor,
block-sparse lists read with query and key blocks exchanged, one of several KV sources left out
or its mask ignored (`attnlib.core.sources`: judged as the joined problem), dropout with its
``1 / (1 - p)`` left out, ``1 / p`` in its place or the keep mask inverted (and in the
backward: no dropout, the mask inverted, the ``1 / (1 - p)`` left out; judged by ``dq``), the
normalised weights rounded to an fp8 ``intermediate_dtype`` (at 1024 keys), native sparse
attention with its gates in another order or its selected branch left out (`attnlib.check.nsa`),
block scales misread (one block off, the wrong block size, E8M0 read as E4M3, one per tensor, NVFP4's per-tensor scale
left out) and SageAttention's LSE without its mean key, and a
loss's gradient of the LSE (``dlse``) ignored, its sign flipped or taken in the other base (the
gradients of the neighbouring loss, rounded once; judged by ``dq``).
A run *fails* when the check fails the tensor the mix-up changed, and is *named* when its
diagnosis holds the words that name that mix-up; the hit rate is named runs over runs.  As in
`attnlib.check.power`, a mix-up that moves no entry of ``out`` by more than `RESOLVED_ULPS`
ulps of the correct answer rounded to the type is no run: it vanishes in the type (a scale
changed under a softmax that is one-hot there, e.g. MLA's scores at ``v`` of 1e2 in bfloat16).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..core.lse_conventions import LN2
from ..core.backward import attention_backward
from ..core.block_sparse import block_mask_from_kv_blocks
from ..core.dropout import attention_dropout, attention_dropout_backward
from ..core.nsa import NSA, nsa_attention
from ..core.sources import attention_sources, join_sources, source
from ..core.problem import precision
from ..core.tiled import attention
from . import memo
from .power import _changed, _round
from .verdict import check_kernel

#: (batch, Hq, Hk, Sq, Sk, D): a causal prefill with GQA.
SHAPE = (1, 4, 2, 96, 96, 32)


def _problem(prec, magnitude, seed, dv=None):
    """``(q, k, v, qv)`` bhsd float64 values rounded to the inputs' type (float8_e4m3fn for
    the fp8 kernel, else the compute type); ``v`` scaled by ``magnitude`` and ``qv`` by its
    inverse, so that MLA's scores ``qv . v`` keep their size while the output takes ``v``'s
    (fp8: ``v``'s descale is scaled instead, `cases`, as fp8 values stay below 448)."""
    b, hq, hk, sq, sk, d = SHAPE
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((b, hq, sq, d)), rng.standard_normal((b, hk, sk, d)),
          rng.standard_normal((b, hk, sk, dv or d)), rng.standard_normal((b, hq, sq, dv or d))]
    if prec.p_type is not None:  # an fp8 kernel reads fp8 values
        return tuple(np.asarray(x * 3).astype(prec.p_type).astype(np.float64) for x in xs)
    xs[2], xs[3] = magnitude * xs[2], xs[3] / magnitude
    return tuple(prec.round(x).astype(np.float64) for x in xs)


def _answer(prec, q, k, v, **opts):
    """``(out, lse, max_scores)``: the float64 answer rounded once to the kernel's types."""
    out, lse, top = attention(q, k, v, return_lse=True, return_max_scores=True, **opts)
    with np.errstate(over="ignore"):
        return (prec.round(out).astype(np.float64), lse.astype(np.float32).astype(np.float64),
                top.astype(np.float32).astype(np.float64))


def cases(prec_name, magnitude, seed) -> list:
    """``(name, words, q, k, v, told, tensors)``: the mix-ups of one problem; ``told``: the
    check's options (the problem as it should be), ``tensors``: the kernel's ``out``/``lse``."""
    prec = precision(prec_name)
    q, k, v, qv = _problem(prec, magnitude, seed)
    out = []
    if prec.p_type is None:
        sinks = np.linspace(-1.0, 2.0, SHAPE[1])
        right = _answer(prec, q, k, v, causal=True, sinks=sinks)
        keys_only = _answer(prec, q, k, v, causal=True)
        short = dict(causal=True, kv_lengths=[40])  # bottom-right: the first 56 rows see no key
        plain = _answer(prec, q, k, v, **short)
        out += [
            ("lse in base 2", "the lse is in base 2", dict(causal=True), dict(out=keys_only[0], lse=keys_only[1] / LN2)),
            ("lse without the sink (FlashMLA's)", "excludes the sink", dict(causal=True, sinks=sinks),
             dict(out=right[0], lse=keys_only[1])),
            ("lse with the sink, told excluded", "includes the sink",
             dict(causal=True, sinks=sinks, lse_sink="excluded"), dict(out=right[0], lse=right[1])),
            ("empty rows +inf, told -inf", "rows without a visible key hold +inf", dict(short, lse_empty="-inf"),
             dict(out=plain[0], lse=np.where(np.isneginf(plain[1]), np.inf, plain[1]))),
            # FlexAttention's max_scores: in base 2 (its kernels' own units), or the running max
            # that started at the sink.
            ("max_scores in base 2", "max_scores in base 2", dict(causal=True),
             dict(out=keys_only[0], max_scores=keys_only[2] / LN2)),
            ("max_scores with the sink", "the sink taken as a score", dict(causal=True, sinks=sinks),
             dict(out=right[0], max_scores=np.maximum(right[2], sinks[None, :, None]))),
        ]
        # Top-k lists with a quarter of their entries -1 (no key): dropped, or -1 read as a key.
        idx = np.random.default_rng(2000 + seed).integers(0, SHAPE[4], size=(SHAPE[0], SHAPE[3], 24))
        idx[..., ::4] = -1
        d, dv = q.shape[-1], v.shape[-1]
        # (name, words, told, computed): the output of the problem ``computed`` for ``told`` (words None: the name).
        wrong = [("attention_chunk ignored", None, dict(causal=True, attention_chunk=32), dict(causal=True)),
                 ("sink_token_length ignored", None, dict(causal=True, window=(16, 0), sink_token_length=4),
                  dict(causal=True, window=(16, 0))),
                 ("key_leftpad ignored", None, dict(causal=True, key_leftpad=[10]), dict(causal=True)),
                 ("gather_kv_indices ignored", None, dict(causal=True, gather_kv_indices=idx), dict(causal=True)),
                 ("-1 entries read as key Sk - 1", "the -1 entries read as key Sk - 1", dict(gather_kv_indices=idx),
                  dict(gather_kv_indices=np.where(idx < 0, idx + SHAPE[4], idx))),
                 ("-1 entries read as key 0", "the -1 entries read as key 0", dict(gather_kv_indices=idx),
                  dict(gather_kv_indices=np.where(idx < 0, 0, idx))),
                 ("qv ignored (its default scale 1/sqrt(D))", "qv ignored", dict(causal=True, qv=qv),
                  dict(causal=True)),
                 ("MLA scale 1/sqrt(D)", "not 1/sqrt(D + Dv)", dict(causal=True, qv=qv),
                  dict(qv=qv, causal=True, scale=1 / math.sqrt(d)))]
        # Block-sparse lists (FlexAttention's, FlashAttention 4's): 32 x 32 blocks, each query block
        # its diagonal one and a random third of the others, read transposed.
        n = SHAPE[3] // 32
        listed = np.random.default_rng(4000 + seed).random((n, n)) < 1 / 3
        listed[np.arange(n), np.arange(n)] = True

        def as_lists(m):
            order = np.argsort(~m, axis=-1, kind="stable")  # each row's listed blocks first
            return m.sum(-1)[None, None], order[None, None]

        blocks = [block_mask_from_kv_blocks(*as_lists(m), block_size=32, mask_mod=lambda b, h, i, j: i >= j)
                  for m in (listed, listed.T)]
        wrong.append(("block lists read transposed", "the block lists transposed", dict(block_mask=blocks[0]),
                      dict(block_mask=blocks[1])))
        for name, words, told, computed in wrong:
            out.append((name, words or name, told, dict(out=_answer(prec, q, k, v, **computed)[0])))
        # Two KV sources in one softmax (a window of the cache, a compressed cache): one left out, or
        # its mask ignored; the problem as the check judges it, joined
        sources = [source(k[..., :64, :], v[..., :64, :], "window", causal=True, window=(24, 0)),
                   source(k[..., 64:, :], v[..., 64:, :], "compressed", mask_mod=lambda b, h, i, j: 2 * j <= i)]
        k_joined, v_joined, joined = join_sources(q, sources)
        for name, words, computed in (
                ("a KV source left out", "source 'compressed' (2 of 2) left out", sources[:1]),
                ("a KV source's mask ignored", "source 'window''s mask ignored",
                 [source(sources[0].k, sources[0].v, "window"), sources[1]])):
            with np.errstate(over="ignore"):
                got = prec.round(attention_sources(q, computed)).astype(np.float64)
            out.append((name, words, dict(mask_mod=joined), dict(out=got), dict(k=k_joined, v=v_joined)))
        # Native sparse attention: the gates in another order, the selected branch left out
        nsa = NSA(block_size=16, stride=8, select_block_size=32, top_n=2, window=24)
        gates = np.random.default_rng(6000 + seed).random(q.shape[:-1] + (3,))
        branches = nsa_attention(q, k, v, gates, nsa, return_branches=True)[1]
        parts = [branches[b] for b in ("compressed", "selected", "window")]
        for name, words, got in (
                ("NSA gates swapped (compressed <-> window)", "the gates applied in the order window, selected, "
                 "compressed", gates[..., 2:3] * parts[0] + gates[..., 1:2] * parts[1] + gates[..., 0:1] * parts[2]),
                ("NSA selected branch left out", "the selected branch left out",
                 gates[..., 0:1] * parts[0] + gates[..., 2:3] * parts[2])):
            out.append((name, words, dict(nsa=nsa, gates=gates), dict(out=prec.round(got).astype(np.float64))))
        # Dropout with the kernel's keep mask (p = 0.2): the scaling mishandled, the mask inverted
        keep = np.random.default_rng(5000 + seed).random(q.shape[:-1] + (k.shape[-2],)) >= 0.2
        right_drop = attention_dropout(q, k, v, 0.2, keep, causal=True)
        for name, words, got in (
                ("dropout without 1 / (1 - p)", "1 / (1 - p) left out", right_drop * 0.8),
                ("dropout scaled by 1 / p", "1 / p", right_drop * 0.8 / 0.2),
                ("dropout keep mask inverted", "keep mask inverted", attention_dropout(q, k, v, 0.2, ~keep, causal=True))):
            with np.errstate(over="ignore"):
                out.append((name, words, dict(causal=True, dropout_p=0.2, dropout_mask=keep),
                            dict(out=prec.round(got).astype(np.float64))))
        # dlse (a loss of the LSE too): the gradients of that loss with dlse mishandled, rounded once
        rng = np.random.default_rng(3000 + seed)
        dout = prec.round(rng.standard_normal(q.shape[:-1] + (v.shape[-1],))).astype(np.float64)
        # (of D_i = dout_i . out_i's size, which v's magnitude sets: as ring attention's merge gives it)
        dlse = (2 * magnitude * rng.standard_normal(q.shape[:-1])).astype(np.float32).astype(np.float64)
        # Dropout's gradients (with dlse): the backward without dropout, with the mask inverted, or
        # without 1 / (1 - p) (the gradients of that forward, rounded once)
        drop_told = dict(causal=True, dropout_p=0.2, dropout_mask=keep)
        plain_out, plain_lse = attention(q, k, v, causal=True, return_lse=True)
        for name, words, grads in (
                ("dropout left out of the backward", "no dropout in the backward",
                 attention_backward(q, k, v, plain_out, plain_lse, dout, dlse=dlse, causal=True)),
                ("dropout's keep mask inverted in the backward", "keep mask inverted in the backward",
                 _dropout_grads(q, k, v, dout, dlse, 0.2, ~keep, causal=True)),
                ("dropout's 1 / (1 - p) left out of the backward", "1 / (1 - p) left out",
                 _dropout_grads(q, k, v, dout * 0.8, dlse, 0.2, keep, causal=True))):
            out.append((name, words, drop_told, dict(out=prec.round(right_drop).astype(np.float64), dout=dout, dlse=dlse,
                                                     **dict(zip(("dq", "dk", "dv"), (_round(prec, g) for g in grads))))))
        o64, lse64 = attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
        for name, factor in (("dlse ignored", 0.0), ("dlse with its sign flipped", -1.0),
                             ("dlse times ln 2", LN2)):
            grads = attention_backward(q, k, v, o64, lse64, dout, dlse=dlse * factor, causal=True, sinks=sinks)
            out.append((name, name, dict(causal=True, sinks=sinks),
                        dict(out=right[0], lse=right[1], dout=dout, dlse=dlse,
                             **dict(zip(("dq", "dk", "dv", "dsinks"), (_round(prec, g) for g in grads))))))
        out += _quantised(prec, q, k, v)
        out += _normalised_fp8_weights(prec, magnitude, seed)
        assert d == dv  # the MLA cases take qv of v's head dim
        # (a case's own inputs, where it has them: the joined sources' keys, the quantised elements)
        return [(n, w, *({**dict(q=q, k=k, v=v), **(c[0] if c else {})}[x] for x in "qkv"), told, t)
                for n, w, told, t, *c in out]
    rng = np.random.default_rng(1000 + seed)
    f = {n: rng.uniform(0.05, 0.5, (SHAPE[0], SHAPE[2])).astype(np.float32) for n in ("q", "k", "v")}
    f["v"] = (f["v"] * magnitude).astype(np.float32)
    told = dict(causal=True, q_descale=f["q"], k_descale=f["k"], v_descale=f["v"])
    wrong = [("descales ignored", "the descales ignored", {}),
             ("v_descale ignored", "v_descale ignored", dict(q_descale=f["q"], k_descale=f["k"])),
             ("descales applied twice", "the descales applied twice",
              {f"{n}_descale": x ** 2 for n, x in f.items()}),
             ("per-tensor descales", "per-tensor descales",
              {f"{n}_descale": np.full_like(x, x.max()) for n, x in f.items()})]
    for name, words, descales in wrong:
        o = attention(q, k, v, causal=True, compute_dtype=prec_name, **descales).astype(np.float64)
        out.append((name, words, q, k, v, told, dict(out=o)))
    return out


def measure(precisions=("float32", "bfloat16", "float8_e4m3fn"), magnitudes=(1e-2, 1.0, 1e2),
            seeds=(0, 1)) -> list[dict]:
    """One row per (precision, magnitude, seed, mix-up): failed, named, and the first note."""
    rows = []
    for prec_name, magnitude, seed in itertools.product(precisions, magnitudes, seeds):
        with memo.shared():  # the neighbouring problems the diagnoses try, computed once
            rows += _measure_cases(prec_name, magnitude, seed)
    return rows


def _measure_cases(prec_name, magnitude, seed) -> list[dict]:
    """`measure`'s rows for one precision, magnitude and seed."""
    rows = []
    for name, words, q, k, v, told, tensors in cases(prec_name, magnitude, seed):
        # the judged tensor: a statistic, dq (a mix-up of the gradients), else out
        stat = next((n for n in ("dq", "lse", "max_scores") if n in tensors), None)
        # Against the told problem's float64 answer rounded once to the kernel's output type.
        prec, right = precision(prec_name), None
        if stat is None:
            right = dict(out=_round(prec, _exact_out(q, k, v, told)))
        elif stat == "dq":
            right = dict(dq=_round(prec, _exact_grads(q, k, v, told, tensors)[0]))
        if right is not None and not _changed(tensors, right, stat or "out", prec_name):
            continue  # the mix-up vanishes in the type
        stored = (q, k, v)
        if prec_name == "float8_e4m3fn":  # the fp8 values the kernel read (`_problem`)
            stored = (x.astype(precision(prec_name).p_type) for x in stored)
        r = _check(stored, tensors, prec_name, told)
        judged = r.out if stat is None else r.grads[stat] if stat == "dq" else getattr(r, stat)
        # The diagnosis only: a statistic's other notes state facts a miss would state too.
        notes = r.diagnosis if stat is None else [n for n in judged.notes if n.startswith("diagnosis: ")]
        rows.append(dict(precision=prec_name, magnitude=magnitude, seed=seed, kernel=name,
                         failed=judged.passed is False, named=any(words in n for n in notes),
                         ratio=float(judged.ratio), note=notes[0] if notes else ""))
    return rows


def right_answers(precisions=("float32", "bfloat16", "float8_e4m3fn"), magnitudes=(1e-2, 1.0, 1e2),
                  seeds=(0, 1)) -> list[dict]:
    """The other side of `measure`: each problem the mix-ups are told, answered right, judged
    the same way (a false alarm here is the check's, not a mix-up's).  The answers: attnlib's
    tiled kernel in the type (fp8: its fp8 arithmetic with the descales; NSA: each branch so,
    gated in float32), with dropout and for the gradients of a loss of the LSE (``dlse``) the
    exact answer rounded once (``exact``: the rule's reference rounded, which tests little).  One
    row per (precision, magnitude, seed, problem): ``problem`` (the first mix-up told it),
    ``exact``, ``passed``, the largest ``ratio`` over the tensors judged."""
    rows = []
    for prec_name, magnitude, seed in itertools.product(precisions, magnitudes, seeds):
        prec, seen = precision(prec_name), set()
        with memo.shared():
            for name, words, q, k, v, told, tensors in cases(prec_name, magnitude, seed):
                key = (tuple(sorted((n, id(x) if isinstance(x, np.ndarray) or callable(x) else str(x))
                                    for n, x in told.items())), tuple(sorted(tensors)))
                if key in seen:
                    continue
                seen.add(key)
                right = _right_answer(prec, q, k, v, told, tensors)
                stored = (q, k, v)
                if prec.p_type is not None:  # the fp8 values the kernel read
                    stored = tuple(x.astype(prec.p_type) for x in stored)
                r = _check(stored, right, prec_name, told)
                judged = [t for t in r.judged if t.passed is not None]
                exact = "dropout_p" in told or "dq" in tensors
                rows.append(dict(precision=prec_name, magnitude=magnitude, seed=seed, problem=name, exact=exact,
                                 tensors=[t.name for t in judged], passed=bool(r.passed),
                                 ratio=max(float(t.ratio) for t in judged)))
    return rows


def _right_answer(prec, q, k, v, told, tensors) -> dict:
    """The tensors of ``tensors``' names for the problem ``told``, computed right (`right_answers`)."""
    drop = {n: told[n] for n in ("dropout_p", "dropout_mask") if n in told}
    q, k, v, rest = _told_inputs(q, k, v, {n: x for n, x in told.items() if n not in drop})
    with np.errstate(over="ignore"):
        if "nsa" in told:  # each branch by the tiled kernel in the type, gated in float32
            nsa, gates = told["nsa"], told["gates"]
            blocks = nsa_attention(q, k, v, gates, nsa, return_branches=True)[1]["blocks"]
            k_cmp, v_cmp = nsa.compressed(k, v)
            sq, sk = q.shape[-2], k.shape[-2]
            parts = [attention(q, k_cmp, v_cmp, mask_mod=nsa.compressed_mod(sq, sk), compute_dtype=prec.name),
                     attention(q, k, v, gather_kv_indices=nsa.keys_of(blocks, sk), causal=True, compute_dtype=prec.name),
                     attention(q, k, v, causal=True, window=(nsa.window - 1, 0), compute_dtype=prec.name)]
            g = gates.astype(np.float32)
            found = dict(out=_round(prec, sum(g[..., i:i + 1] * parts[i].astype(np.float32) for i in range(3))))
        elif drop:
            found = dict(out=_round(prec, attention_dropout(q, k, v, *drop.values(), **rest)),
                         lse=attention(q, k, v, return_lse=True, **rest)[1].astype(np.float32))
        elif prec.p_type is not None:
            found = dict(out=attention(q, k, v, compute_dtype=prec.name, **rest).astype(np.float64))
        else:
            out, lse, top = attention(q, k, v, return_lse=True, return_max_scores=True, compute_dtype=prec.name,
                                      **rest)
            found = dict(out=out.astype(np.float64), lse=lse.astype(np.float64), max_scores=top.astype(np.float64))
        if "dq" in tensors:
            grads = _exact_grads(q, k, v, told, tensors)
            found |= dict(dout=tensors["dout"], dlse=tensors["dlse"],
                          **dict(zip(("dq", "dk", "dv", "dsinks"), (_round(prec, g) for g in grads))))
    return {n: x for n, x in found.items() if n in tensors or n in ("out", "dout", "dlse")}


def _quantised(prec, q, k, v) -> list:
    """The block-scale mix-ups: ``(name, words, told, tensors, inputs)`` with the problem's
    values quantised (MXFP8's scheme, E4M3 elements under E8M0 scales, in blocks of 16 of the
    head dim so that ``D = 32`` holds two; NVFP4: E2M1, an E4M3 scale per 16 and a float32 per
    tensor; SageAttention's keys with the mean key taken off, stored in the type), the kernel
    computing right but for one scale or the LSE's correction."""
    import ml_dtypes

    def mx(x, block=16):
        xb = x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))
        e = np.floor(np.log2(np.abs(xb).max(-1, keepdims=True))) - 8  # E4M3's largest power, 2^8
        elements = np.clip(xb / 2.0 ** e, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        return elements.reshape(x.shape), (2.0 ** e[..., 0]).astype(ml_dtypes.float8_e8m0fnu)

    def values(elements, *scales, block=16):
        out = elements.astype(np.float64)
        for f in scales:
            f = np.asarray(f, dtype=np.float64)
            out = out * (np.repeat(f, block, -1) if f.ndim == out.ndim else f)
        return out

    (qe, qs), (ke, ks), (ve, vs) = mx(q), mx(k), mx(v)
    told = dict(causal=True, q_descale=qs, k_descale=ks, v_descale=vs)
    q_v, k_v = values(qe, qs), values(ke, ks)
    wrong_v = [("MX-style (E8M0 per 16) v scales one block off", "v_descale's blocks read one block off",
                np.roll(vs.astype(np.float64), -1, axis=-1)),
               ("MX-style (E8M0 per 16) v scales read as E4M3", "v_descale's E8M0 scales read as E4M3",
                vs.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)),
               ("MX-style (E8M0 per 16) v one scale per tensor", "v_descale one scale for the tensor",
                np.full(vs.shape, vs.astype(np.float64).flat[0])),
               ("MX-style (E8M0 per 16) v scales read per 32, not 16", "v_descale's scales read as blocks of 32",  # the wrong size
                np.repeat(vs.astype(np.float64)[..., :1], vs.shape[-1], -1))]
    found = []
    with np.errstate(over="ignore"):
        for name, words, f in wrong_v:
            if not np.isfinite(f).all():  # an E8M0 byte that is NaN as E4M3 (0x7f: the scale 1): no such kernel
                continue
            got = prec.round(attention(q_v, k_v, values(ve, f), causal=True)).astype(np.float64)
            found.append((name, words, told, dict(out=got), dict(q=qe, k=ke, v=ve)))
        # NVFP4: v's per-tensor scale left out
        tensor = np.float32(np.abs(v).max() / (6 * 448))
        vb16 = v.reshape(v.shape[:-1] + (v.shape[-1] // 16, 16))
        block = (np.abs(vb16).max(-1) / 6 / tensor).astype(ml_dtypes.float8_e4m3fn)
        v4 = np.clip(vb16 / (block.astype(np.float64)[..., None] * tensor), -6, 6).astype(ml_dtypes.float4_e2m1fn)
        v4 = v4.reshape(v.shape)
        nv_told = dict(causal=True, v_descale=(block, np.array(tensor)))
        got = prec.round(attention(q, k, values(v4, block), causal=True)).astype(np.float64)
        found.append(("NVFP4 per-tensor scale left out", "factor 1 of 2 left out", nv_told, dict(out=got),
                      dict(v=v4)))
        # SageAttention: the LSE of the smoothed keys (the mean key not added back)
        mean = k.mean(-2, keepdims=True) + 1.0
        smoothed = prec.round(k - mean).astype(np.float64)  # the keys the kernel stores
        out, lse = attention(q, smoothed, v, causal=True, return_lse=True)
        found.append(("K smoothing's LSE correction skipped", "k_mean) not added back", dict(causal=True, k_mean=mean),
                      dict(out=prec.round(out).astype(np.float64), lse=lse.astype(np.float32).astype(np.float64)),
                      dict(k=smoothed)))
    return found


def _exact_grads(q, k, v, told, tensors):
    """The float64 gradients of the problem ``told`` (with dropout: `_dropout_grads`'s) for the
    ``dout`` and ``dlse`` of ``tensors``."""
    drop = {n: told[n] for n in ("dropout_p", "dropout_mask") if n in told}
    rest = {n: x for n, x in told.items() if n not in drop}
    if drop:
        return _dropout_grads(q, k, v, tensors["dout"], tensors["dlse"], *drop.values(), **rest)
    o64, lse64 = attention(q, k, v, return_lse=True, **told)
    return attention_backward(q, k, v, o64, lse64, tensors["dout"], dlse=tensors["dlse"], **told)


def _dropout_grads(q, k, v, dout, dlse, rate, keep, **options):
    """The float64 gradients of attention with dropout (`attnlib.core.dropout`)."""
    out, lse = attention_dropout(q, k, v, rate, keep, return_lse=True, **options)
    return attention_dropout_backward(q, k, v, out, lse, dout, rate, keep, dlse=dlse, **options)


def _normalised_fp8_weights(prec, magnitude, seed) -> list:
    """``intermediate_dtype="float8_e4m3fn"``: a kernel that rounds the *normalised* weights to fp8
    (FlashAttention's ``attention_ref`` order), on rows of 1024 keys (``p ~ 1/Sk`` among fp8's
    subnormals; the shared problem's 96 keys are too few for it to show)."""
    from ..core.options import Options
    from ..core.reference import dense_attention

    rng = np.random.default_rng(7000 + seed)
    q, k, v = (prec.round(rng.standard_normal((1, 2, n, 32)) * (magnitude if x == "v" else 1.0)).astype(np.float64)
               for n, x in ((32, "q"), (1024, "k"), (1024, "v")))
    told = dict(intermediate_dtype="float8_e4m3fn")
    with np.errstate(over="ignore"):
        got = dense_attention(q, k, v, Options.parse(), compute_dtype=precision(prec.name, "float8_e4m3fn"),
                              orders=("softmax_first",))
    return [("p normalised, then rounded to fp8 (attention_ref's convention, rejected at long rows)",
             "the normalised weights p / l",
             told, dict(out=np.asarray(got, dtype=np.float64)), dict(q=q, k=k, v=v))]


def _told_inputs(q, k, v, told):
    """``(q, k, v, options)`` of the problem ``told`` as `attention` takes it: with SageAttention's
    ``k_mean``, the dequantised keys plus the mean key (its descales applied here)."""
    if "k_mean" not in told:
        return q, k, v, told
    from ..core import descale
    rest = {n: x for n, x in told.items() if n not in descale.NAMES and n != "k_mean"}
    q, k, v, _ = descale.dequantize(q, k, v, *(told.get(n) for n in descale.NAMES))
    return q, np.asarray(k, dtype=np.float64) + told["k_mean"], v, rest


def _exact_out(q, k, v, told) -> np.ndarray:
    """The float64 output of the problem ``told`` (attention, with dropout, or NSA's)."""
    if "nsa" in told:
        return nsa_attention(q, k, v, told["gates"], told["nsa"])
    q, k, v, told = _told_inputs(q, k, v, {n: x for n, x in told.items() if n != "intermediate_dtype"})
    drop = {n: told[n] for n in ("dropout_p", "dropout_mask") if n in told}
    if drop:
        return attention_dropout(q, k, v, *drop.values(), **{n: x for n, x in told.items() if n not in drop})
    return attention(q, k, v, **told)


def _check(stored, tensors, prec_name, told):
    """`check_kernel` of ``tensors`` for ``told`` (NSA's: `check_nsa`, its verdict and diagnosis
    laid out as a `KernelCheck`'s)."""
    if "nsa" not in told:
        return check_kernel(*stored, **tensors, layout="bhsd", dtype=prec_name, workers=1, **told)
    from types import SimpleNamespace
    from .nsa import check_nsa
    r = check_nsa(*stored, tensors["out"], told["gates"], told["nsa"], layout="bhsd", dtype=prec_name, workers=1)
    return SimpleNamespace(out=r.out, judged=[r.out], passed=r.passed,
                           diagnosis=[n[len("diagnosis: "):] for n in r.out.notes if n.startswith("diagnosis: ")])


def hit_rates(rows) -> list[dict]:
    """Per (mix-up, precision): runs, failed, named, and the hit rate ``named / runs``."""
    table = {}
    for r in rows:
        t = table.setdefault((r["kernel"], r["precision"]), dict(kernel=r["kernel"], precision=r["precision"],
                                                                 runs=0, failed=0, named=0))
        t["runs"] += 1
        t["failed"] += int(r["failed"])
        t["named"] += int(r["named"] and r["failed"])
    for t in table.values():
        t["hit_rate"] = t["named"] / t["runs"]
    return list(table.values())


__all__ = ["SHAPE", "cases", "measure", "hit_rates", "right_answers"]
