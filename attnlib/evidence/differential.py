"""The differential run: cases through the tiled kernel, judged by the gate against the
dense reference, with and without injected defects.

`run_case` and `run_family` return one flat row per problem for the equivalence report's
tables; `power_table` folds the defect results of many rows into one line per defect: the
gate's power.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from .defects import DEFECTS
from ..core import hooks
from ..judge.gate import Gate, GradientGate
from .inputs import FAMILIES, adversarial_qkv, random_qkv
from ..judge.metrics import Errors, _gradient_figures, _visible_keys_per_row, gradient_errors
from ..core.backward import attention_backward
from ..core.masks import SKIP
from ..core.reference import reference_attention, reference_rescales, reference_scores
from ..core.tiled import attention


def _judge_defects(gate, defects, call, clean) -> dict:
    """``{name: judged}`` for each defect: the gate's figures on ``call()`` with it active, and
    ``changed``: whether it moved some entry of ``out`` or ``lse`` by more than twice the real
    kernel's own error there and than 4 units of rounding of the entry's size (``P @ |V|``;
    ``max(1, |lse|)``) (``clean``: the real kernel's ``(out, lse)``; below that a change is
    float64's rounding on that problem, which no gate can tell from the kernel's).

    A defect that makes the kernel raise (e.g. an overflow under strict mode) counts as
    caught and changed: the kernel did not return a result that passes.
    """
    judged = {}
    for name in defects:
        try:
            with DEFECTS[name].active():
                out, lse = call()
            result = gate.judge(out, lse)
            result["raised"] = None
            u = np.finfo(np.float64).eps / 2
            result["changed"] = (_moved(out, clean[0], gate.ref, 4 * u * np.asarray(gate.ref_abs, dtype=np.float64))
                                 or _moved(lse, clean[1], gate.ref_lse, 4 * u * np.maximum(
                                     1.0, np.abs(np.nan_to_num(np.asarray(gate.ref_lse, dtype=np.float64), posinf=0.0, neginf=0.0)))))
        except (FloatingPointError, ValueError) as e:
            result = {"rel_error": np.inf, "lse_error": np.inf, "out_ratio": np.inf,
                      "lse_ratio": np.inf, "passed": False, "raised": f"{type(e).__name__}: {e}", "changed": True}
        judged[name] = result
    return judged


def defect_changed(row, judged) -> bool:
    """Whether a defect's ``judged`` result (`_judge_defects`) counts on the problem ``row``:
    it changed the output beyond float64's resolution there, or the gate failed it (rows
    written before ``changed`` existed: any change of the errors)."""
    if "changed" in judged:
        return bool(judged["changed"] or not judged["passed"])
    return judged["rel_error"] != row["rel_error"] or judged["lse_error"] != row["lse_error"]


def _moved(bad, clean, ref, floor) -> bool:
    """Whether some entry of ``bad`` is further from ``clean`` than twice ``clean``'s error
    against ``ref`` and than ``floor`` (a few units of rounding of the entry's size: where the
    kernel's bits equal the reference's, a change of an ulp is still rounding); equal
    infinities are no distance, any other non-finite one is infinite."""
    with np.errstate(invalid="ignore", over="ignore"):
        bad, clean, ref = (np.asarray(x, dtype=np.float64) for x in (bad, clean, ref))
        step = np.where(bad == clean, 0.0, np.nan_to_num(np.abs(bad - clean), nan=np.inf))
        noise = np.where(clean == ref, 0.0, np.nan_to_num(np.abs(clean - ref), nan=np.inf))
        return bool((step > np.maximum(2 * noise, floor)).any())


def crossing_fraction(sq, sk, block_k, causal, causal_align) -> float:
    """The fraction of query rows whose visible keys span at least two key tiles."""
    if sq == 0:
        return 0.0
    return float(np.mean(_visible_keys_per_row(sq, sk, causal, causal_align) > block_k))


def key_tiles(stats) -> int:
    """The most key tiles the kernel combined into one query tile's rows: over every batch
    entry and query tile of `~attnlib.core.stats.AttentionStats` (or a list of them, one per
    sequence), the key tiles it did not skip.  At most 1: the kernel had nothing to combine
    across key tiles (no rescale, no merge of partial sums), so it can only differ from the
    dense reference inside one tile; 0: it processed no tile."""
    stats = stats if isinstance(stats, (list, tuple)) else [stats]
    counts = [np.count_nonzero(np.asarray(s.tile_kind) != SKIP, axis=-1) for s in stats]
    return int(max((c.max(initial=0) for c in counts), default=0))


def single_tile(row) -> bool:
    """A problem that tests nothing the dense reference does not do itself: every query tile's
    rows saw at most one key tile (``key_tiles`` <= 1) or every row at most one key
    (``visible_keys_max`` <= 1), and the result is the dense reference's own bits
    (``rel_error`` and ``lse_error`` exactly 0): the same arithmetic.  Problems with no
    visible key at all (the gate's tolerance 0 everywhere) are not these: the empty-row rule
    is what they test.  Rows without ``key_tiles`` (written before it) are never single-tile."""
    if "key_tiles" not in row or (row.get("tol_out") == 0 and row.get("tol_lse") == 0):
        return False
    one = row["key_tiles"] <= 1 or row.get("visible_keys_max", 2) <= 1
    return bool(one and row["rel_error"] == 0 and row["lse_error"] == 0)


def run_case(case, defects=(), backends=()) -> dict:
    """One `~attnlib.evidence.inputs.Case` through the tiled kernel, judged by the gate.

    Returns a flat dict: the case's fields, the `~attnlib.judge.metrics.Errors` fields, the
    gate's ``lse_error``, ``out_ratio``, ``lse_ratio`` and ``passed``, the rescale total,
    the tiles computed document block by document block (``document_block_tiles``, see
    `attnlib.core.tiles.document_blocks`), the fraction of rows crossing two key tiles, the most key
    tiles a query tile combined (``key_tiles``, `key_tiles`) and the most keys a row sees
    (``visible_keys_max``; with `single_tile` they tell a problem that tests nothing); with ``defects`` (names in
    `~attnlib.evidence.defects.DEFECTS`), ``"defects": {name: judged}`` against the same reference.
    ``backends``: further backends the kernel runs on (``"torch"``: torch CPU tensors), each
    judged by the same gate, its defects too: ``"on": {backend: {"rel_error", "lse_error",
    "out_ratio", "lse_ratio", "passed", "defects"}}`` (the one kernel, `attnlib.core.backend`).
    """
    q, k, v = case.qkv()
    gate = Gate(q, k, v, block_k=case.block_k, **case.mask_kwargs())

    def call(stats=False, backend=None):
        on = _arrays_of(backend)  # the inputs as the backend's arrays, the results back as numpy's
        # MLA: the kernel takes q, k and qv (else None); the gate judges it by the joined problem
        q_, k_, qv = case.split_qv(q, k) if case.qv else (q, k, None)
        return on(attention(*on(q_, k_, v), qv=on(qv)[0], **case.mask_kwargs(), **case.kernel_kwargs(),
                            return_lse=True, return_stats=stats))

    split = []  # per PARTIAL tile asked: whether it was computed by document blocks
    real = hooks.get("document_blocks")

    def document_blocks(*args):
        blocks = real(*args)
        split.append(blocks is not None)
        return blocks

    with hooks.replaced(document_blocks=document_blocks):  # counted, unchanged
        out, lse, stats = call(stats=True)
    row = {**asdict(case), "mask": case.mask_name, "features": case.features,
           **_judged(gate, out, lse), "total_rescales": stats.total_rescales, "document_block_tiles": sum(split),
           "crossing_fraction": crossing_fraction(case.sq, case.sk, case.block_k, case.causal,
                                                  case.causal_align),
           "key_tiles": key_tiles(stats), "visible_keys_max": _visible_keys_max(gate)}
    if defects:
        row["defects"] = _judge_defects(gate, defects, call, (out, lse))
    for backend in backends:
        out, lse = call(backend=backend)
        judged = _judge_defects(gate, defects, lambda: call(backend=backend), (out, lse)) if defects else {}
        row.setdefault("on", {})[backend] = {**_judged(gate, out, lse, tolerances=False), "defects": judged}
    return row


def _arrays_of(backend):
    """A function of arrays (or of one result tuple): for ``backend`` ``"torch"``, numpy arrays
    in as torch CPU tensors and tensors out as numpy arrays; for None, all as they are."""
    if backend is None:
        return lambda *xs: tuple(xs[0]) if len(xs) == 1 and isinstance(xs[0], tuple) else xs
    if backend != "torch":
        raise ValueError(f"unknown backend {backend!r}: None or 'torch'")
    import torch

    def convert(*xs):
        if len(xs) == 1 and isinstance(xs[0], tuple):  # a result: back to numpy
            return tuple(x.numpy() if isinstance(x, torch.Tensor) else x for x in xs[0])
        return tuple(torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x for x in xs)
    return convert


def _visible_keys_max(gate) -> int:
    """The most keys any row of the gate's problem sees (the sink is no key)."""
    return int(np.max(gate.tol.visible_keys, initial=0))


def _judged(gate, out, lse, tolerances=True) -> dict:
    """The `~attnlib.judge.metrics.Errors` fields of ``out`` and the gate's figures on ``(out, lse)``;
    with ``tolerances``, the gate's largest per-row tolerances: ``tol_out`` (relative to ``P @ |V|``)
    and ``tol_lse`` (absolute), the smallest defects it can be asked to catch there."""
    row = {**Errors.of(out, gate.ref, gate.ref_abs).as_dict(), **gate.judge(out, lse)}
    if tolerances:
        row.update(tol_out=float(np.max(gate.tol.out, initial=0.0)), tol_lse=float(np.max(gate.tol.lse, initial=0.0)))
    return row


def run_family(family, n=4096, d=64, *, block_q=64, block_k=64, causal=True, seed=0,
               oracle=False, defects=()) -> dict:
    """One adversarial family (see `~attnlib.evidence.inputs.FAMILIES`) through the tiled kernel.

    Returns a flat dict: the family, its purpose, its logit span over visible pairs, the
    `~attnlib.judge.metrics.Errors` fields and the gate's figures against the dense reference,
    the rescale total; with ``oracle``, ``oracle_tiled_ratio`` and ``oracle_dense_ratio``
    (and ``oracle_tiled_error``, ``oracle_dense_error``): each implementation against the
    extended-precision oracle, judged by one implementation's tolerance.
    """
    q, k, v = adversarial_qkv(family, n, d=d, block_k=block_k, causal=causal, seed=seed)
    gate = Gate(q, k, v, block_k=block_k, causal=causal)

    def call(stats=False):
        return attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k,
                         return_lse=True, return_stats=stats)

    out, lse, stats = call(stats=True)
    s = reference_scores(q, k, causal=causal)
    visible = s[np.isfinite(s)]
    del s
    info = FAMILIES[family]
    row = {"family": family, "letter": info.letter, "purpose": info.purpose, "n": n, "d": d,
           "logit_min": float(visible.min()), "logit_max": float(visible.max()),
           **_judged(gate, out, lse), "total_rescales": stats.total_rescales}
    if oracle:
        against = Gate(q, k, v, block_k=block_k, causal=causal, oracle=True)
        tiled, dense = against.judge(out, lse), against.judge(*reference_attention(
            q, k, v, causal=causal, return_lse=True))
        row.update(oracle_tiled_error=tiled["rel_error"], oracle_dense_error=dense["rel_error"],
                   oracle_tiled_ratio=max(tiled["out_ratio"], tiled["lse_ratio"]),
                   oracle_dense_ratio=max(dense["out_ratio"], dense["lse_ratio"]),
                   oracle_passed=tiled["passed"] and dense["passed"])
    if defects:
        row["defects"] = _judge_defects(gate, defects, call, (out, lse))
    return row


def sink_rescales(sinks, n=1024, d=64, heads=4, *, block_q=128, block_k=128, seed=0) -> list[dict]:
    """The sink's effect on the rescale counts: one causal problem ``(1, heads, n, d)`` with
    standard normal inputs (scores about ``N(0, 1)``), run with every head's sink set to each
    value of ``sinks`` (None: no sink).  Per value: the kernel's rescale total, the
    independent count of `reference_rescales` (``agree``: every tile's count equal), the
    rows whose max never leaves the sink, and the gate's figures against the dense reference."""
    q, k, v = random_qkv(n, n, d, batch=(1,), heads=heads, seed=seed)
    scores = reference_scores(q, k, causal=True)
    row_max = scores.max(axis=-1)  # (1, heads, n): every row sees at least its own key
    rows = []
    for value in sinks:
        sink = None if value is None else np.full(heads, float(value))
        gate = Gate(q, k, v, block_k=block_k, causal=True, sinks=sink)
        out, lse, stats = attention(q, k, v, causal=True, sinks=sink, block_q=block_q,
                                    block_k=block_k, return_lse=True, return_stats=True)
        want = reference_rescales(scores, block_q, block_k, sinks=sink)
        rows.append({"sink": "none" if value is None else float(value),
                     "total_rescales": stats.total_rescales, "reference_rescales": int(want.sum()),
                     "agree": bool(np.array_equal(stats.rescales, want)),
                     "rows_held_by_sink": 0 if sink is None else int(np.count_nonzero(row_max <= value)),
                     **_judged(gate, out, lse, tolerances=False)})
    return rows


def run_varlen(case) -> dict:
    """One `~attnlib.evidence.inputs.Packed` problem through `attention_varlen`, judged by the gate
    on the same problem padded into a batch (``q_lengths``, ``kv_lengths``: an independent
    route to attending each sequence alone), with the gate's largest tolerances (``tol_out``,
    ``tol_lse``: both 0 on a problem with no visible key, which tests nothing), the most key
    tiles a query tile combined over the sequences (``key_tiles``) and the most keys a row sees
    (``visible_keys_max``)."""
    from ..judge.packing import unpack_varlen
    from ..core.varlen import attention_varlen

    q, k, v, cu_q, cu_k, options = case.arrays()
    out, lse, stats = attention_varlen(q, k, v, cu_q, cu_k, seqused_k=case.seqused_k, return_lse=True,
                                       return_stats=True, **options)
    names = {n: n for n in ("q", "k", "v", "out", "lse")}
    padded, q_lengths, kv_lengths = unpack_varlen(dict(q=q, k=k, v=v, out=out, lse=lse), cu_q, cu_k,
                                                  case.seqused_k, options.get("sinks"), names)
    qb, kb, vb, ob = (np.swapaxes(padded[n], 1, 2) for n in ("q", "k", "v", "out"))  # bhsd
    gate = Gate(qb, kb, vb, q_lengths=q_lengths, kv_lengths=kv_lengths, **options)
    return {"sequences": len(case.lens_q), "total_q": int(cu_q[-1]), "total_k": int(cu_k[-1]),
            "longest": int(max(max(case.lens_q), max(case.lens_k))), "seqused_k": case.seqused_k is not None,
            "heads": case.heads, "kv_heads": case.kv_heads, "d": case.d, "options": case.options,
            **_judged(gate, ob, padded["lse"]),
            "key_tiles": key_tiles(stats), "visible_keys_max": _visible_keys_max(gate)}


def run_paged(case) -> dict:
    """One `~attnlib.evidence.inputs.Paged` problem through `attention` over its page table, judged
    by the gate on the contiguous keys (``kv_lengths = cache_seqlens``), with the gate's largest
    tolerances (``tol_out``, ``tol_lse``: both 0 on a problem with no visible key), the most
    key tiles an entry's rows combine (``key_tiles``: its chunks of whole pages, the paged path's
    key tiles, ``ceil(keys / chunk)``; a mask may skip some) and the most keys a row sees
    (``visible_keys_max``)."""
    from ..core.paged import DEFAULT_CHUNK_KEYS, gather_pages

    q, k_cache, v_cache, table, lens, options = case.arrays()
    out, lse = attention(q, k_cache, v_cache, block_table=table, cache_seqlens=lens, return_lse=True,
                         **options)
    k, v = gather_pages(k_cache, table, lens), gather_pages(v_cache, table, lens)
    if k.shape[2] == 0:  # no entry has a key: one zero key, invisible to all
        k, v = (np.zeros(x.shape[:2] + (1,) + x.shape[3:]) for x in (k, v))
    gate = Gate(q, k, v, kv_lengths=lens, **options)
    chunk = max(1, DEFAULT_CHUNK_KEYS // case.page_size) * case.page_size  # as `paged_forward` reads them
    return {"entries": len(case.lens), "keys": list(case.lens), "page_size": case.page_size, "sq": case.sq,
            "pages": int(k_cache.shape[0]), "heads": case.heads, "kv_heads": case.kv_heads, "d": case.d,
            "options": case.options, **_judged(gate, out, lse),
            "key_tiles": max((-(-int(n) // chunk) for n in case.lens), default=0),
            "visible_keys_max": _visible_keys_max(gate)}


def power_table(groups, defects=None, backend=None) -> list[dict]:
    """One row per defect over the ``"defects"`` results of `run_case`/`run_family` rows.

    ``groups`` maps a run's name to its rows (a plain list is one group, "cases").  Per
    group, ``"<group>"`` is ``"caught/affected"``: problems the gate failed, of those where
    the defect changed the output beyond float64's resolution there (``changed``, see
    `_judge_defects`: an off-by-one causal mask cannot change an unmasked problem, a window
    defect one without a window).  ``worst rel_error``,
    ``worst lse_error`` and ``max ratio`` (the larger of the out and lse ratios to the gate)
    over all groups give its size, ``judged`` and ``caught`` the totals; ``verdict`` is "caught" when at least one problem fails
    (the report's verdict is then FAIL), else "MISSED".  ``backend``: the rows' results on that
    backend (`run_case`'s ``"on"``), over the rows that ran there.
    """
    groups = {"cases": groups} if isinstance(groups, list) else dict(groups)
    if backend is not None:
        groups = {g: [r["on"][backend] for r in rows if backend in r.get("on", {})] for g, rows in groups.items()}
    table = []
    for name in DEFECTS if defects is None else defects:
        entry = {"defect": name, "description": DEFECTS[name].description}
        results, caught = [], 0
        for group, rows in groups.items():
            judged = [(r, r["defects"][name]) for r in rows if name in r.get("defects", {})]
            hit = sum(not j["passed"] for _, j in judged)
            affected = sum(defect_changed(r, j) for r, j in judged)
            entry[group] = f"{hit}/{affected}"
            results += judged
            caught += hit
        entry.update({
            "judged": len(results), "caught": caught,
            "affected": sum(int(entry[g].split("/")[1]) for g in groups),
            "worst rel_error": max((j["rel_error"] for _, j in results), default=0.0),
            "worst lse_error": max((j["lse_error"] for _, j in results), default=0.0),
            "max ratio": max((max(j["out_ratio"], j["lse_ratio"]) for _, j in results), default=0.0),
            "verdict": "caught" if caught else "MISSED"})
        table.append(entry)
    return table


def _gradients_row(q, k, v, seed, tiles, defects=(), backends=(), **kwargs) -> dict:
    out, lse = attention(q, k, v, return_lse=True, **kwargs, **tiles)
    dout = np.random.default_rng(seed).standard_normal(out.shape)
    gate = GradientGate(q, k, v, dout, sizes=True, **kwargs)  # one dense backward for both
    row = {}
    for backend in (None,) + tuple(backends):  # numpy's first, then the same kernel on each backend
        on = _arrays_of(backend)  # the inputs as the backend's arrays, the gradients back as numpy's

        def backward():
            return on(attention_backward(*on(q, k, v, out, lse, dout), **kwargs, **tiles))
        grads = backward()
        figures = _gate_figures(gate, grads, defects, backward)
        if backend is None:
            row.update({f"{name}_error": err for name, err in _gradient_figures(grads, gate.ref, gate.sizes).items()},
                       **figures)
        else:
            row.setdefault("on", {})[backend] = figures
    return row


def _gate_figures(gate, grads, defects, backward) -> dict:
    """The gradient gate's verdict on ``grads`` (``gate_e``, ``gate_ratio``, ``gate_passed``),
    the problem's visible (query row, key) pairs (``visible_pairs``; 0: nothing to differentiate,
    the problem tests nothing) and, with ``defects``, whether it fails ``backward()`` run with each one active
    (``defects_caught``; None where the defect moves no entry by more than twice the real
    backward's own error there and 4 units of rounding of the entry's size, `_moved`, and passes)."""
    verdict = gate.judge(grads)
    row = {"gate_e": gate.e, "gate_ratio": max(verdict[f"{n}_ratio"] for n in gate.names),
           "gate_passed": verdict["passed"], "visible_pairs": gate.visible_pairs}
    caught = {}
    # A defect that moves no entry by more than twice the kernel's own error there and 4 units
    # of rounding of the entry's size is below what float64 resolves there (None: not counted).
    u = np.finfo(np.float64).eps / 2
    for defect in defects:  # each through the same gate
        with defect.active():
            bad = backward()
        failed = not gate.judge(bad)["passed"]  # a failure counts as a change (the equivalence report's rule)
        caught[defect.name] = failed if failed or any(_moved(b, g, r, 4 * u * size) for b, g, r, size in zip(
            bad, grads, gate.ref, gate.size)) else None
    if defects:
        row["defects_caught"] = caught
    return row


def run_case_gradients(case, defects=(), backends=()) -> dict:
    """`run_case` for the backward pass: tiled vs dense ``dq, dk, dv`` for a standard normal
    upstream gradient; returns the case's fields, the `gradient_errors` fields with an
    ``_error`` suffix (``dq_error``, ..., ``dq_normwise_error``, ...), the verdict of the
    gradient gate (`attnlib.judge.gate.GradientGate`: ``gate_ratio``, ``gate_passed``, ``gate_e``)
    and, for each of ``defects`` (`attnlib.evidence.defects.BACKWARD_DEFECTS` values), whether the
    gate fails the backward with it injected (``defects_caught``; None where it moves no
    entry by more than twice the real backward's own error there and 4 units of rounding of
    the entry's size: below float64's resolution on that problem).  ``backends``: further backends the backward runs on (``"torch"``:
    torch CPU tensors), each judged by the same gate with the same defects: ``"on": {backend:
    {"gate_ratio", "gate_passed", "defects_caught", ...}}`` (the one kernel, `attnlib.core.backend`)."""
    q, k, v = case.qkv()  # with qv: the joined problem, whose dk holds dv's second part (`attnlib.core.mla`)
    errors = _gradients_row(q, k, v, case.seed + 1, case.tile_kwargs(), defects, backends, **case.mask_kwargs())
    features = case.features.replace("qv", "qv (the joined problem's gradients)")
    return {**asdict(case), "mask": case.mask_name, "features": features, **errors}


def run_family_gradients(family, n=2048, d=64, *, block_q=64, block_k=64, causal=True, seed=0,
                         defects=()) -> dict:
    """`run_family` for the backward pass: gradient errors on one adversarial family, the
    gate's verdict and the ``defects`` caught (as `run_case_gradients`)."""
    q, k, v = adversarial_qkv(family, n, d=d, block_k=block_k, causal=causal, seed=seed)
    errors = _gradients_row(q, k, v, seed + 1, dict(block_q=block_q, block_k=block_k), defects, causal=causal)
    return {"family": family, "letter": FAMILIES[family].letter, "n": n, "d": d, **errors}


def run_varlen_gradients(case, seed=0, defects=()) -> dict:
    """`attention_varlen_backward` on a `~attnlib.evidence.inputs.Packed` problem against the dense
    gradient of the same problem padded into a batch (``q_lengths``, ``kv_lengths``), for a
    standard normal ``dout``: the `gradient_errors` fields with an ``_error`` suffix, the
    gradient gate's verdict on the padded gradients (``gate_e``, ``gate_ratio``,
    ``gate_passed``; the padded rows and keys are zeros on both sides) and, for each of
    ``defects``, whether the gate fails the varlen backward with it injected
    (``defects_caught``, as `run_case_gradients`)."""
    from ..judge.packing import unpack_varlen
    from ..core.varlen import attention_varlen, attention_varlen_backward

    q, k, v, cu_q, cu_k, options = case.arrays()
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, seqused_k=case.seqused_k, return_lse=True, **options)
    dout = np.random.default_rng(seed).standard_normal(out.shape)

    def backward():
        return attention_varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k, seqused_k=case.seqused_k, **options)

    names = {n: n for n in ("q", "k", "v", "dout", "dq", "dk", "dv")}

    def padded(grads):  # the packed gradients in the padded batch's (b, h, s, d) layout
        p, q_lengths, kv_lengths = unpack_varlen(dict(q=q, k=k, v=v, dout=dout, dq=grads[0], dk=grads[1],
                                                      dv=grads[2]), cu_q, cu_k, case.seqused_k, None, names)
        bhsd = {n: np.swapaxes(x, 1, 2) for n, x in p.items()}
        return bhsd, (bhsd["dq"], bhsd["dk"], bhsd["dv"]) + tuple(grads[3:]), q_lengths, kv_lengths

    bhsd, grads, q_lengths, kv_lengths = padded(backward())
    errors = gradient_errors(grads, bhsd["q"], bhsd["k"], bhsd["v"], bhsd["dout"], q_lengths=q_lengths,
                             kv_lengths=kv_lengths, **options)
    gate = GradientGate(bhsd["q"], bhsd["k"], bhsd["v"], bhsd["dout"], q_lengths=q_lengths,
                        kv_lengths=kv_lengths, **options)
    return {"sequences": len(case.lens_q), "total_q": int(cu_q[-1]), "total_k": int(cu_k[-1]),
            "seqused_k": case.seqused_k is not None, "heads": case.heads, "kv_heads": case.kv_heads,
            "options": case.options, "dsinks_error": None,  # None: the problem has no sinks
            **{f"{name}_error": err for name, err in errors.items()},
            **_gate_figures(gate, grads, defects, lambda: padded(backward())[1])}

__all__ = ["run_case", "run_family", "power_table", "crossing_fraction", "sink_rescales", "run_varlen",
           "run_paged", "key_tiles", "single_tile"]
