"""``python -m attnlib check``: tensor files in, a verdict and an exit code out."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from ..core.validate import add_mask_flags, cli_options
from ..core.problem import INTERMEDIATES
from ..core.tensorio import TensorFileError, load_indices, load_mask, load_tensor, split_spec
from .shapes import LAYOUTS, TENSORS, UnusableInput
from .text import format_tensor, format_text
from .verdict import KernelCheck, check_kernel

#: The notebook `check --html` runs: package data, so that it works from a plain install.
NOTEBOOK = Path(__file__).with_name("kernel_check.ipynb")
#: Integer files: varlen offsets and lengths, a paged cache's table and lengths.
INDEX_FILES = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "cache_seqlens", "gather_kv_indices",
               "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "bsr_indptr", "bsr_indices")
#: The block-sparse lists (`attnlib.core.block_sparse`): FlexAttention's and FlashAttention 4's, FlashInfer's BSR.
BLOCK_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "bsr_indptr", "bsr_indices")
#: Tensor files besides the kernel's tensors: the options that come as arrays.
OPTION_FILES = ("sinks", "dsinks", "q_descale", "k_descale", "v_descale", "max_scores", "sum_exp", "dlse",
                "k_mean") + INDEX_FILES + ("dropout_mask",)
#: Files besides the kernel's tensors, read like them (in the kernel's type): MLA's second query
#: and the kernel's gradient of it.
INPUT_FILES = ("qv", "dqv")
#: What `NOTEBOOK` declares, and `_run_notebook` passes.
NOTEBOOK_PARAMETERS = TENSORS + INPUT_FILES + OPTION_FILES + ("v_from_k", "dtype", "layout", "causal", "causal_align", "window",
                                                "softcap", "scale", "kv_lengths", "q_lengths", "key_leftpad",
                                                "attention_chunk", "sink_token_length", "lse_base",
                                                "lse_sink", "lse_empty", "workers", "intermediate_dtype",
                                                "dropout_p", "block_size", "results_json")


def load_and_check(q, k, v, out, *, lse="", dout="", dq="", dk="", dv="", sinks="", dsinks="", dtype="",
                   cu_seqlens_q="", cu_seqlens_k="", seqused_k="", block_table="", cache_seqlens="",
                   gather_kv_indices="", q_descale="", k_descale="", v_descale="", qv="", dqv="", max_scores="",
                   sum_exp="", dlse="", k_mean="", dropout_mask="", kv_num_blocks="", kv_indices="",
                   full_kv_num_blocks="", full_kv_indices="", bsr_indptr="", bsr_indices="", block_size=None,
                   v_from_k=0, **options) -> KernelCheck:
    """`check_kernel` on tensor files (``path`` or ``path:name``; "" = not given), the
    ``sinks``, the fp8 descales, MLA's ``qv``, the integer files of `INDEX_FILES` and a dropout
    keep mask (booleans, or integers: nonzero kept) too.
    ``v_from_k=Dv``: ``v`` is the first ``Dv`` of ``k``'s head dim (FlashMLA's shared latent),
    a view of it: no ``v`` file."""
    if bool(v) == bool(v_from_k):
        raise UnusableInput("give v (--v FILE) or v_from_k (--v-from-k DV: v is k's first DV "
                            "dimensions, FlashMLA's shared latent), one of them")
    specs = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, dq=dq, dk=dk, dv=dv, sinks=sinks, dsinks=dsinks,
                 q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, qv=qv, dqv=dqv,
                 max_scores=max_scores, sum_exp=sum_exp, dlse=dlse, k_mean=k_mean)
    indices = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                   block_table=block_table, cache_seqlens=cache_seqlens, gather_kv_indices=gather_kv_indices,
                   kv_num_blocks=kv_num_blocks, kv_indices=kv_indices, full_kv_num_blocks=full_kv_num_blocks,
                   full_kv_indices=full_kv_indices, bsr_indptr=bsr_indptr, bsr_indices=bsr_indices)
    arrays, kinds, names = {}, {}, {}
    for name, spec in indices.items():
        if spec:
            arrays[name] = load_indices(spec, f"--{name.replace('_', '-')}")
    if bool(dropout_mask) != (options.get("dropout_p") is not None):
        raise UnusableInput("dropout is judged with the kernel's keep mask: give --dropout-p and --dropout-mask "
                            "together")
    if dropout_mask:
        arrays["dropout_mask"] = load_mask(dropout_mask, "--dropout-mask")
    for name, spec in specs.items():
        if spec:
            # The sinks, descales, max_scores and dlse are parameters or statistics: read as stored.
            flag = f"--{name.replace('_', '-')}"
            arrays[name], kinds[name] = load_tensor(spec, flag, None if name in OPTION_FILES else dtype or None)
            names[name] = f"{flag} {spec}"
    if v_from_k:
        d = arrays["k"].shape[-1] if arrays["k"].ndim else 0
        if not isinstance(v_from_k, int) or not 0 < v_from_k <= d:
            raise UnusableInput(f"--v-from-k {v_from_k}: must be between 1 and k's head dim {d}")
        arrays["v"] = arrays["k"][..., :v_from_k]  # a view: the latent's first Dv dimensions
        names["v"] = f"--v-from-k {v_from_k} (k's first {v_from_k} dimensions)"
    lists = {n: arrays.pop(n) for n in BLOCK_LISTS if n in arrays}
    if lists:
        options["block_mask"] = _block_mask(lists, block_size, arrays, options.get("layout", "bshd"))
    elif block_size is not None:
        raise UnusableInput("--block-size is the block-sparse lists' block size: give the lists too")
    lse_dtype = _stored_dtype(kinds["lse"]) if "lse" in kinds else None
    return check_kernel(**arrays, dtype=dtype or kinds["q"], names=names, lse_dtype=lse_dtype, **options)


def _block_mask(lists, block_size, arrays, layout):
    """The `BlockMask` of the block-sparse list files: FlexAttention's (and FlashAttention 4's)
    ``kv_num_blocks``/``kv_indices`` (partial blocks: every pair the other mask flags leave visible)
    and ``full_kv_*``, or FlashInfer's BSR ``indptr``/``indices``; ``block_size``: ``(block_q,
    block_k)`` (BSR's ``R``, ``C``), the sequences' lengths from q and k."""
    from ..core.block_sparse import block_mask_from_bsr, block_mask_from_kv_blocks

    if layout == "thd":
        raise UnusableInput("block-sparse lists are taken with --layout bshd or bhsd, not thd")
    if block_size is None:
        raise UnusableInput("block-sparse lists need --block-size (BLOCK_Q BLOCK_K)")
    axis = -3 if layout == "bshd" else -2
    sq, sk = (arrays[n].shape[axis] if arrays[n].ndim >= 3 else arrays[n].shape[-2] for n in ("q", "k"))
    q_shape = arrays["q"].shape
    lead = (q_shape[0] if len(q_shape) == 4 else 1, q_shape[axis + 1 if axis == -3 else -3] if len(q_shape) >= 3 else 1)
    for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        shape = lists[n].shape if n in lists else None
        if shape is not None and (len(shape) < 3 or any(x not in (1, want) for x, want in zip(shape[:2], lead))):
            raise UnusableInput(f"--{n.replace('_', '-')}: its (batch, nheads) must be 1 or q's {lead}, got shape {shape}")
    bsr = {"bsr_indptr", "bsr_indices"} & set(lists)
    flex = set(lists) - bsr
    try:
        if bsr and flex or (bsr and len(bsr) != 2) or (flex and not {"kv_num_blocks", "kv_indices"} <= flex):
            raise ValueError("give --kv-num-blocks and --kv-indices (with --full-kv-num-blocks and "
                             "--full-kv-indices), or --bsr-indptr and --bsr-indices, one kind of lists")
        if bsr:
            return block_mask_from_bsr(lists["bsr_indptr"], lists["bsr_indices"], *block_size, sq, sk)
        return block_mask_from_kv_blocks(lists["kv_num_blocks"], lists["kv_indices"], lists.get("full_kv_num_blocks"),
                                         lists.get("full_kv_indices"), block_size=tuple(block_size),
                                         seq_lengths=(sq, sk))
    except (ValueError, TypeError) as e:
        raise UnusableInput(str(e)) from None


def _stored_dtype(kind: str):
    """The numpy dtype of a stored kind ("bfloat16" needs ml_dtypes; float32 holds it exactly
    otherwise, and its rounding is then not allowed for)."""
    if kind == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            return "float32"
        return ml_dtypes.bfloat16
    return kind


def save_json(path: str, check: KernelCheck) -> None:
    """The verdict for the CLI: text, exit code and the headline figures."""
    data = {"text": format_text(check), "exit_code": check.exit_code, "passed": check.passed,
            "out_max_err": check.out.max_err, "out_ratio": check.out.ratio}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def _parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m attnlib check",
        description="Judge an attention kernel's saved output against attnlib's float64 reference. "
                    "Below float64: |kernel - ref| <= (2 r + 2) ulps of each entry's size |ref| + "
                    "sqrt(sum p^2 v^2) + w S sqrt(sum p^2 (v - ref)^2) (the scores' rounding), r the naive error (plain attention in the kernel's type) in "
                    "those ulps, the largest over the head; no 0.3-anchored atol. float64 "
                    "kernels are judged by a float64 rounding bound per row. "
                    "Exit code 0: pass, 1: fail, 2: unusable input.")
    for name in TENSORS:
        required = name in ("q", "k", "out")
        p.add_argument(f"--{name}", required=required, default="", metavar="FILE",
                       help=f"{name} tensor: .npy, .npz or .safetensors (path or path:name)"
                            + ("" if required else " (or --v-from-k)" if name == "v" else ", optional"))
    p.add_argument("--v-from-k", type=_head_dim, default=None, metavar="DV",
                   help="no --v: v is the first DV dimensions of k's head dim (FlashMLA's shared latent, "
                        "576-dim keys whose first 512 are the values), read once")
    p.add_argument("--qv", default="", metavar="FILE",
                   help="MLA's second query (FlashAttention 3/4's qv), q's layout with v's head dim: scores "
                        "scale (q k^T + qv v^T), default scale 1/sqrt(D + Dv)")
    p.add_argument("--dqv", default="", metavar="FILE", help="the kernel's gradient of --qv (with --dout)")
    p.add_argument("--max-scores", default="", metavar="FILE",
                   help="FlexAttention's aux max_scores, (batch, nheads, seqlen_q): each row's largest "
                        "visible score (base 2 with --lse-base 2), judged with the score's allowance")
    p.add_argument("--sum-exp", default="", metavar="FILE",
                   help="with --max-scores: sum_j exp(s_ij - max_i) over the keys, (batch, nheads, seqlen_q), "
                        "the row statistics in place of --lse (cuDNN's score_sum_exp): judged as the keys' LSE")
    p.add_argument("--layout", choices=LAYOUTS + ("thd",), default="bshd",
                   help="bshd: (batch, seqlen, nheads, headdim), FlashAttention's (default); "
                        "bhsd: (batch, nheads, seqlen, headdim), PyTorch SDPA's; "
                        "thd: (total, nheads, headdim), FlashAttention's varlen (with --cu-seqlens-q/k)")
    add_mask_flags(p, qv=True)
    p.add_argument("--cu-seqlens-q", default="", metavar="FILE",
                   help="varlen: the batch + 1 offsets of the packed query sequences (integers; --layout thd)")
    p.add_argument("--cu-seqlens-k", default="", metavar="FILE", help="varlen: the key sequences' offsets")
    p.add_argument("--seqused-k", default="", metavar="FILE",
                   help="varlen: keys each sequence uses (integers, batch)")
    p.add_argument("--block-table", default="", metavar="FILE",
                   help="paged KV cache: (batch, max_blocks) page indices; --k/--v are then the pages "
                        "(num_blocks, page_size, nheads, headdim)")
    p.add_argument("--cache-seqlens", default="", metavar="FILE", help="paged KV cache: keys per batch entry")
    p.add_argument("--gather-kv-indices", default="", metavar="FILE",
                   help="top-k sparse keys: integer lists (batch, seqlen_q, topk) shared by the heads, or "
                        "per kv head in the layout's order; -1 or out-of-range entries select no key")
    for name, words in (("kv-num-blocks", "block-sparse lists (FlexAttention's from_kv_blocks, FlashAttention 4's "
                                           "mask_block_cnt): each query block's count of partial key blocks, "
                                           "(batch, nheads, n_q_blocks); the mask flags apply to every listed pair, "
                                           "full blocks too (as create_block_mask lists them)"),
                        ("kv-indices", "their key blocks, (batch, nheads, n_q_blocks, max_blocks)"),
                        ("full-kv-num-blocks", "the same for the full blocks (every pair visible)"),
                        ("full-kv-indices", "their key blocks"),
                        ("bsr-indptr", "FlashInfer's block-sparse rows: the offsets, (n_q_blocks + 1,)"),
                        ("bsr-indices", "FlashInfer's block-sparse rows: each block row's key blocks")):
        p.add_argument(f"--{name}", default="", metavar="FILE", help=words)
    p.add_argument("--block-size", type=int, nargs=2, default=None, metavar=("BLOCK_Q", "BLOCK_K"),
                   help="the block-sparse lists' block size (BSR's R and C)")
    p.add_argument("--nsa", type=int, nargs=5, default=None, metavar=("L", "S", "L_SEL", "TOP_N", "WINDOW"),
                   help="native sparse attention: --out is the gated sum of its three branches (compressed "
                        "blocks of L keys every S, mean-pooled; the TOP_N selected blocks of L_SEL keys, the first "
                        "and the two last always; a causal window of WINDOW keys), with --gates")
    p.add_argument("--gates", default="", metavar="FILE", help="NSA's gates, (batch, nheads, seqlen_q, 3)")
    p.add_argument("--selected", default="", metavar="FILE",
                   help="NSA: the kernel's own selected blocks, (batch, nheads_k, seqlen_q, TOP_N), -1 none: the "
                        "branches judged on them, and the selection judged")
    p.add_argument("--sinks", default="", metavar="FILE",
                   help="attention-sink logits, (nheads,) or (batch, nheads): one more logit in every "
                        "row's softmax denominator, with no value (gpt-oss, FlashAttention learnable_sink)")
    p.add_argument("--lse-base", choices=("e", "2"), default="e",
                   help="the base of the kernel's --lse: e (natural, default) or 2 (FlashInfer, JAX Pallas)")
    p.add_argument("--lse-sink", choices=("included", "excluded"), default="included",
                   help="with --sinks: the kernel's --lse includes the sink (default, FlashAttention 4) "
                        "or excludes it (FlashMLA)")
    p.add_argument("--lse-empty", choices=("-inf", "+inf"), default=None,
                   help="what the kernel's --lse holds on rows without a visible key (write "
                        "--lse-empty=-inf); default: either")
    p.add_argument("--dsinks", default="", metavar="FILE", help="the kernel's gradient of the sinks (with --dout)")
    p.add_argument("--dlse", default="", metavar="FILE",
                   help="the loss's gradient with respect to the lse, (batch, nheads, seqlen_q) (with --dout; "
                        "FlashAttention 4's dlse; base 2 with --lse-base 2): the gradients judged answer both")
    p.add_argument("--q-descale", default="", metavar="FILE",
                   help="fp8: the (batch, nheads_k) factors that dequantise --q (FlashAttention 3's "
                        "q_descale); likewise --k-descale, --v-descale")
    p.add_argument("--k-descale", default="", metavar="FILE", help="fp8: k's descales, (batch, nheads_k)")
    p.add_argument("--v-descale", default="", metavar="FILE", help="fp8: v's descales, (batch, nheads_k)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32", "float64", "float8_e4m3fn"), default=None,
                   help="the kernel's compute precision (default: the type q is stored in; float8_e4m3fn: "
                        "FlashAttention 3's fp8 forward, bfloat16 with p rounded to fp8)")
    p.add_argument("--intermediate-dtype", choices=INTERMEDIATES, default=None,
                   help="the type the kernel rounds the weights p to before p @ v (FlashAttention's "
                        "intermediate_dtype), within --dtype")
    p.add_argument("--k-mean", default="", metavar="FILE",
                   help="SageAttention's K smoothing: the mean key subtracted before k was quantised, "
                        "(batch, 1, nheads_k, headdim) in bshd")
    p.add_argument("--dropout-p", type=float, default=None, metavar="P",
                   help="dropout with the kernel's keep mask (--dropout-mask): out = (P * keep) v / (1 - P)")
    p.add_argument("--dropout-mask", default="", metavar="FILE",
                   help="the kernel's keep mask, (batch, nheads, seqlen_q, seqlen_k), booleans or integers "
                        "(nonzero: kept)")
    p.add_argument("--workers", type=int, default=None,
                   help="threads for the float64 reference (default: every available CPU)")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="compute the float64 reference with torch on this device (cuda, cuda:1, cpu); "
                        "default: numpy on this machine's cores")
    p.add_argument("--html", default=None, metavar="PATH", help="also write the verdict as an HTML report")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--scheduler", default=None, metavar="ADDRESS",
                       help="compute the float64 reference on this Dask cluster (tcp://host:8786)")
    where.add_argument("--distributed", action="store_true",
                       help="compute the float64 reference on a Dask LocalCluster started for the run")
    return p


def _head_dim(text: str) -> int:
    """``--v-from-k DV``: an integer ``>= 1`` (argparse reports anything else as a usage error,
    exit status 2); 0 is no head dim, not "no --v-from-k"."""
    import argparse

    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if x < 1:
        raise argparse.ArgumentTypeError(f"{x}: v is the first DV >= 1 dimensions of k's head dim "
                                         "(FlashMLA's shared latent: 512); without --v-from-k, give --v")
    return x


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    options = dict(cli_options(args), layout=args.layout, lse_base=args.lse_base, lse_sink=args.lse_sink,
                   lse_empty=args.lse_empty, workers=args.workers, device=args.device,
                   intermediate_dtype=args.intermediate_dtype, dropout_p=args.dropout_p, block_size=args.block_size)
    files = {name: getattr(args, name) for name in TENSORS + INPUT_FILES + OPTION_FILES}
    on_cluster = args.scheduler is not None or args.distributed
    if args.nsa is not None or args.gates or args.selected:
        try:
            text, code = _nsa(args, files, options)
        except (TensorFileError, UnusableInput) as e:
            print(f"attnlib check: unusable input: {e}", file=sys.stderr)
            return 2
        print(text)
        return code
    try:
        if args.html and on_cluster:
            raise UnusableInput("--html runs the check in a notebook on this machine: it does not take "
                                "--scheduler or --distributed (leave --html out)")
        if args.device is not None and (on_cluster or args.html):
            raise UnusableInput("--device computes the reference here with torch: it does not take "
                                "--scheduler, --distributed or --html")
        if args.html:
            text, code = _run_notebook(files, args.dtype or "", {**options, "v_from_k": args.v_from_k or 0}, args.html)
        else:
            with _cluster(args) as scheduler:
                check = load_and_check(**files, dtype=args.dtype or "", v_from_k=args.v_from_k or 0,
                                       scheduler=scheduler, **options)
            text, code = format_text(check), check.exit_code
    except (TensorFileError, UnusableInput) as e:
        print(f"attnlib check: unusable input: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the scheduler cannot be reached (TimeoutError is an OSError)
        if not on_cluster:
            raise
        print(f"attnlib check: the Dask cluster failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(text)
    if args.html:
        print(f"report: {args.html}")
    return code


def _nsa(args, files, options) -> tuple[str, int]:
    """``--nsa``: `check_nsa` of the files, ``(text, exit code)``."""
    from ..core.nsa import NSA
    from .nsa import check_nsa

    if args.nsa is None or not args.gates:
        raise UnusableInput("native sparse attention needs --nsa L S L_SEL TOP_N WINDOW and --gates FILE")
    given = sorted(n for n, x in files.items() if x and n not in ("q", "k", "v", "out"))
    extra = sorted(n for n, x in options.items() if n not in ("layout", "workers", "scale", "causal_align",
                                                              "lse_base", "lse_sink") and x not in (None, False, 0))
    if given or extra or args.html or args.scheduler or args.distributed or args.device:
        raise UnusableInput(f"--nsa judges q, k, v, out with --gates (and --selected, --scale, --dtype, --layout); "
                            f"it does not take {', '.join(given + extra) or '--html, a cluster or --device'}")
    try:
        nsa = NSA(block_size=args.nsa[0], stride=args.nsa[1], select_block_size=args.nsa[2], top_n=args.nsa[3],
                  window=args.nsa[4])
    except (ValueError, TypeError) as e:
        raise UnusableInput(f"--nsa: {e}") from None
    loaded = [load_tensor(files[n], f"--{n}", args.dtype or None) for n in ("q", "k", "v", "out")]
    (q, kind), (k, _), (v, _), (out, _) = loaded
    dtype = args.dtype or kind  # (bfloat16 files are read as the float32 of equal value)
    gates = load_tensor(args.gates, "--gates")[0]
    selected = load_indices(args.selected, "--selected") if args.selected else None
    try:
        r = check_nsa(q, k, v, out, gates, nsa, selected=selected, layout=options["layout"], dtype=dtype,
                      scale=options["scale"], workers=options["workers"])
    except (ValueError, TypeError, MemoryError) as e:  # shapes that do not fit, sizes past memory
        raise UnusableInput(f"--nsa: {type(e).__name__}: {e}") from None
    lines = ["attnlib check: native sparse attention's gated output against attnlib's float64 branches", ""]
    lines += format_tensor(r.out) + [f"  note: {n}" for n in r.notes] + [""]
    lines.append(f"verdict: {'PASS' if r.passed else 'FAIL'} (exit {0 if r.passed else 1})")
    return "\n".join(lines), 0 if r.passed else 1


@contextlib.contextmanager
def _cluster(args):
    """Where the reference runs: None (here), the ``--scheduler`` address, or a client of a
    LocalCluster started for the run (``--distributed``: `attnlib.distributed`'s own)."""
    if not args.distributed:
        yield args.scheduler
        return
    from ..distributed.engine import _client

    with _client(None) as client:
        yield client


def _run_notebook(files, dtype, options, target) -> tuple[str, int]:
    """Run the kernel-check notebook on the files and render it to ``target``."""
    from ..report.runner import ReportError, execute

    notebook = NOTEBOOK
    if not notebook.exists():
        raise UnusableInput(f"--html needs {notebook}, which this installation of attnlib lacks")
    path = Path(target)  # checked before the check runs, not after
    if path.is_dir():
        raise UnusableInput(f"--html {target} is a folder: give the path of a file to write")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise UnusableInput(f"--html {target}: the folder {path.parent} does not exist or cannot be written")
    # Fail fast, with the CLI's messages, on unusable files before starting a kernel.
    for name, spec in files.items():
        if spec:
            if name in INDEX_FILES:
                load_indices(spec, f"--{name.replace('_', '-')}")
            elif name == "dropout_mask":
                load_mask(spec, "--dropout-mask")
            else:
                load_tensor(spec, f"--{name.replace('_', '-')}", None if name in OPTION_FILES else dtype or None)

    def absolute(spec):  # the notebook runs elsewhere: absolute paths, ":name" kept
        path, key = split_spec(spec)
        return os.path.abspath(path) + (f":{key}" if key else "")

    options = {n: x for n, x in options.items() if n != "device"}  # refused with --html (main)
    params = {**{n: absolute(s) if s else "" for n, s in files.items()}, "dtype": dtype, **options,
              "window": None if options["window"] is None else list(options["window"]),
              "softcap": options["softcap"] or 0.0, "scale": options["scale"] or 0.0,
              "attention_chunk": options["attention_chunk"] or 0}
    assert set(params) | {"results_json"} == set(NOTEBOOK_PARAMETERS)
    try:
        data = execute(notebook, params, path)
    except ReportError as e:
        raise UnusableInput(f"the kernel check notebook failed: {e}") from None
    except OSError as e:  # the report could not be written there after all (/proc, a full disk)
        raise UnusableInput(f"--html {target} could not be written: {e.strerror or e}") from None
    return data["text"], int(data["exit_code"])
