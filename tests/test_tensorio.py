"""attnlib.core.tensorio never trusts a header (issue 13): every hostile or malformed tensor file
raises TensorFileError -- exit 2 with one line from the CLI -- before anything the header
claims is allocated; reading any file allocates at most about twice its size."""

import io
import json
import os
import struct
import subprocess
import sys
import tracemalloc
import zipfile

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from attnlib import check
from attnlib.core.tensorio import TensorFileError, load_tensor, save_safetensors

MiB = 1 << 20


# -- building files, honest and hostile ------------------------------------------------------

def npy_bytes(x=None, *, header=None, data=b"", version=1):
    """An .npy: np.save's, or a hand-written header dict (as text) and data."""
    if header is None:
        buf = io.BytesIO()
        np.save(buf, x)
        return buf.getvalue()
    text = header.encode("latin1")
    width = 2 if version == 1 else 4
    text += b" " * (-(8 + width + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY" + bytes([version, 0]) + len(text).to_bytes(width, "little") + text + data


def zip_bytes(members, compression=zipfile.ZIP_STORED):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def safetensors_bytes(header, data=b""):
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(blob).to_bytes(8, "little") + blob + data


def set_zip_sizes(blob, name, file_size):
    """Rewrite the uncompressed size of ``name`` in the zip's central directory and local header."""
    blob = bytearray(blob)
    z = zipfile.ZipFile(io.BytesIO(bytes(blob)))
    info = z.getinfo(name)
    struct.pack_into("<I", blob, info.header_offset + 22, file_size)  # local header
    cd = blob.index(b"PK\x01\x02")  # the one member's central directory entry
    struct.pack_into("<I", blob, cd + 24, file_size)  # central directory (one member)
    return bytes(blob)


X = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
BF16 = X.astype(ml_dtypes.bfloat16)
ST_OK = dict(dtype="F32", shape=[2, 3, 4], data_offsets=[0, 96])

HOSTILE = {
    # .npy headers that lie about the size: numpy would allocate what they claim.
    "npy_1PiB_shape": ("x.npy", npy_bytes(header="{'descr': '<f8', 'fortran_order': False, "
                                                  "'shape': (2**47,), }".replace("2**47", str(2 ** 47)))),
    "npy_8GiB_in_128_bytes": ("x.npy", npy_bytes(header="{'descr': '<f4', 'fortran_order': False, "
                                                        f"'shape': ({2 ** 31},), }}")),
    "npy_shape_2e40": ("x.npy", npy_bytes(header=f"{{'descr': '<f4', 'fortran_order': False, "
                                                 f"'shape': ({2 ** 40},), }}", data=b"\0" * 64)),
    "npy_negative_shape": ("x.npy", npy_bytes(header="{'descr': '<f4', 'fortran_order': False, "
                                                     "'shape': (-4,), }", data=b"\0" * 16)),
    "npy_short_data": ("x.npy", npy_bytes(X)[:-5]),
    "npy_trailing_bytes": ("x.npy", npy_bytes(X) + b"junk"),
    "npy_object_dtype": ("x.npy", npy_bytes(header="{'descr': '|O', 'fortran_order': False, "
                                                   "'shape': (1,), }", data=b"\0" * 8)),
    "npy_structured": ("x.npy", npy_bytes(np.zeros(2, [("a", "<f4"), ("b", "<f4")]))),
    "npy_string_shape": ("x.npy", npy_bytes(header="{'descr': '<f4', 'fortran_order': False, "
                                                   "'shape': ('2',), }", data=b"\0" * 8)),
    "npy_header_not_dict": ("x.npy", npy_bytes(header="[1, 2, 3]")),
    "npy_header_garbage": ("x.npy", npy_bytes(header="{'descr': " + "(" * 500)),
    "npy_huge_header_len": ("x.npy", b"\x93NUMPY\x02\x00" + (2 ** 31).to_bytes(4, "little") + b"{"),
    "text_named_npy": ("x.npy", b"0.5 0.25 0.125\n1 2 3\n"),
    "empty_npy": ("x.npy", b""),
    # .npz: the member's header and the zip directory are both claims.
    "npz_member_1PiB": ("x.npz", zip_bytes({"q.npy": npy_bytes(
        header=f"{{'descr': '<f8', 'fortran_order': False, 'shape': ({2 ** 47},), }}")})),
    "npz_member_not_npy": ("x.npz", zip_bytes({"q.npy": b"just some text, not an array"})),
    "npz_only_text_member": ("x.npz", zip_bytes({"notes.txt": b"hello"})),
    "npz_pickle_member": ("x.npz", zip_bytes({"q.npy": npy_bytes(
        header="{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", data=b"\0" * 8)})),
    "npz_corrupt_deflate": ("x.npz", None),  # filled in below
    "npz_dir_claims_8GiB_stored": ("x.npz", set_zip_sizes(zip_bytes({"q.npy": npy_bytes(X)}), "q.npy", 2 ** 32 - 1)),
    "npz_dir_claims_8GiB_deflated": ("x.npz", set_zip_sizes(
        zip_bytes({"q.npy": npy_bytes(X)}, zipfile.ZIP_DEFLATED), "q.npy", 2 ** 32 - 1)),
    "npz_not_a_zip": ("x.npz", b"PK\x03\x04 this is not really a zip"),
    # .safetensors: offsets, shapes and the header itself.
    "st_offsets_512GiB": ("x.safetensors", safetensors_bytes(
        {"q": dict(dtype="F32", shape=[2 ** 37], data_offsets=[0, 2 ** 39])}, b"\0" * 64)),
    "st_header_len_huge": ("x.safetensors", (2 ** 40).to_bytes(8, "little") + b"{}"),
    "st_missing_data_offsets": ("x.safetensors", safetensors_bytes({"q": dict(dtype="F32", shape=[2])}, b"\0" * 8)),
    "st_header_is_list": ("x.safetensors", safetensors_bytes([1, 2, 3])),
    "st_string_offsets": ("x.safetensors", safetensors_bytes(
        {"q": dict(dtype="F32", shape=[2], data_offsets=["0", "8"])}, b"\0" * 8)),
    "st_shape_null": ("x.safetensors", safetensors_bytes(
        {"q": dict(dtype="F32", shape=None, data_offsets=[0, 8])}, b"\0" * 8)),
    "st_negative_offsets": ("x.safetensors", safetensors_bytes(
        {"q": dict(dtype="F32", shape=[4], data_offsets=[-16, 0])}, b"\0" * 8)),
    "st_offsets_past_end": ("x.safetensors", safetensors_bytes(
        {"q": dict(dtype="F32", shape=[4], data_offsets=[0, 16])}, b"\0" * 8)),
    "st_size_mismatch": ("x.safetensors", safetensors_bytes(
        {"q": dict(dtype="F32", shape=[3], data_offsets=[0, 8])}, b"\0" * 8)),
    "st_entry_not_object": ("x.safetensors", safetensors_bytes({"q": [1, 2]})),
    "st_unknown_dtype": ("x.safetensors", safetensors_bytes(
        {"q": dict(dtype="F128", shape=[1], data_offsets=[0, 16])}, b"\0" * 16)),
    "st_bool_offsets": ("x.safetensors", safetensors_bytes(
        {"q": dict(dtype="F32", shape=[], data_offsets=[False, True])}, b"\0" * 8)),
    "st_deep_json": ("x.safetensors", safetensors_bytes(b"[" * 100_000)),
    "st_not_utf8": ("x.safetensors", safetensors_bytes(b"{\"\xff\": 1}")),
    "st_too_short": ("x.safetensors", b"\1\0\0"),
}
_good = zip_bytes({"q.npy": npy_bytes(np.zeros(4096, np.float32))}, zipfile.ZIP_DEFLATED)
_i = zipfile.ZipFile(io.BytesIO(_good)).getinfo("q.npy")
_start = _i.header_offset + 30 + len(_i.filename)
HOSTILE["npz_corrupt_deflate"] = ("x.npz", _good[:_start] + b"\xff" * 8 + _good[_start + 8:])

MESSAGES = {  # what the one line says, for the cases where it matters most
    "npy_1PiB_shape": "but the file holds",
    "npy_negative_shape": "not a tuple of non-negative ints",
    "npy_object_dtype": "pickled Python objects, refused",
    "text_named_npy": "not an .npy file",
    "npz_member_not_npy": "not an .npy array",
    "npz_dir_claims_8GiB_deflated": "beyond what deflate can do",
    "npz_corrupt_deflate": "corrupt deflate stream",
    "st_offsets_512GiB": "outside the",
    "st_missing_data_offsets": "lacks data_offsets",
    "st_header_is_list": "not an object",
    "st_string_offsets": "are not two non-negative ints",
    "st_shape_null": "is not a list of non-negative ints",
    "st_negative_offsets": "are not two non-negative ints",
}


def write(tmp_path, name, blob):
    path = tmp_path / name
    path.write_bytes(blob)
    return path


def peak_while(fn):
    """(result or exception, peak bytes traced) while running fn."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 -- returned for the caller to judge
            result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- every listed case: a clean TensorFileError, no big allocation ---------------------------

@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_is_refused_without_allocating(tmp_path, case):
    name, blob = HOSTILE[case]
    path = write(tmp_path, name, blob)
    result, peak = peak_while(lambda: load_tensor(str(path), "--q"))
    assert isinstance(result, TensorFileError), (case, result)
    msg = str(result)
    assert msg.startswith(f"--q {path}: ") and "\n" not in msg, msg
    assert case not in MESSAGES or MESSAGES[case] in msg, msg
    assert peak <= 2 * len(blob) + MiB, (case, peak)


@pytest.mark.parametrize("case", ["npy_1PiB_shape", "npy_8GiB_in_128_bytes", "npz_member_not_npy",
                                  "npz_corrupt_deflate", "st_offsets_512GiB", "st_header_is_list",
                                  "st_negative_offsets", "text_named_npy"])
def test_cli_exits_2_with_one_line(tmp_path, capsys, case):
    name, blob = HOSTILE[case]
    hostile = write(tmp_path, name, blob)
    ok = []
    for n in ("k", "v", "out"):
        np.save(tmp_path / f"{n}.npy", np.zeros((1, 4, 1, 8), np.float32))
        ok += [f"--{n}", str(tmp_path / f"{n}.npy")]
    assert check.main(["--q", str(hostile)] + ok) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--q {hostile}: " in err, err


@pytest.mark.slow
def test_cli_subprocess_exit_2_one_line(tmp_path):
    hostile = write(tmp_path, "q.npy", HOSTILE["npy_1PiB_shape"][1])
    ok = []
    for n in ("k", "v", "out"):
        np.save(tmp_path / f"{n}.npy", np.zeros((1, 4, 1, 8), np.float32))
        ok += [f"--{n}", str(tmp_path / f"{n}.npy")]
    r = subprocess.run([sys.executable, "-m", "attnlib", "check", "--q", str(hostile)] + ok,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and f"--q {hostile}: " in lines[0] and "Traceback" not in r.stderr


# -- honest files still read, within the memory bound ----------------------------------------

def honest_files(tmp_path):
    bits = BF16.view(np.uint16)
    st_path = tmp_path / "run.safetensors"
    save_safetensors(st_path, {"x": X, "b": ("bfloat16", bits), "h": X.astype(np.float16)})
    np.savez(tmp_path / "run.npz", x=X, b=BF16)
    np.savez_compressed(tmp_path / "runc.npz", x=X)
    files = {"x.npy": X, "f.npy": np.asfortranarray(X), "be.npy": X.astype(">f4"),
             "bf.npy": BF16, "bits.npy": bits, "be_bits.npy": bits.astype(">u2")}
    for name, x in files.items():
        np.save(tmp_path / name, x)
    return st_path


@pytest.mark.parametrize("spec, dtype, kind", [
    ("x.npy", None, "float32"), ("f.npy", None, "float32"), ("be.npy", None, "float32"),
    ("bf.npy", "bfloat16", "bfloat16"), ("bits.npy", "bfloat16", "bfloat16"),
    ("be_bits.npy", "bfloat16", "bfloat16"), ("run.safetensors:x", None, "float32"),
    ("run.safetensors:b", None, "bfloat16"), ("run.safetensors:h", None, "float16"),
    ("run.npz:x", None, "float32"), ("run.npz:b", "bfloat16", "bfloat16"), ("runc.npz", None, "float32"),
])
def test_honest_files_read_exactly(tmp_path, spec, dtype, kind):
    honest_files(tmp_path)
    array, got = load_tensor(str(tmp_path / spec), "--q", dtype)
    assert got == kind and array.dtype.isnative and array.shape == X.shape
    want = BF16.astype(np.float32) if kind == "bfloat16" else X.astype(kind)
    np.testing.assert_array_equal(array, want)


def test_float16_bits(tmp_path):
    np.save(tmp_path / "h.npy", X.astype(np.float16).view(np.int16))
    array, kind = load_tensor(str(tmp_path / "h.npy"), "--q", "float16")
    assert kind == "float16" and array.dtype == np.float16
    np.testing.assert_array_equal(array, X.astype(np.float16))


def test_raw_2_byte_data_needs_dtype(tmp_path):
    np.save(tmp_path / "bf.npy", BF16)
    with pytest.raises(TensorFileError, match="pass --dtype bfloat16"):
        load_tensor(str(tmp_path / "bf.npy"), "--q")


@pytest.mark.parametrize("dtype, name", [(None, "f4.npy"), ("bfloat16", "bf.npy"), (None, "f4.safetensors"),
                                         (None, "bf.safetensors"), (None, "f4.npz")])
def test_reading_allocates_at_most_twice_the_file(tmp_path, dtype, name):
    big = np.random.default_rng(0).standard_normal((4, 256, 8, 64)).astype(np.float32)  # 2 MiB
    path = tmp_path / name
    if name == "f4.npy":
        np.save(path, big)
    elif name == "bf.npy":
        np.save(path, big.astype(ml_dtypes.bfloat16))
    elif name == "f4.safetensors":
        save_safetensors(path, {"x": big})
    elif name == "bf.safetensors":
        save_safetensors(path, {"x": ("bfloat16", big.astype(ml_dtypes.bfloat16).view(np.uint16))})
    else:
        np.savez(path, x=big)
    result, peak = peak_while(lambda: load_tensor(str(path), "--q", dtype))
    assert not isinstance(result, Exception), result
    assert result[0].shape == big.shape
    assert peak <= 2 * os.path.getsize(path) + MiB, peak


# -- fuzz: mutated files either read (bounded) or raise TensorFileError ----------------------

def _bases():
    bits = BF16.view(np.uint16)
    st_blob = safetensors_bytes({"x": ST_OK, "b": dict(dtype="BF16", shape=[2, 3, 4], data_offsets=[96, 144])},
                                X.tobytes() + bits.tobytes())
    bases = [("x.npy", npy_bytes(X)), ("x.npy", npy_bytes(np.asfortranarray(X))),
             ("x.npy", npy_bytes(BF16)), ("x.npy", npy_bytes(bits)),
             ("x.npz", zip_bytes({"x.npy": npy_bytes(X)})),
             ("x.npz", zip_bytes({"x.npy": npy_bytes(X), "b.npy": npy_bytes(BF16)}, zipfile.ZIP_DEFLATED)),
             ("x.safetensors", st_blob)]
    return bases + sorted(HOSTILE.values())


BASES = _bases()

mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 160), st.integers(1, 255)),  # mostly the header
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("append"), st.integers(1, 64), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 160), st.integers(0, 255)),
)


def mutate(blob, ops):
    b = bytearray(blob)
    for op, at, val in ops:
        if op == "flip" and b:
            b[at % len(b)] ^= val
        elif op == "truncate":
            del b[at % (len(b) + 1):]
        elif op == "append":
            b += bytes([val]) * at
        elif op == "insert":
            b[at:at] = bytes([val])
    return bytes(b)


@settings(max_examples=200, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(base=st.sampled_from(BASES), ops=st.lists(mutation, max_size=4),
       dtype=st.sampled_from([None, "bfloat16", "float16"]), key=st.sampled_from([None, "x", "b", "q"]))
@pytest.mark.slow
def test_fuzz_mutated_files(tmp_path, base, ops, dtype, key):
    name, blob = base
    blob = mutate(blob, ops)
    path = write(tmp_path, name, blob)
    spec = str(path) if key is None or name.endswith(".npy") else f"{path}:{key}"
    result, peak = peak_while(lambda: load_tensor(spec, "--q", dtype))
    size = len(blob)
    # A deflated .npz member may legitimately expand up to deflate's 1032:1.
    room = 1032 * size + 1024 if name.endswith(".npz") else size
    if isinstance(result, Exception):
        assert isinstance(result, TensorFileError), repr(result)
        assert "\n" not in str(result)
    else:
        array, kind = result
        assert array.nbytes <= 2 * room and kind in ("float16", "float32", "float64", "bfloat16")
    assert peak <= 2 * room + MiB, peak
