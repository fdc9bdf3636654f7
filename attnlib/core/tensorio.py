"""Reading the tensors a kernel under test saved: ``.npy``, ``.npz`` and ``.safetensors``.

A tensor file must never run code, nor make the reader allocate what the file does not
hold.  Nothing in a header is trusted: ``.npy`` headers (also inside ``.npz``) and
``.safetensors`` headers are parsed here, without numpy's loader, and checked before a
byte of data is read -- the dtype must be plain numeric (never an object/pickle or
structured dtype), the shape a tuple of non-negative ints, and its size times the item
size must equal exactly the bytes the file (or the ``.npz`` member, per the zip
directory) holds.  Only then is the data read, in bounded chunks, into an array of
exactly that size: reading a file allocates at most about twice its size (bfloat16 is
widened to float32 on the fly) plus a fixed 1 MiB, whatever its header claims.  A
deflated ``.npz`` member may hold more than its compressed size, but never more than
deflate's maximal ratio (1032:1) allows, and decompression stops at the declared size.
Every malformed file raises `TensorFileError` (a `ValueError`), whose one-line message
names the argument, the file and the problem; the CLI turns it into exit code 2.

A file holding several tensors is addressed as ``path:name``; one holding a single
tensor needs no name.

bfloat16 arrives in three disguises, all read exactly (a bfloat16 is the top half of a
float32): safetensors ``BF16``; ``ml_dtypes.bfloat16`` saved with ``np.save`` (numpy
writes it as raw 2-byte ``|V2``); and its bits saved as ``uint16``/``int16`` (e.g.
``t.view(torch.int16).numpy()``), which needs ``--dtype bfloat16`` to be told apart from
integers.
"""

from __future__ import annotations

import ast
import json
import math
import os
import zipfile
import zlib

import numpy as np

#: The stored types a kernel's tensors may have, as `Precision` names.
FLOAT_KINDS = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn")

_SAFETENSORS = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "F8_E4M3": "|u1"}
#: Integer safetensors dtypes, read by `load_indices` (offsets, page tables, lengths).
_SAFETENSORS_INT = {"I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8", "U8": "<u1", "U16": "<u2",
                    "U32": "<u4", "U64": "<u8"}
#: The ``dtype`` argument that asks the readers for integers instead of floats; `_MASK`: for
#: booleans or integers (a keep mask, `load_mask`).
_INDICES, _MASK = "indices", "mask"
#: Item sizes of the other safetensors dtypes: entries we do not read are still checked.
_SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
                         "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
                         "I64": 8, "U64": 8, "F64": 8, "C64": 8}

#: Limits on headers: numpy's own default for .npy, safetensors' own for its JSON header.
NPY_MAX_HEADER = 10_000
SAFETENSORS_MAX_HEADER = 100_000_000
MAX_NDIM = 32
#: deflate never expands more than 1032:1; a member declaring more lies.
_DEFLATE_MAX_RATIO = 1032
#: Data is read through a buffer of at most this many bytes.
_CHUNK = 1 << 18

_NPY_MAGIC = b"\x93NUMPY"


class TensorFileError(ValueError):
    """An unusable tensor file; the message names the file and what is wrong with it."""


def load_tensor(spec: str, label: str, dtype: str | None = None) -> tuple[np.ndarray, str]:
    """Read one tensor: ``(array, kind)``.

    Parameters
    ----------
    spec : str
        ``path`` or ``path:name`` (``.npy``, ``.npz`` or ``.safetensors``).
    label : str
        How messages name it, e.g. ``"--q"``.
    dtype : {None, "float64", "float32", "float16", "bfloat16", "float8_e4m3fn"}
        The kernel's precision, if known: lets raw 2-byte data and ``uint16`` bits be read
        as bfloat16 or float16, raw 1-byte data and ``uint8`` as float8_e4m3fn.

    Returns
    -------
    array : ndarray, float16, float32 or float64 (bfloat16 is returned as the float32 of
        equal value, float8_e4m3fn as an ``ml_dtypes.float8_e4m3fn`` array: one byte each)
    kind : str, one of `FLOAT_KINDS`: the type the tensor was stored in

    Raises
    ------
    TensorFileError
        For every unusable file, whatever is wrong with it; never another exception.
    """
    path, key = split_spec(spec)
    where = f"{label} {spec}"
    try:
        return _load(path, key, where, dtype)
    except TensorFileError as e:
        raise TensorFileError(_one_line(str(e))) from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise TensorFileError(_one_line(f"{where}: not a readable tensor file ({e})")) from None
    except (MemoryError, RecursionError) as e:  # not expected: every size is checked first
        raise TensorFileError(_one_line(f"{where}: not a readable tensor file "
                                        f"({type(e).__name__})")) from None
    except Exception as e:  # a library's surprise on a hostile file: still one clean message
        raise TensorFileError(_one_line(f"{where}: not a readable tensor file "
                                        f"({type(e).__name__}: {e})")) from None


def load_indices(spec: str, label: str) -> np.ndarray:
    """Read one integer tensor (offsets, a page table, lengths) as int64, with the same
    checks as `load_tensor`: ``.npy``, ``.npz`` or ``.safetensors`` (``I8`` .. ``U64``)."""
    arr = load_tensor(spec, label, _INDICES)[0]
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise TensorFileError(f"{label} {spec}: values beyond int64")
    return arr.astype(np.int64)


def load_mask(spec: str, label: str) -> np.ndarray:
    """Read one boolean tensor (a keep mask: True or nonzero kept), with `load_tensor`'s checks:
    ``.npy``, ``.npz`` or ``.safetensors`` (``BOOL``, ``I8`` .. ``U64``)."""
    return load_tensor(spec, label, _MASK)[0] != 0


def _one_line(message: str, limit: int = 600) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit - 3] + "..."


def _load(path, key, where, dtype):
    if not os.path.exists(path):
        raise TensorFileError(f"{where}: no such file")
    if os.path.isdir(path):
        raise TensorFileError(f"{where}: is a directory, not a tensor file")
    if not os.path.isfile(path):
        raise TensorFileError(f"{where}: not a regular file")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        if key is not None:
            raise TensorFileError(f"{where}: a .npy file holds one array; drop ':{key}'")
        with open(path, "rb") as f:
            return _read_npy(f, os.fstat(f.fileno()).st_size, where, "not an .npy file", dtype)
    if suffix == ".npz":
        return _from_npz(path, key, where, dtype)
    if suffix == ".safetensors":
        return _from_safetensors(path, key, where, dtype)
    raise TensorFileError(f"{where}: unknown file type {suffix!r} (expected .npy, .npz or .safetensors)")


def split_spec(spec: str) -> tuple[str, str | None]:
    """``path:name`` -> (path, name); a colon that is part of an existing path is kept."""
    if os.path.exists(spec) or ":" not in spec:
        return spec, None
    path, key = spec.rsplit(":", 1)
    return path, key or None


def _pick(names, key, where):
    if key is not None:
        if key not in names:
            raise TensorFileError(f"{where}: no tensor named {key!r} (it holds {sorted(names)})")
        return key
    if len(names) != 1:
        raise TensorFileError(f"{where}: holds {len(names)} tensors {sorted(names)}; "
                              "name one as path:name")
    return next(iter(names))


def _is_count(x) -> bool:
    """A non-negative int (bools, floats and strings are not)."""
    return type(x) is int and x >= 0


def _check_shape(shape, where):
    if len(shape) > MAX_NDIM:
        raise TensorFileError(f"{where}: shape has {len(shape)} dimensions (at most {MAX_NDIM})")
    # even with a zero dimension numpy cannot index beyond int64
    if math.prod(max(d, 1) for d in shape) >= 2 ** 62:
        raise TensorFileError(f"{where}: shape {tuple(shape)} is impossibly large")
    return math.prod(shape)


# -- .npy ------------------------------------------------------------------------------------

def _read_npy(f, available, where, not_npy, dtype):
    """Read one .npy from the stream ``f`` that holds exactly ``available`` bytes."""
    src, shape, fortran, _ = read_npy_header(f, available, where, not_npy)
    mode, kind = _plan(src, None, where, dtype)
    flat = _read_flat(f, src, _check_shape(shape, where), mode, where)
    return (flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)), kind


def read_npy_header(f, available, where, not_npy="not an .npy file"):
    """Check the header of the .npy file on the stream ``f`` (``available`` bytes in all,
    from its start): ``(dtype, shape, fortran_order, data_offset)``, the stream left at the
    data.  Every field is checked before anything is allocated: the magic, the version, the
    header's size and syntax (a literal, never unpickled), a plain numeric dtype, and a
    shape whose bytes are exactly the rest of the file."""
    magic = f.read(6)
    if magic != _NPY_MAGIC:
        what = "empty" if not magic else f"starts with {magic!r}, not numpy's \\x93NUMPY magic"
        raise TensorFileError(f"{where}: {not_npy} ({what})")
    version = f.read(2)
    if len(version) != 2 or version[0] not in (1, 2, 3) or version[1] != 0:
        raise TensorFileError(f"{where}: unknown .npy format version {tuple(version)}")
    width = 2 if version[0] == 1 else 4
    raw_len = f.read(width)
    if len(raw_len) != width:
        raise TensorFileError(f"{where}: truncated .npy header")
    hlen = int.from_bytes(raw_len, "little")
    preamble = 8 + width
    if hlen > NPY_MAX_HEADER:
        raise TensorFileError(f"{where}: .npy header of {hlen} bytes (at most {NPY_MAX_HEADER})")
    if preamble + hlen > available:
        raise TensorFileError(f"{where}: .npy header of {hlen} bytes exceeds the "
                              f"{available}-byte file")
    text = f.read(hlen)
    if len(text) != hlen:
        raise TensorFileError(f"{where}: truncated .npy header")
    try:
        header = ast.literal_eval(text.decode("utf-8" if version[0] == 3 else "latin1"))
    except Exception as e:  # SyntaxError, ValueError, MemoryError, RecursionError, ...
        raise TensorFileError(f"{where}: unreadable .npy header ({type(e).__name__})") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise TensorFileError(f"{where}: .npy header is not a dict of descr, fortran_order and "
                              "shape")
    descr, fortran, shape = header["descr"], header["fortran_order"], header["shape"]
    if type(fortran) is not bool:
        raise TensorFileError(f"{where}: .npy header's fortran_order is {fortran!r:.40}, not a bool")
    if not isinstance(shape, tuple) or not all(_is_count(d) for d in shape):
        raise TensorFileError(f"{where}: .npy header's shape {shape!r:.80} is not a tuple of "
                              "non-negative ints")
    if not isinstance(descr, str):
        if isinstance(descr, list) and "O" in repr(descr):
            raise _pickled(where)
        raise TensorFileError(f"{where}: structured dtype {descr!r:.80} refused (save plain "
                              "numeric arrays)")
    try:
        src = np.dtype(descr)
    except Exception:
        raise TensorFileError(f"{where}: unknown dtype {descr!r:.80}") from None
    if src.hasobject:
        raise _pickled(where)
    if src.fields is not None or src.subdtype is not None or src.kind not in "biufcV" \
            or src.itemsize == 0:
        raise TensorFileError(f"{where}: dtype {descr!r:.80} is not a plain numeric type")
    count = _check_shape(shape, where)
    data = available - preamble - hlen
    if count * src.itemsize != data:
        raise TensorFileError(f"{where}: header declares shape {shape} of {src} "
                              f"({count * src.itemsize} bytes) but the file holds {data} bytes "
                              "of data")
    return src, shape, fortran, preamble + hlen


def _pickled(where):
    return TensorFileError(f"{where}: holds pickled Python objects, refused (a tensor file "
                           "must not run code; save plain numeric arrays)")


# -- .npz ------------------------------------------------------------------------------------

def _from_npz(path, key, where, dtype):
    try:
        return _read_npz(path, key, where, dtype)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as e:
        kind = "corrupt deflate stream" if isinstance(e, zlib.error) else "corrupt .npz (zip) archive"
        raise TensorFileError(f"{where}: {kind} ({type(e).__name__}: {e})") from None


def _read_npz(path, key, where, dtype):
    size = os.path.getsize(path)
    with zipfile.ZipFile(path) as archive:
        infos = {i.filename[:-4]: i for i in archive.infolist() if i.filename.endswith(".npy")}
        others = [i.filename for i in archive.infolist() if not i.filename.endswith(".npy")]
        if key is not None and key not in infos and key in others:
            raise TensorFileError(f"{where}: member {key!r} is not an .npy array")
        if not infos:
            raise TensorFileError(f"{where}: holds no .npy arrays (members: {others[:8]})")
        info = infos[_pick(infos, key, where)]
        what = f"member {info.filename!r}"
        if info.flag_bits & 0x1:
            raise TensorFileError(f"{where}: {what} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise TensorFileError(f"{where}: {what} uses compression method {info.compress_type} "
                                  "(an .npz is stored or deflated)")
        if info.header_offset + 30 + info.compress_size > size:
            raise TensorFileError(f"{where}: {what} declares {info.compress_size} bytes beyond "
                                  "the end of the file")
        if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
            raise TensorFileError(f"{where}: stored {what} declares {info.file_size} bytes but "
                                  f"occupies {info.compress_size}")
        if info.file_size > _DEFLATE_MAX_RATIO * info.compress_size + 1024:
            raise TensorFileError(f"{where}: {what} declares {info.file_size} bytes from "
                                  f"{info.compress_size} compressed, beyond what deflate can do")
        with archive.open(info) as member:
            array, kind = _read_npy(member, info.file_size, f"{where}: {what}",
                                    "not an .npy array", dtype)
            if member.read(1):  # also makes zipfile check the CRC
                raise TensorFileError(f"{where}: {what} holds more than its declared "
                                      f"{info.file_size} bytes")
    return array, kind


# -- .safetensors ----------------------------------------------------------------------------

def _from_safetensors(path, key, where, dtype):
    """Parse the format: 8-byte little-endian header size, a JSON header, raw bytes."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise TensorFileError(f"{where}: too short to be a safetensors file")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise TensorFileError(f"{where}: header size {n} exceeds the {size}-byte file")
        if n > SAFETENSORS_MAX_HEADER:
            raise TensorFileError(f"{where}: header size {n} is over safetensors' limit "
                                  f"({SAFETENSORS_MAX_HEADER})")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (ValueError, RecursionError) as e:  # JSON or UTF-8 errors, too deep nesting
            raise TensorFileError(f"{where}: bad safetensors header ({type(e).__name__}: "
                                  f"{str(e)[:120]})") from None
        if not isinstance(header, dict):
            raise TensorFileError(f"{where}: safetensors header is a JSON "
                                  f"{type(header).__name__}, not an object")
        header.pop("__metadata__", None)
        data_size = size - 8 - n
        entries = {name: _safetensors_entry(name, entry, data_size, where) for name, entry in header.items()}
        name = _pick(entries, key, where)
        kind, shape, start, end = entries[name]
        known = {_INDICES: _SAFETENSORS_INT, _MASK: {"BOOL": "|b1", **_SAFETENSORS_INT}}.get(dtype, _SAFETENSORS)
        if kind not in known:
            what_kind = {_INDICES: "integers", _MASK: "booleans or integers"}.get(dtype, "floating point")
            raise TensorFileError(f"{where}: tensor {name!r} has dtype {kind}; it must be {what_kind} "
                                  f"({', '.join(known)})")
        src = np.dtype(known[kind])
        mode, stored = _plan(src, {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn"}.get(kind), where, dtype)
        f.seek(8 + n + start)
        flat = _read_flat(f, src, (end - start) // src.itemsize, mode, where)
    return flat.reshape(shape), stored


def _safetensors_entry(name, entry, data_size, where):
    what = f"{where}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise TensorFileError(f"{what}: entry is a JSON {type(entry).__name__}, not an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise TensorFileError(f"{what}: entry lacks {', '.join(missing)}")
    kind, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(kind, str) or kind not in _SAFETENSORS_ITEMSIZE:
        raise TensorFileError(f"{what}: unknown dtype {kind!r:.40}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise TensorFileError(f"{what}: shape {shape!r:.80} is not a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise TensorFileError(f"{what}: data_offsets {offsets!r:.80} are not two non-negative ints")
    start, end = offsets
    if not start <= end <= data_size:
        raise TensorFileError(f"{what}: data_offsets [{start}, {end}] are outside the "
                              f"{data_size}-byte data section")
    count = _check_shape(shape, what)
    if end - start != count * _SAFETENSORS_ITEMSIZE[kind]:
        raise TensorFileError(f"{what}: {end - start} bytes for shape {tuple(shape)} of {kind}")
    return kind, tuple(shape), start, end


# -- reading the data ------------------------------------------------------------------------

def _plan(src: np.dtype, stored, where, dtype):
    """How to read data of type ``src``: ``(mode, kind)``, decided before reading it."""
    if dtype in (_INDICES, _MASK):
        if src.kind in ("iu" if dtype == _INDICES else "biu"):
            return "raw", src.name
        raise TensorFileError(f"{where}: dtype {src} is not an integer type" + (" or bool" if dtype == _MASK else ""))
    if stored == "bfloat16":
        return "bf16", "bfloat16"
    if stored == "float8_e4m3fn" or (src.itemsize == 1 and src.kind in "Vu" and dtype == "float8_e4m3fn"):
        return "f8", "float8_e4m3fn"  # fp8 bytes, kept as ml_dtypes.float8_e4m3fn (1 byte each)
    if src.kind == "V" and src.itemsize == 1:  # ml_dtypes 8-bit types via np.save
        raise TensorFileError(f"{where}: holds raw 1-byte values ({src}, how numpy saves "
                              "ml_dtypes.float8_e4m3fn); pass --dtype float8_e4m3fn")
    bits = False
    if src.kind == "V" and src.itemsize == 2:  # ml_dtypes 16-bit types via np.save
        if dtype not in ("bfloat16", "float16"):
            raise TensorFileError(f"{where}: holds raw 2-byte values ({src}, how numpy saves "
                                  "ml_dtypes.bfloat16); pass --dtype bfloat16 (or float16)")
        bits = True
    if (bits or (src.kind in "ui" and src.itemsize == 2)) and dtype in ("bfloat16", "float16"):
        return ("bf16", "bfloat16") if dtype == "bfloat16" else ("f16", "float16")
    if src.kind == "f" and src.name in ("float64", "float32", "float16"):
        return "raw", src.name
    hint = (" (if these are bfloat16 bits, pass --dtype bfloat16)"
            if src.kind in "ui" and src.itemsize == 2 else "")
    raise TensorFileError(f"{where}: dtype {src} is not a floating-point type "
                          f"(float16, bfloat16, float32, float64){hint}")


def _bits_dtype(src: np.dtype) -> np.dtype:
    """The uint16 type of 2-byte data as stored (raw ``V2`` is little-endian)."""
    return np.dtype("<u2") if src.kind == "V" else np.dtype(np.uint16).newbyteorder(src.byteorder)


def _fill(f, buf: memoryview, where):
    pos, total = 0, len(buf)
    while pos < total:
        got = f.readinto(buf[pos:pos + _CHUNK])
        if not got:
            raise TensorFileError(f"{where}: data ends after {pos} of {total} bytes")
        pos += got


def _read_flat(f, src: np.dtype, count: int, mode: str, where) -> np.ndarray:
    """Read ``count`` items of ``src`` into a new 1-D array of exactly that size."""
    if mode == "bf16":  # widen chunk by chunk: peak = the float32 result + one chunk
        bits = _bits_dtype(src)
        out = np.empty(count, np.uint32)
        step = _CHUNK // 2
        tmp = np.empty(min(count, step), bits)
        for i in range(0, count, step):
            m = min(step, count - i)
            _fill(f, memoryview(tmp.view(np.uint8))[:2 * m], where)
            part = out[i:i + m]
            part[...] = tmp[:m]
            part <<= 16
        return out.view(np.float32)
    arr = np.empty(count, src)
    _fill(f, memoryview(arr.view(np.uint8)), where)
    if mode == "f8":
        try:
            import ml_dtypes
        except ImportError:
            raise TensorFileError(f"{where}: float8_e4m3fn data needs the ml_dtypes package "
                                  "(pip install attnlib[lowp])") from None
        return arr.view(np.uint8).view(ml_dtypes.float8_e4m3fn)
    if mode == "f16":  # float16 bits
        bits = _bits_dtype(src)
        arr = arr.view(bits).view(np.dtype(np.float16).newbyteorder(bits.byteorder))
    if not arr.dtype.isnative:  # big-endian floats: swap in place, no copy
        arr = arr.byteswap(inplace=True).view(arr.dtype.newbyteorder("="))
    return arr


def save_safetensors(path: str, tensors: dict) -> None:
    """Write float16/32/64 arrays (and ``("bfloat16", uint16 bits)`` or ``("float8_e4m3fn",
    uint8 bits)`` pairs) as safetensors; for tests and examples."""
    header, chunks, offset = {}, [], 0
    codes = {v: k for k, v in _SAFETENSORS.items() if k not in ("BF16", "F8_E4M3")}
    for name, x in tensors.items():
        if isinstance(x, tuple) and x[0] == "float8_e4m3fn":  # ("float8_e4m3fn", bytes)
            kind, x = "F8_E4M3", np.ascontiguousarray(x[1], dtype=np.uint8)
        elif isinstance(x, tuple):  # ("bfloat16", bits)
            kind, x = "BF16", np.ascontiguousarray(x[1], dtype="<u2")
        else:
            x = np.ascontiguousarray(x)
            kind = codes[x.dtype.newbyteorder("<").str]
        data = x.tobytes()
        header[name] = {"dtype": kind, "shape": list(x.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for data in chunks:
            f.write(data)
