"""The exact float64 oracle on a Dask cluster, for contexts one machine cannot finish.

``attnlib.distributed.attention`` computes what `attnlib.attention` computes, cut into
independent (query block, key range) pieces, one Dask task each, merged exactly by
log-sum-exp.  Needs the ``distributed`` extra: ``pip install 'attnlib[distributed]'``
(``dask[distributed]`` and ``zarr``)::

    from distributed import Client
    import attnlib.distributed as ad

    out, lse = ad.attention("q.npy", "k.npy", "v.npy", causal=True, return_lse=True,
                            client=Client("tcp://scheduler:8786"))
"""

from .engine import DEFAULT_BLOCK, BlockError, attention
from .plan import MERGE_FANIN, Block, Piece, count_tasks, make_plan, merge_groups

__all__ = ["attention", "BlockError", "DEFAULT_BLOCK", "MERGE_FANIN", "Block", "Piece",
           "count_tasks", "make_plan", "merge_groups"]
