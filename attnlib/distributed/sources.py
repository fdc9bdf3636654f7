"""Where a piece's inputs come from: slices read by the worker that needs them.

A cluster's inputs are usually larger than any one machine's memory, so they are never
gathered or shipped whole: each task reads its own ``(entry, heads, positions)`` slice.

- A ``.npy`` path, or an `np.memmap` of a whole file: the header is read here (no pickle:
  object arrays are refused) and checked against the file's size before anything is
  allocated; each task maps the file read-only and copies out its slice.  The path must
  be one every worker can reach (a shared file system).
- A zarr array: each task reads its slice through zarr (the array travels to the worker
  as a reference to its store: a store on disk or object storage, not an in-memory one,
  which would travel whole with every task).
- A dask array: each slice is a task of the array's own graph, computed on the cluster.
- A numpy array in this process (or a writable memmap, whose edits the file may not
  hold): each slice is sent to one worker once (``Client.scatter``).  Dask cannot
  recompute scattered data: if the worker holding a slice dies the call fails with a
  `BlockError`; give files, zarr or dask arrays where workers may be lost.

Values no piece reads (keys past a length, pieces a mask hides) are never read, so a NaN
there goes unnoticed, unlike in `attnlib.attention`, which checks whole arrays.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np

from ..core import arrays
from ..core.tensorio import TensorFileError, read_npy_header

@dataclass(frozen=True)
class NpyFile:
    """A C- or Fortran-ordered array stored from byte ``offset`` of ``path``."""

    path: str
    offset: int
    shape: tuple
    dtype: np.dtype
    fortran: bool = False

    @classmethod
    def open(cls, path, name: str) -> "NpyFile":
        """Read and check the header of the ``.npy`` file at ``path`` (argument ``name``)."""
        path = os.path.abspath(os.fspath(path))  # the workers' working directory may differ
        try:
            f = open(path, "rb")
        except OSError as e:
            raise ValueError(f"{name}: cannot open {path!r}: {e}") from None
        with f:
            try:  # the check's hardened header reader: sizes checked, nothing unpickled
                dtype, shape, fortran, offset = read_npy_header(f, os.fstat(f.fileno()).st_size,
                                                                f"{name}: {path!r}")
            except TensorFileError as e:
                raise ValueError(str(e)) from None
        return cls.checked(path, offset, shape, dtype, fortran, name)

    @classmethod
    def of_memmap(cls, x: np.memmap, name: str) -> "NpyFile":
        """The file behind a memmap of a whole file (not of a view into one)."""
        return cls.checked(os.path.abspath(os.fspath(x.filename)), int(x.offset), x.shape, x.dtype,
                           x.flags.f_contiguous and not x.flags.c_contiguous, name)

    @classmethod
    def checked(cls, path, offset, shape, dtype, fortran, name) -> "NpyFile":
        dtype = np.dtype(dtype)
        if dtype.kind != "f":  # objects (pickles), records, raw bytes, integers: refused
            raise TypeError(f"{name}: {path!r} holds dtype {dtype}, not real floating numbers")
        need = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        size = os.path.getsize(path)
        if size < need:
            raise ValueError(f"{name}: {path!r} has {size} bytes, its header promises {need}")
        return cls(path, int(offset), tuple(int(n) for n in shape), dtype, bool(fortran))

    def read(self, index: tuple) -> np.ndarray:
        """A copy of ``array[index]``, the file mapped read-only meanwhile."""
        if not self.shape or 0 in self.shape:
            return np.zeros(self.shape, self.dtype)[index]
        arr = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape,
                        order="F" if self.fortran else "C")
        try:
            return np.array(arr[index])
        finally:
            arr._mmap.close()


@dataclass(frozen=True)
class Zarr:
    """A zarr array, read slice by slice on the workers."""

    array: object

    def read(self, index: tuple) -> np.ndarray:
        return np.asarray(self.array[index])


@dataclass(frozen=True)
class Slice:
    """A slice to read: what a task gets in place of a block it reads itself.  ``swap``:
    the source is stored ``(..., S, H, D)`` (FlashAttention's bshd), ``index`` is in that
    order, and the block comes back as ``(..., H, S, D)``."""

    source: object  # NpyFile or Zarr
    index: tuple
    swap: bool = False

    def read(self) -> np.ndarray:
        block = self.source.read(self.index)
        return np.swapaxes(block, -2, -3) if self.swap else block


def _is_of(x, package: str, *attrs) -> bool:
    """Whether ``x`` is an object of ``package`` (zarr, dask) with every one of ``attrs``."""
    return type(x).__module__.split(".")[0] == package and all(hasattr(x, a) for a in attrs)


class Input:
    """One of q, k, v as given: its shape and dtype, and how a task gets a slice of it."""

    def __init__(self, x, name: str, bshd: bool = False):
        self.name = name
        self.kind, self.source = self._classify(x, name)
        meta = self.source.array if isinstance(self.source, Zarr) else self.source
        self.stored_shape = tuple(int(n) for n in meta.shape)
        # bshd: stored (..., S, H, D); seen here, as by the kernel, as (..., H, S, D).
        self.bshd = bshd and len(self.stored_shape) >= 3
        self.shape = _stored(self.stored_shape) if self.bshd else self.stored_shape
        self.dtype = np.dtype(meta.dtype)
        if not (np.issubdtype(self.dtype, np.floating) or arrays._is_ml_float(self.dtype)):
            raise TypeError(f"{name} must hold real floating numbers, got dtype {self.dtype}")

    @staticmethod
    def _classify(x, name):
        if isinstance(x, (str, os.PathLike)):
            return "file", NpyFile.open(x, name)
        # Read-only memmaps of a whole file are read from the file by the tasks; a writable
        # or copy-on-write one may hold edits the file does not, so its data is sent.
        if isinstance(x, np.memmap) and isinstance(x.base, mmap.mmap) and x.filename and x.mode == "r":
            return "file", NpyFile.of_memmap(x, name)
        if _is_of(x, "zarr", "shape", "dtype"):
            return "zarr", Zarr(x)
        if _is_of(x, "dask", "__dask_graph__"):
            if any(isinstance(n, float) and n != n for n in x.shape):
                raise ValueError(f"{name}: a dask array with unknown chunk sizes {x.shape}; call "
                                 "its compute_chunk_sizes() first")
            return "dask", x
        if isinstance(x, np.ndarray):
            return "memory", x
        raise TypeError(f"{name} must be a numpy array, a .npy path, an np.memmap, a zarr array or a "
                        f"dask array, got {type(x).__name__}")

    def parts(self, client, indices: list) -> list:
        """One stand-in per index in ``indices`` (``(..., heads, rows, :)``, the kernel's
        order): a `Slice` the task reads, or a future.  No index, no cluster call."""
        if not indices:  # Client.scatter([]) and compute([]) fail inside Dask
            return []
        if self.kind in ("file", "zarr"):
            return [Slice(self.source, _stored(index) if self.bshd else index, self.bshd)
                    for index in indices]
        if self.kind == "dask":
            x = self.source.swapaxes(-2, -3) if self.bshd else self.source
            return client.compute([x[index] for index in indices])
        x = np.swapaxes(self.source, -2, -3) if self.bshd else self.source  # a view
        # In memory here: each block goes to a worker once.  Keys of their own
        # (hash=False): content-hashed keys would be shared with an earlier call's blocks,
        # whose release may still be on its way to the scheduler and would drop these.
        return client.scatter([np.ascontiguousarray(x[index]) for index in indices], hash=False)


def _stored(index: tuple) -> tuple:
    """An index ``(..., heads, rows, cols)`` in the stored bshd order ``(..., rows, heads, cols)``
    (and back: a shape stored bshd in the kernel's order)."""
    return index[:-3] + (index[-2], index[-3], index[-1])


def materialize(part) -> np.ndarray:
    """The block a task works on, from its stand-in, aligned.

    A block that reached this worker from another (scattered, or a dask array's chunk) may
    lie at any byte offset in the message's buffer; numpy does not hand a misaligned array
    to BLAS but multiplies it with its own loop, in another order, so the same piece would
    give other bits on another run.  Such a block is copied (aligned) first.
    """
    return aligned(part.read() if isinstance(part, Slice) else np.asarray(part))


def aligned(x) -> np.ndarray:
    """``x`` as an array, copied where its data is not aligned for its dtype."""
    return np.require(x, requirements="A")
