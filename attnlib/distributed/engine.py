"""`attention` on a Dask cluster: one task per visible piece, a merge tree per query block."""

from __future__ import annotations

import contextlib
import itertools
import os
import uuid
from dataclasses import replace

import numpy as np

from ..core import descale, mla, problem, sparse, validate
from ..core.online import lse_of, merge_parts
from ..core.options import Options
from ..core.backend import NUMPY, backend_for
from ..core.tiled import prepare, run_keys
from .plan import MERGE_FANIN, make_plan
from .sources import Input, aligned, materialize

#: The default query block and key range of a piece: a task then does about
#: 4096 * 4096 * (2 D + 2 Dv) flops (4.3 GFLOP at D = 64, seconds on one core), far more
#: than Dask's per-task cost (about a millisecond), and holds a few MiB per head.
DEFAULT_BLOCK = 4096


class BlockError(RuntimeError):
    """A task of `attention` failed (other than by losing its worker): names the piece."""


def _piece(q_part, k_part, v_part, spec, scale, cap, slopes, label, sink=None, lists=None, qv_part=None,
           factors=None, device=None):
    """Run the tiled kernel on one piece: ``(out (hq', bq, dv), lse parts (hq', bq, 2))``,
    the lse as ``(m, log l)`` (`online.merge_parts` merges them without the loss of a
    one-float lse at large scores); ``sink`` (the piece's ``hq'`` sinks, the first piece of a
    query block only) starts its rows; ``lists``: the piece's top-k lists in its own key
    positions (`gather_kv_indices`; entries outside the piece select nothing there);
    ``qv_part``: MLA's second query, joined here (`mla.join`); ``factors``: the piece's fp8
    descales, laid out (`descale.factors`), applied first; ``device``: where the kernel runs
    (`_piece_device`)."""
    try:
        dev = _piece_device(device)
        with _meter("read"):
            q, k, v = (materialize(p) for p in (q_part, k_part, v_part))
            qv = None if qv_part is None else materialize(qv_part)
        if factors:
            q, k, v, qv = descale.scaled(q, k, v, qv, factors)
        if qv is not None:
            q, k = mla.join(q, k, v, qv)
        xp = NUMPY if dev is None else backend_for(dev, 1)
        with contextlib.nullcontext() if dev is None else _meter(f"kernel on {dev}"), \
                np.errstate(divide="raise", over="raise", invalid="raise"):
            opts = Options.parse(scale=scale, gather_kv_indices=lists)
            q5, k5, v5, pb, extremes = xp.parse(q, k, v, opts.scale, True)
            setup = prepare(q5, k5, v5, pb, opts, xp=xp, extremes=extremes, spec=spec)
            setup = replace(setup, cap=cap, slopes=xp.from_host(None if slopes is None else slopes.reshape(pb.hk, pb.group)),
                            sink=xp.from_host(None if sink is None else sink.reshape(pb.hk, pb.group)))
            n_k_tiles = -(-pb.sk // setup.tiles.block_k)
            # One thread per task: the cluster's workers are the parallelism.
            sel = setup.selection
            with xp.threads(1):
                if sel is not None and xp is NUMPY and sel.prefer_gather(setup.tiles.block_q, setup.tiles.block_k):
                    out, parts, *_ = sparse.gathered(q5, k5, v5, pb, setup, sel, workers=1, lse_parts=True)
                else:
                    out, parts, *_ = run_keys(q5, k5, v5, pb, setup, (0, n_k_tiles), workers=1, lse_parts=True)
                xp.finish()
            # A piece's result is block_q rows, back on the host for the merges: small beside its work.
            out, parts = xp.to_host(out), xp.to_host(parts)
        return pb.merge_heads(out, 2), pb.merge_heads(parts, 2)
    except Exception as e:
        raise BlockError(f"attnlib.distributed: the piece {label} failed: {type(e).__name__}: {e}") from e


#: The Dask configuration key a worker reads for the device its pieces run on when the call
#: names none (`_piece_device`): e.g. ``DASK_ATTNLIB__DEVICE=cuda dask worker ...``.
DEVICE_CONFIG = "attnlib.device"


def _piece_device(device):
    """The torch device a piece's kernel runs on, or None for the numpy kernel: the call's
    ``device``, else this worker's `DEVICE_CONFIG` setting; ``"numpy"`` (or nothing set):
    the numpy kernel; ``"auto"``: the worker's CUDA device when it has one (and torch), else
    the numpy kernel; anything else: that torch device (``"cuda"``, ``"cuda:1"``, ``"cpu"``),
    refused by name where the worker has none."""
    if device is None:
        import dask

        device = dask.config.get(DEVICE_CONFIG, None)
    if device is None or device == "numpy":
        return None
    if device == "auto":
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            return None
        import torch

        if not torch.cuda.is_available():
            return None
        device = "cuda"
    from ..core import device as dev_mod

    return dev_mod.resolve(device)


def _check_device_name(device: str):
    """Refuse a name no torch device has before any task runs (a typo would otherwise fail on
    every worker); whether a worker has that device is the worker's to say (`_piece_device`).
    Without torch here, the workers judge the name."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        from ..core.device import parse_name

        parse_name(device, accepted="'numpy', 'auto' or a torch device")


def _meter(label):
    """Book the seconds spent inside under ``label`` in Dask's fine performance metrics
    (`distributed.metrics.context_meter`), apart from the rest of the task's time; a no-op
    outside a Dask task."""
    from distributed.metrics import context_meter

    return context_meter.meter(label)


def _piece_factors(factors, p, g) -> dict:
    """The piece's rows of the laid-out descales (`descale.factors`): its entry, its kv heads
    (and their query heads, ``g`` each, for q's)."""
    heads = {"q_descale": slice(p.h0 * g, p.h1 * g)}
    return {n: np.ascontiguousarray(a[p.entry + (heads.get(n, slice(p.h0, p.h1)),)])
            for n, a in factors.items()}


def _lists_hit(sel, pb, p) -> bool:
    """Whether a row of the piece lists one of its keys ``[k0, k1)``."""
    return bool((_piece_lists(sel, pb, p) >= 0).any())


def _piece_lists(sel, pb, p):
    """The piece's lists in its own key positions, ``(bq, T)`` or ``(H', bq, T)`` as its q is
    laid out: entries outside ``[k0, k1)`` become -1 (no key)."""
    # The piece's rows of the sorted lists, (H', bq, T): the batch entry's, its kv heads' or the shared ones.
    e = int(np.ravel_multi_index(p.entry, pb.batch)) if pb.batch else 0
    keys = sel.keys[e, slice(p.h0, p.h1) if sel.per_head else slice(0, 1), p.q0:p.q1]
    local = np.where((keys >= p.k0) & (keys < p.k1), keys - p.k0, -1)
    return local if sel.per_head else local[0]


def _merge(label, *parts):
    """`online.merge_parts` of partial results in the given (key) order."""
    try:
        with np.errstate(divide="raise", over="raise", invalid="raise"):
            return merge_parts([aligned(p[0]) for p in parts], [aligned(p[1]) for p in parts])
    except Exception as e:
        raise BlockError(f"attnlib.distributed: merging {label} failed: {type(e).__name__}: {e}") from e


def _write(result, target, index, lse_target, lse_index, bshd=False):
    """Write one block's ``(out, lse)`` into the output files (``out`` as ``(..., S, H,
    Dv)`` when ``bshd``); returns its row count."""
    out, parts = result
    _store(target, index, np.swapaxes(out, -2, -3) if bshd else out)
    if lse_target is not None:
        _store(lse_target, lse_index, lse_of(parts))
    return out.shape[-2]


def _store(target, index, block):
    if isinstance(target, str):  # a .npy file made by the caller: mapped read-write here
        arr = np.load(target, mmap_mode="r+")
        try:
            arr[index] = block
            arr.flush()
        finally:
            arr._mmap.close()
    else:  # a zarr array, chunked along the blocks: no two tasks write one chunk
        target[index] = block


class _MergeChain:
    """The merges of `plan.merge_groups`, submitted as the pieces are.

    A group's merge is submitted right after its last piece, so it has an earlier priority
    than the pieces after it: Dask merges partials as they complete instead of holding them.
    """

    def __init__(self, merge, fanin=MERGE_FANIN):
        self.merge, self.fanin = merge, fanin
        self.result, self.pending = None, []

    def add(self, item):
        self.pending.append(item)
        if len(self.pending) == (self.fanin if self.result is None else self.fanin - 1):
            self._merge_pending()

    def _merge_pending(self):
        group = self.pending if self.result is None else [self.result] + self.pending
        self.result, self.pending = (group[0] if len(group) == 1 else self.merge(group)), []

    def root(self):
        """The merge of everything added (its last, partial group merged now)."""
        if self.pending:
            self._merge_pending()
        return self.result


@contextlib.contextmanager
def _client(client):
    """The given client, the current one, or an embedded `LocalCluster` for the call."""
    from distributed import Client, LocalCluster, get_client

    if isinstance(client, str):
        with Client(client) as c:
            yield c
        return
    if client is None:
        with contextlib.suppress(ValueError):  # no current client
            client = get_client()
    if client is not None:
        yield client
        return
    with LocalCluster(n_workers=validate.available_cpus(), threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield c


def _output(path, shape, chunks, name):
    """A zero-filled ``float64`` output of ``shape`` at ``path`` (``.npy`` or zarr, chunked
    as ``chunks``: one output block per chunk, so no two tasks write one chunk), and its
    handle for the tasks (the path, or the zarr array)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (.npy or a zarr store), got {type(path).__name__}")
    path = os.path.abspath(os.fspath(path))  # the workers' working directory may differ
    if path.lower().endswith((".npz", ".safetensors", ".pt")):
        raise ValueError(f"{name}={path!r}: give a .npy path or a zarr store path")
    if path.endswith(".npy"):
        return np.lib.format.open_memmap(path, mode="w+", dtype=np.float64, shape=shape), path
    try:
        import zarr
    except ImportError:
        raise ValueError(f"{name}={path!r}: give a .npy path (zarr is not installed)") from None
    arr = zarr.open_array(path, mode="w", shape=shape, chunks=chunks, dtype="float64", fill_value=0.0)
    return arr, arr


def attention(q, k, v, *, client=None, causal=False, causal_align="bottom_right", window=None,
              q_lengths=None, kv_lengths=None, q_segment_ids=None, kv_segment_ids=None,
              key_leftpad=None, attention_chunk=None, sink_token_length=0, scale=None, softcap=None,
              alibi_slopes=None, sinks=None, block_q=None, kv_block=None,
              heads_per_task=1, return_lse=False, out=None, lse_out=None, layout="bhsd",
              progress=False, gather_kv_indices=None, qv=None, q_descale=None, k_descale=None,
              v_descale=None, device=None):
    """Exact float64 attention on a Dask cluster: `attnlib.attention`'s contract, piece by piece.

    Parameters
    ----------
    q, k, v : array-like, shapes ``(..., Hq, Sq, D)``, ``(..., Hk, Sk, D)``, ``(..., Hk, Sk, Dv)``
        numpy arrays, ``np.memmap``\\ s or ``.npy`` paths, zarr arrays, or dask arrays.  Files
        and zarr stores must be reachable from every worker: each task reads only its own
        slice, and no input is gathered in one place or sent through the scheduler.
    client : distributed.Client, str or None
        The cluster: a client, a scheduler address, or None for the current client (if
        there is one), else a `LocalCluster` started for the call, one process per CPU.
    causal, causal_align, window, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, key_leftpad,
    attention_chunk, sink_token_length, scale, softcap, alibi_slopes, sinks
        As in `attnlib.attention`, on absolute positions.  The sinks start the rows of the
        first piece of each query block (once per row, as in the single-process kernel).
    gather_kv_indices : array of int, ``(..., Sq, topk)`` or ``(..., Hk, Sq, topk)``, optional
        Top-k sparse keys, as in `attnlib.attention` (per kv head ``(..., Sq, Hk, topk)`` with
        ``layout="bshd"``; in memory: each piece is sent its query block's lists, shifted to
        its keys); pieces holding no listed key are no tasks.
    qv : array-like, ``(..., Hq, Sq, Dv)`` (q's layout), optional
        MLA's second query, as in `attnlib.attention` (default scale ``1/sqrt(D + Dv)``): read
        slice by slice like q and joined to each piece's q and k (`attnlib.core.mla`).
    q_descale, k_descale, v_descale : array_like, ``(..., Hk)``, optional
        fp8 descales, as in `attnlib.attention`: each piece dequantises its slices by its
        entry's and heads' factors.
    device : str or torch.device, optional
        Where each piece's kernel runs, on its worker: ``"numpy"`` (the numpy kernel, on the
        worker's thread), ``"auto"`` (the worker's CUDA device when it has one, else numpy),
        or a torch device (``"cuda"``, ``"cuda:1"``, ``"cpu"``: the device kernel of
        `attnlib.attention` on torch tensors, float64 there).  None (the default): each
        worker's own setting `DEVICE_CONFIG` (Dask's configuration, e.g. start a GPU
        worker as ``DASK_ATTNLIB__DEVICE=cuda dask worker ...``), numpy where it has none.
        Pieces merge on the host.  Workers that run the numpy kernel and workers that run a
        device kernel agree to rounding, not bit for bit.
    block_q, kv_block : int, optional
        The query block and key range of a piece (default `DEFAULT_BLOCK`): a task's memory
        is bounded by them, whatever ``Sq`` and ``Sk``.
    heads_per_task : int
        kv heads per task (each with its ``Hq / Hk`` query heads).
    return_lse : bool
        Also return the log-sum-exp ``(..., Hq, Sq)``.
    out, lse_out : path, optional
        Write the output (and the LSE) block by block to a ``.npy`` file or a zarr array at
        this path instead of returning it in memory; the result is then the file opened
        read-only (an ``np.memmap`` or a zarr array).  Neighbouring blocks of a ``.npy``
        file share memory pages, which workers on several hosts writing through a network
        file system may overwrite in each other: there, give a zarr path (one chunk per
        block).  Relative paths are made absolute here.
    layout : {"bhsd", "bshd"}
        How q, k, v and ``out`` are stored: ``(..., H, S, D)``, attnlib's and PyTorch
        SDPA's (default), or ``(..., S, H, D)``, FlashAttention's (read and written in place,
        slice by slice).  The LSE is ``(..., H, S)`` either way, as FlashAttention's.
    progress : bool
        Show Dask's progress bar.

    Returns
    -------
    out : ndarray ``(..., Hq, Sq, Dv)`` (or the opened ``out`` file), and ``lse`` with
    ``return_lse``.

    Notes
    -----
    One task per visible ``(batch entry, kv-head block, query block, key range)`` piece runs
    the tiled kernel on its piece (`MaskSpec.piece`: the same rule in the piece's own
    positions) with one thread; the pieces of a query block then merge by log-sum-exp in a
    left-deep tree of at most `plan.MERGE_FANIN` partials per task, in key order
    (`plan.merge_groups`: a worker's memory stays flat in ``n``).  SKIP pieces are
    never tasks.  Each piece and each merge is deterministic, and the merge order is fixed,
    so the result is the same bits for any number of workers and any run (on workers with
    the same numpy and BLAS).  A task on a worker that dies is rerun by Dask (the result
    does not change) when its inputs can be read again (files, zarr, dask arrays; numpy
    arrays are scattered, and are lost with their worker); any other failure raises
    `BlockError` naming the piece.  Non-finite values are reported for the slices the
    pieces read; values no piece reads are never read: keys past ``kv_lengths``, query rows
    past ``q_lengths`` (a piece ends at the lengths, whatever the block sizes) and pieces
    the mask hides.  With nothing to compute (``Sq``, ``Sk`` or a batch axis of 0, every
    length 0) no cluster is used at all: ``out = 0``, ``lse = -inf`` (the sink with sinks).
    """
    if device is not None and not (isinstance(device, str) or type(device).__name__ == "device"):
        raise TypeError(f"device must be 'numpy', 'auto', a torch device name such as 'cuda', or a "
                        f"torch.device; got {device!r}")
    device = None if device is None else str(device)  # a torch.device travels to workers as its name
    if device not in (None, "numpy", "auto"):
        _check_device_name(device)
    block_q = validate.positive_int(DEFAULT_BLOCK if block_q is None else block_q, "block_q")
    kv_block = validate.positive_int(DEFAULT_BLOCK if kv_block is None else kv_block, "kv_block")
    heads_per_task = validate.positive_int(heads_per_task, "heads_per_task")
    return_lse = validate.flag(return_lse, "return_lse")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    names, unread_k_descale = ("q", "k", "v"), None
    if q is None:  # MLA's qv-only scores, scale qv . v_j (default 1/sqrt(Dv)), as `attnlib.attention`
        if qv is None:
            raise ValueError("q is None: give q, or qv for MLA's qv-only scores")
        # The attention of q' = qv and k' = v (`mla.join` without q): qv takes q's descale and
        # the keys, v, v's; k is not read.
        q, k, qv, k_descale, unread_k_descale, names = qv, v, None, v_descale, k_descale, ("qv", "v", "v")
    inputs = [Input(x, name, layout == "bshd") for x, name in zip((q, k, v), names)]
    # The contract's layout checks, on stand-ins of the right shapes (no data read).
    stand_ins = [np.broadcast_to(np.zeros(()), x.shape) for x in inputs]
    if unread_k_descale is not None:  # checked as `attnlib.attention` checks it, though unused
        descale.factors(*stand_ins[:2], k_descale=unread_k_descale)
    qv_input = None if qv is None else Input(qv, "qv", layout == "bshd")
    factors = descale.factors(*stand_ins[:2], q_descale, k_descale, v_descale, v=stand_ins[2])  # {} without descales
    if any(a.shape[-2:] != (1, 1) for a in factors.values()):  # a piece slices heads and entries only
        raise ValueError("block-scaled descales (one factor per block of positions or dimensions) are not taken by "
                         "attnlib.distributed: dequantise first, or use attnlib.attention")
    if qv_input is not None:  # the joined problem's shapes, [q, qv] against [k, v] (nothing read)
        mla.check(*stand_ins, np.broadcast_to(np.zeros(()), qv_input.shape))
        dv = stand_ins[2].shape[-1]
        stand_ins[:2] = [np.broadcast_to(np.zeros(()), x.shape[:-1] + (x.shape[-1] + dv,)) for x in stand_ins[:2]]
    opts = Options.of(locals(), gather_kv_indices=sparse.in_bhsd(gather_kv_indices, layout, inputs[0].stored_shape))
    _, _, _, pb = problem.parse(*stand_ins, scale=opts.scale, check_finite_inputs=False)
    specs = opts.specs(pb)
    sel = opts.selection(pb)  # the lists, checked against the problem (None without)
    cap, slopes, sink = opts.score_terms(pb)  # slopes and sinks (..., hk, g)
    blocks = make_plan(pb.batch, pb.hk, pb.sq, pb.sk, specs, block_q, kv_block, heads_per_task)
    if sel is not None:  # a piece whose rows list none of its keys is no task
        blocks = [replace(b, pieces=tuple(p for p in b.pieces if _lists_hit(sel, pb, p))) for b in blocks]

    squeeze, g = pb.squeeze, pb.group
    bshd = layout == "bshd" and not squeeze
    out_shape = ((pb.sq, pb.dv) if squeeze else pb.batch + (pb.sq, pb.hq, pb.dv) if bshd
                 else pb.batch + (pb.hq, pb.sq, pb.dv))
    lse_shape = (pb.sq,) if squeeze else pb.batch + (pb.hq, pb.sq)

    def in_index(entry, h0, h1, a, b, per_head=1):  # a q (per_head=g), k or v slice
        rows = (slice(a, b), slice(None))
        return rows if squeeze else entry + (slice(h0 * per_head, h1 * per_head),) + rows

    def out_index(b):
        rows, heads = slice(b.q0, b.q1), slice(b.h0 * g, b.h1 * g)
        if squeeze:
            return rows, slice(None)
        return b.entry + ((rows, heads) if bshd else (heads, rows)) + (slice(None),)

    def lse_index(b):
        return (slice(b.q0, b.q1),) if squeeze else b.entry + (slice(b.h0 * g, b.h1 * g), slice(b.q0, b.q1))

    if out is None and lse_out is not None:
        raise ValueError("lse_out= needs out= (both results go to files, or both come back)")
    if out is not None and return_lse and lse_out is None:
        raise ValueError("return_lse=True with out= needs lse_out=, a path for the LSE")
    if out is not None and lse_out is not None and \
            os.path.abspath(os.fspath(out)) == os.path.abspath(os.fspath(lse_out)):
        raise ValueError(f"out and lse_out must be different paths, both are {os.fspath(out)!r}")
    out_arr = lse_arr = out_target = lse_target = None
    if out is not None:
        heads = heads_per_task * g  # one chunk per output block
        lead = (1,) * len(pb.batch)
        chunks = ((block_q, max(pb.dv, 1)) if squeeze else lead + (block_q, heads, max(pb.dv, 1))
                  if bshd else lead + (heads, block_q, max(pb.dv, 1)))
        out_arr, out_target = _output(out, out_shape, chunks, "out")
        if lse_out is not None:
            lse_arr, lse_target = _output(lse_out, lse_shape, (block_q,) if squeeze else
                                          lead + (heads, block_q), "lse_out")
    else:
        out_arr = np.zeros(out_shape)
        lse_arr = np.empty(lse_shape) if return_lse else None
    def block_heads(values, b):  # (..., hk, g) per-head values -> the block's (hq',), flat
        per_entry = values if values.ndim == 2 else values[b.entry]
        return np.ascontiguousarray(per_entry[b.h0:b.h1]).reshape(-1)

    # Rows of blocks with no piece see no key: out = 0 (already), lse = -inf (the sink with sinks).
    for b in blocks:
        if not b.pieces and lse_arr is not None:
            if sink is None:
                lse_arr[lse_index(b)] = -np.inf
            else:  # (heads, rows), or the one head's rows of 2-D inputs
                heads = block_heads(sink, b)
                lse_arr[lse_index(b)] = heads[0] if squeeze else heads[:, None]
    if out is not None and hasattr(out_arr, "flush"):
        out_arr.flush()
        if lse_arr is not None and hasattr(lse_arr, "flush"):
            lse_arr.flush()

    if not any(b.pieces for b in blocks):  # nothing to compute: no cluster work, no cluster
        return _result(out, lse_out, out_arr, lse_arr, return_lse)
    token = uuid.uuid4().hex[:8]
    with _client(client) as c:
        # The stand-ins of every slice a piece reads: q by block, k and v by key range.
        q_keys = sorted({(p.entry, p.h0, p.h1, p.q0, p.q1) for b in blocks for p in b.pieces})
        kv_keys = sorted({(p.entry, p.h0, p.h1, p.k0, p.k1) for b in blocks for p in b.pieces})

        def parts(x, keys, per_head=1):  # {key: stand-in} of the slices of x
            return dict(zip(keys, x.parts(c, [in_index(*key, per_head) for key in keys])))

        q_parts, v_parts = parts(inputs[0], q_keys, g), parts(inputs[2], kv_keys)
        k_parts = v_parts if k is v else parts(inputs[1], kv_keys)
        qv_parts = {} if qv_input is None else parts(qv_input, q_keys, g)
        flow = _Flow(c, blocks, out_arr if out_target is None else None,
                     lse_arr if out_target is None else None, out_index, lse_index, bshd)
        try:
            for n, b in enumerate(blocks):
                if not b.pieces:
                    continue
                label = b.pieces[0].label.split(", keys")[0]
                count = itertools.count()

                def merge(group, label=label, n=n, count=count):
                    future = c.submit(_merge, label, *group, pure=False,
                                      key=f"attnlib-merge-{token}-{n}-{next(count)}")
                    flow.track(future, pieces=sum(_is_piece(f) for f in group), n=n)
                    return future

                chain = _MergeChain(merge)
                for p in b.pieces:
                    flow.wait_for_room()
                    block_slopes = None if slopes is None else block_heads(slopes, p)
                    # The first piece (lowest keys) starts from the sinks: once per row.
                    piece_sink = None if sink is None or p is not b.pieces[0] else block_heads(sink, p)
                    spec = (specs[()] if () in specs else specs[p.entry]).piece(p.q0, p.q1, p.k0, p.k1)
                    flow.pieces += 1
                    chain.add(c.submit(
                        _piece, q_parts[(p.entry, p.h0, p.h1, p.q0, p.q1)],
                        k_parts[(p.entry, p.h0, p.h1, p.k0, p.k1)], v_parts[(p.entry, p.h0, p.h1, p.k0, p.k1)],
                        spec, pb.scale, cap, block_slopes, p.label, piece_sink,
                        None if sel is None else _piece_lists(sel, pb, p),
                        qv_parts.get((p.entry, p.h0, p.h1, p.q0, p.q1)), _piece_factors(factors, p, g),
                        device, key=f"attnlib-piece-{token}-{n}-{p.k0}", pure=False))
                final = chain.root()
                if out_target is not None:
                    final = c.submit(_write, final, out_target, out_index(b), lse_target,
                                     lse_index(b) if lse_target is not None else None, bshd,
                                     key=f"attnlib-write-{token}-{n}", pure=False)
                flow.final(final, n, pieces=int(len(b.pieces) == 1))
            if progress:
                from distributed import progress as show

                show(flow.pending_finals())
            flow.drain()
        except BaseException:
            flow.cancel()
            raise
    return _result(out, lse_out, out_arr, lse_arr, return_lse)


def _result(out, lse_out, out_arr, lse_arr, return_lse):
    """What `attention` returns: the arrays, or the output files opened read-only."""
    if out is not None:  # with return_lse, lse_out is a path too
        out_arr, lse_arr = _reopen(out), _reopen(lse_out) if return_lse else None
    return (out_arr, lse_arr) if return_lse else out_arr


def _is_piece(future) -> bool:
    return str(future.key).startswith("attnlib-piece")


def unmerged_limit(threads: int) -> int:
    """The most pieces a call keeps out unmerged (the client's throttle): a merge's worth
    (`MERGE_FANIN`) plus two per worker thread, one running and one ready."""
    return MERGE_FANIN + 2 * max(1, int(threads))


class _Flow:
    """Submitted merges and block results, settled as they complete, with a bound on the
    pieces whose results no merge has consumed yet.

    Dask runs the ready task with the earliest priority, but a merge waits for partials
    from other workers while the workers go on with later pieces, so without a bound the
    partial results waiting in the workers grew with ``n`` (measured: a worker's peak 6.5
    MiB at n = 4096, 16.6 MiB at 32768).  `wait_for_room` holds the next piece back until
    fewer than `limit` unmerged pieces are out: a merge's worth (`MERGE_FANIN`) plus two per
    worker thread, one running and one ready, so that every thread stays busy.  Results are copied into the arrays (in memory) as their
    blocks complete; the first failure cancels everything and is raised.  A result lost with
    its worker is recomputed by Dask, and ``result()`` waits for it.
    """

    def __init__(self, client, blocks, out_arr, lse_arr, out_index, lse_index, bshd):
        from distributed import as_completed

        self.client, self.blocks = client, blocks
        self.out_arr, self.lse_arr, self.out_index, self.lse_index, self.bshd = (
            out_arr, lse_arr, out_index, lse_index, bshd)
        self.done = as_completed()
        self.frees = {}  # key of a merge or block result -> pieces its completion frees
        self.finals = {}  # key of a block result -> block number
        self.block_of = {}  # key of anything tracked -> its block number
        self.futures = {}  # key -> every future tracked and not settled, to cancel on failure
        self.pieces = self.freed = 0  # pieces submitted; pieces whose consumer completed
        threads = sum(client.nthreads().values())  # every worker (scheduler_info may list a few)
        self.limit = unmerged_limit(threads)

    def track(self, future, pieces, n):
        self.frees[future.key] = self.frees.get(future.key, 0) + pieces
        self.block_of[future.key] = n
        self.futures[future.key] = future
        self.done.add(future)

    def final(self, future, n, pieces):
        self.finals[future.key] = n
        if future.key in self.frees:  # the block's last merge: already tracked
            self.frees[future.key] += pieces
        else:
            self.track(future, pieces, n)

    def wait_for_room(self):
        """Settle completed merges until fewer than `limit` pieces are unmerged."""
        while self.pieces - self.freed >= self.limit:
            self._settle(next(self.done))

    def pending_finals(self):
        return [f for key, f in self.futures.items() if key in self.finals]

    def drain(self):
        for future in self.done:
            self._settle(future)

    def _settle(self, future):
        n = self.finals.get(future.key)
        b = self.blocks[n] if n is not None else None
        try:
            # A finished merge inside a block's chain stays on its worker for the next merge:
            # fetched here it would cross to the client for nothing (a block's rows per merge).
            # A block's result is fetched, and a failure raised (a BlockError naming the task).
            value = None if b is None and future.status == "finished" else future.result()
        except BlockError:
            raise
        except Exception as e:  # cancelled elsewhere, or the cluster gave up on it
            where = self.blocks[self.block_of[future.key]].pieces[0].label.split(", keys")[0]
            raise BlockError(
                f"attnlib.distributed: the block {where} got no result: {type(e).__name__}: {e} "
                "(inputs given as numpy arrays are scattered, and Dask cannot recompute them when "
                "a worker holding them is lost: give .npy files, zarr or dask arrays)") from e
        self.block_of.pop(future.key, None)
        self.freed += self.frees.pop(future.key, 0)
        if b is not None and self.out_arr is not None:
            _write(value, self.out_arr, self.out_index(b), self.lse_arr, self.lse_index(b), self.bshd)
        # Settled: not held here any more.  Only a block's result is released outright; a
        # merge's result stays alive through the chain (`_MergeChain.result`) until the
        # next merge is submitted, which then keeps it in Dask until it runs.
        del self.futures[future.key]
        if b is not None:
            future.release()

    def cancel(self):
        self.client.cancel(list(self.futures.values()))


def _reopen(path):
    path = os.path.abspath(os.fspath(path))
    if path.endswith(".npy"):
        return np.load(path, mmap_mode="r")
    import zarr

    return zarr.open_array(path, mode="r")
