"""``python -m attnlib reference``: the golden output of a long-context case, to a file.

A kernel's own test suite then compares against the file, without computing the float64
reference at test time::

    python -m attnlib reference --q q.npy --k k.npy --v v.npy --causal \\
        --out-file ref.npy --lse-file ref_lse.npy [--scheduler tcp://host:8786]

``.npy`` inputs are read slice by slice by the tasks (from a path every worker can reach);
``.npz`` and ``.safetensors`` tensors are loaded here first.  Without ``--scheduler`` the
reference runs on a `LocalCluster` started for the call (one process per CPU); with it, on
that cluster.  Exit code 0: written; 2: unusable input or a failed run (the message says
which block).
"""

from __future__ import annotations

import os
import sys

from ..core.validate import add_mask_flags, cli_options
from ..core.tensorio import TensorFileError, load_indices, load_tensor, split_spec


def _parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m attnlib reference",
        description="Compute attnlib's exact float64 attention of saved q, k, v on a Dask cluster "
                    "and write it (and its LSE) to .npy files, block by block.")
    for name in ("q", "k", "v"):
        p.add_argument(f"--{name}", required=True, metavar="FILE",
                       help=f"{name}: .npy (read slice by slice), or .npz/.safetensors (path or path:name)")
    p.add_argument("--out-file", required=True, metavar="FILE", help="where the output goes (.npy or a zarr path)")
    p.add_argument("--lse-file", default=None, metavar="FILE", help="where the LSE goes, (..., H, S)")
    p.add_argument("--layout", choices=("bshd", "bhsd"), default="bshd",
                   help="bshd: (batch, seqlen, nheads, headdim), FlashAttention's (default); "
                        "bhsd: (batch, nheads, seqlen, headdim); the output is written in the same layout")
    add_mask_flags(p)
    p.add_argument("--gather-kv-indices", default="", metavar="FILE",
                   help="top-k sparse keys: integer lists (batch, seqlen_q, topk), or per kv head in the "
                        "layout's order; -1 or out-of-range entries select no key")
    p.add_argument("--block-q", type=int, default=None, help="query rows per task")
    p.add_argument("--kv-block", type=int, default=None, help="keys per task")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="a Dask scheduler (tcp://host:8786); default: a LocalCluster for this run")
    p.add_argument("--piece-device", default=None, metavar="DEVICE",
                   help="where each piece computes on its worker: numpy, auto (a worker's GPU where it "
                        "has one), or a torch device such as cuda (default: each worker's "
                        "DASK_ATTNLIB__DEVICE setting, else numpy)")
    p.add_argument("--progress", action="store_true", help="show Dask's progress bar")
    return p


def _input(spec: str, label: str):
    path, key = split_spec(spec)
    if path.endswith(".npy") and key is None:
        return path  # read by the tasks, slice by slice
    return load_tensor(spec, label)[0]


def main(argv=None) -> int:
    from .engine import BlockError, attention

    args = _parser().parse_args(argv)
    options = dict(cli_options(args), block_q=args.block_q, kv_block=args.kv_block, layout=args.layout,
                   progress=args.progress, device=args.piece_device)
    try:
        q, k, v = (_input(getattr(args, n), f"--{n}") for n in ("q", "k", "v"))
        lists = load_indices(args.gather_kv_indices, "--gather-kv-indices") if args.gather_kv_indices else None
        out = attention(q, k, v, client=args.scheduler, out=args.out_file, lse_out=args.lse_file,
                        return_lse=args.lse_file is not None, gather_kv_indices=lists, **options)
    except (TensorFileError, ValueError, TypeError, BlockError, OSError) as e:
        print(f"attnlib reference: {type(e).__name__ + ': ' if isinstance(e, OSError) else ''}{e}",
              file=sys.stderr)
        return 2
    shape = (out[0] if isinstance(out, tuple) else out).shape
    print(f"wrote {os.path.abspath(args.out_file)} {tuple(shape)} float64"
          + (f" and {os.path.abspath(args.lse_file)}" if args.lse_file else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
