"""Reading the tensors a kernel under test saved: ``.npy``, ``.npz`` and ``.safetensors``.

A tensor file must never run code: ``.npy``/``.npz`` are read with ``allow_pickle=False``,
and ``.safetensors`` (a JSON header and raw little-endian bytes) is parsed here directly,
so it needs no package and supports bfloat16.  A file holding several tensors is addressed
as ``path:name``; one holding a single tensor needs no name.

bfloat16 arrives in three disguises, all read exactly (a bfloat16 is the top half of a
float32): safetensors ``BF16``; ``ml_dtypes.bfloat16`` saved with ``np.save`` (numpy
writes it as raw 2-byte ``|V2``); and its bits saved as ``uint16``/``int16`` (e.g.
``t.view(torch.int16).numpy()``), which needs ``--dtype bfloat16`` to be told apart from
integers.
"""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np

#: The stored types a kernel's tensors may have, as `Precision` names.
FLOAT_KINDS = ("float64", "float32", "float16", "bfloat16")

_SAFETENSORS = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


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
    dtype : {None, "float64", "float32", "float16", "bfloat16"}
        The kernel's precision, if known: lets raw 2-byte data and ``uint16`` bits be read
        as bfloat16 or float16.

    Returns
    -------
    array : ndarray, float16, float32 or float64 (bfloat16 is returned as the float32 of
        equal value)
    kind : str, one of `FLOAT_KINDS`: the type the tensor was stored in
    """
    path, key = split_spec(spec)
    where = f"{label} {spec}"
    if not os.path.exists(path):
        raise TensorFileError(f"{where}: no such file")
    if os.path.isdir(path):
        raise TensorFileError(f"{where}: is a directory, not a tensor file")
    suffix = os.path.splitext(path)[1].lower()
    try:
        if suffix == ".npy":
            if key is not None:
                raise TensorFileError(f"{where}: a .npy file holds one array; drop ':{key}'")
            raw, stored = np.load(path, allow_pickle=False), None
        elif suffix == ".npz":
            raw, stored = _from_npz(path, key, where), None
        elif suffix == ".safetensors":
            raw, stored = _from_safetensors(path, key, where)
        else:
            raise TensorFileError(f"{where}: unknown file type {suffix!r} (expected .npy, .npz or .safetensors)")
    except TensorFileError:
        raise
    except ValueError as e:
        if "allow_pickle" in str(e) or "Object arrays" in str(e):
            raise TensorFileError(f"{where}: holds pickled Python objects, refused (a tensor file "
                                  "must not run code; save plain numeric arrays)") from None
        raise TensorFileError(f"{where}: not a readable tensor file ({e})") from None
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise TensorFileError(f"{where}: not a readable tensor file ({e})") from None
    return _as_float(raw, stored, where, dtype)


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


def _from_npz(path, key, where):
    with np.load(path, allow_pickle=False) as archive:
        return archive[_pick(archive.files, key, where)]


def _from_safetensors(path, key, where):
    """Parse the format: 8-byte little-endian header size, a JSON header, raw bytes."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise TensorFileError(f"{where}: too short to be a safetensors file")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise TensorFileError(f"{where}: header size {n} exceeds the file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TensorFileError(f"{where}: bad safetensors header ({e})") from None
        header.pop("__metadata__", None)
        name = _pick(header, key, where)
        entry = header[name]
        kind = entry.get("dtype")
        if kind not in _SAFETENSORS:
            raise TensorFileError(f"{where}: tensor {name!r} has dtype {kind}; a kernel's tensors "
                                  f"must be floating point ({', '.join(_SAFETENSORS)})")
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        dt = np.dtype(_SAFETENSORS[kind])
        if end - start != dt.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise TensorFileError(f"{where}: tensor {name!r} has {end - start} bytes for shape {shape}")
        f.seek(8 + n + start)
        data = np.frombuffer(f.read(end - start), dtype=dt).reshape(shape)
    return data, ("bfloat16" if kind == "BF16" else None)


def _as_float(raw: np.ndarray, stored, where, dtype):
    if stored == "bfloat16":
        return _bf16_bits_to_float32(raw), "bfloat16"
    if raw.dtype.kind == "V" and raw.dtype.itemsize == 2:  # ml_dtypes 16-bit types via np.save
        if dtype not in ("bfloat16", "float16"):
            raise TensorFileError(f"{where}: holds raw 2-byte values ({raw.dtype}, how numpy saves "
                                  "ml_dtypes.bfloat16); pass --dtype bfloat16 (or float16)")
        raw = raw.view(np.uint16)
    if raw.dtype in (np.uint16, np.int16) and dtype in ("bfloat16", "float16"):
        bits = raw.view(np.uint16)
        if dtype == "float16":
            return bits.view(np.float16), "float16"
        return _bf16_bits_to_float32(bits), "bfloat16"
    if raw.dtype.name in ("float64", "float32", "float16"):
        return raw, raw.dtype.name
    if raw.dtype.name == "bfloat16":  # an ml_dtypes array from an .npz written in-process
        return raw.astype(np.float32), "bfloat16"
    hint = (" (if these are bfloat16 bits, pass --dtype bfloat16)"
            if raw.dtype in (np.uint16, np.int16) else "")
    raise TensorFileError(f"{where}: dtype {raw.dtype} is not a floating-point type "
                          f"(float16, bfloat16, float32, float64){hint}")


def _bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns -> the float32 of exactly the same value."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def save_safetensors(path: str, tensors: dict) -> None:
    """Write float16/32/64 arrays (and ``("bfloat16", uint16 bits)`` pairs) as safetensors;
    for tests and examples."""
    header, chunks, offset = {}, [], 0
    codes = {v: k for k, v in _SAFETENSORS.items() if k != "BF16"}
    for name, x in tensors.items():
        if isinstance(x, tuple):  # ("bfloat16", bits)
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
