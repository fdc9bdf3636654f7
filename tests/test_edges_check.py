"""Issue 24, items 9 and 14: inputs that are not plain numpy arrays, and a diagnosis that never
turns a FAIL into a traceback.

Item 9: a torch tensor on the ``meta`` device raised torch's ``NotImplementedError: Cannot copy
out of meta tensor``; every other unreadable input (nested, quantized, complex, fake and masked
tensors, ragged lists, numpy masked arrays with masked entries) must be refused with a
``TypeError``/``ValueError`` naming the argument, and everything readable (sparse, strided,
requiring grad, memmaps, ``np.matrix``, ...) must give the right result, the inputs unchanged.

Item 14: ``check_kernel`` with a ``score_mod`` indexing a per-head table (ALiBi slopes) raised
``IndexError`` for a wrong kernel: the diagnosis read the tensors in the other layout (the
query positions as heads) and caught only ``ValueError``.  Now a user's function failing on an
alternative problem drops that alternative; attnlib's own errors still propagate.
"""

import copy
import warnings

import numpy as np
import pytest
import torch

import attnlib
from attnlib import check
from attnlib.core import flex
from attnlib.check import diagnosis
from attnlib.core.arrays import UnreadableInput, as_numpy
from attnlib.core.options import Options
from attnlib.testing import assert_attention_close

pytestmark = [pytest.mark.filterwarnings("ignore:.*prototype stage"),
              pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
              pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning"),
              pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions"),
              pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")]

B, S, H, D = 1, 16, 2, 8
RNG = np.random.default_rng(24)
Q, K, V = (RNG.standard_normal((B, S, H, D)) for _ in range(3))  # bshd, float64


def bhsd(x):
    return np.swapaxes(np.asarray(x), 1, 2)


def ref_bshd(q, k, v, **kw):
    return np.swapaxes(attnlib.attention(bhsd(q), bhsd(k), bhsd(v), **kw), 1, 2)


OUT = ref_bshd(Q, K, V)


# -- item 9: what cannot be read is refused, naming the argument --------------------------------

def _meta(x):
    return torch.empty(np.shape(x), dtype=torch.float64, device="meta")


def _nested(x):
    return torch.nested.nested_tensor([torch.from_numpy(x[0]), torch.from_numpy(x[0][:3])])


def _masked_tensor(x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the MaskedTensors API is in prototype stage"
        t = torch.from_numpy(x.copy())
        return torch.masked.masked_tensor(t, t > 0)


def _fake(x):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(np.shape(x), dtype=torch.float64)


def _masked_array(x):
    return np.ma.array(x, mask=np.arange(x.size).reshape(x.shape) == 5)


REFUSED = {
    "meta": (_meta, "is a torch tensor on the meta device"),
    "nested": (_nested, "is a nested"),
    "quantized": (lambda x: torch.quantize_per_tensor(torch.from_numpy(x).float(), 0.1, 0, torch.qint8),
                  "is a quantized torch tensor"),
    "complex": (lambda x: torch.from_numpy(x).to(torch.complex128), "is a complex torch tensor"),
    "complex32": (lambda x: torch.from_numpy(x).to(torch.complex64).to(torch.complex32), "is a complex"),
    "masked tensor": (_masked_tensor, "MaskedTensor"),
    "fake tensor": (_fake, "FakeTensor"),
    "masked array": (_masked_array, "is a numpy masked array with 1 masked entries"),
    "ragged list": (lambda x: [[1.0, 2.0], [3.0]], "is not a rectangular array"),
    "list of meta tensors": (lambda x: [_meta(x[0])], ": "),
    "object": (lambda x: x.astype(object), "object"),
    "mixed list": (lambda x: [[[[1.0, "a"]]]], "<U"),
    "string": (lambda x: "q.npy", ""),
}

ENTRY_POINTS = {
    "attention": lambda a: attnlib.attention(a["q"], a["k"], a["v"]),
    "reference_attention": lambda a: attnlib.reference_attention(a["q"], a["k"], a["v"]),
    "check_kernel": lambda a: check.check_kernel(a["q"], a["k"], a["v"], a["out"]),
    "assert_attention_close": lambda a: assert_attention_close(a["out"], a["q"], a["k"], a["v"]),
}
def _args(slot, x, entry):
    plain = entry in ("attention", "reference_attention")
    a = dict(q=bhsd(Q) if plain else Q, k=bhsd(K) if plain else K, v=bhsd(V) if plain else V, out=OUT)
    a[slot] = x
    return a


@pytest.mark.parametrize("kind", list(REFUSED))
@pytest.mark.parametrize("entry, slot", [("attention", "q"), ("attention", "v"), ("reference_attention", "k"),
                                         ("check_kernel", "q"), ("check_kernel", "out"),
                                         ("assert_attention_close", "v"), ("assert_attention_close", "out")])
@pytest.mark.slow
def test_unreadable_inputs_are_refused_naming_the_argument(kind, entry, slot):
    make, words = REFUSED[kind]
    x = make(OUT if slot == "out" else (bhsd(Q) if entry in ("attention", "reference_attention") else Q))
    with pytest.raises((TypeError, ValueError)) as e:
        ENTRY_POINTS[entry](_args(slot, x, entry))
    message = str(e.value)
    assert message.startswith(slot + " ") or message.startswith(slot + ":"), message
    assert words in message, message


def test_meta_tensors_through_the_other_arguments():
    meta = torch.empty(2, device="meta")
    with pytest.raises(ValueError, match=r"^sinks is a torch tensor on the meta device \(.*\), which holds no values"):
        attnlib.attention(bhsd(Q), bhsd(K), bhsd(V), sinks=meta)
    for name in ("lse", "dout", "sinks"):
        shape = {"lse": (B, H, S), "dout": OUT.shape, "sinks": (H,)}[name]
        with pytest.raises(TypeError, match=f"^{name} is a torch tensor on the meta device"):
            check.check_kernel(Q, K, V, OUT, **{name: torch.empty(shape, device="meta")})
    with pytest.raises(ValueError, match="^kv_lengths is a numpy masked array"):
        check.check_kernel(Q, K, V, OUT, kv_lengths=np.ma.array([S], mask=[True]))


def test_unreadable_input_is_both_a_value_and_a_type_error():
    assert issubclass(UnreadableInput, check.UnusableInput)  # the CLI's exit code 2
    assert issubclass(UnreadableInput, ValueError) and issubclass(UnreadableInput, TypeError)


# -- item 9: what can be read gives the right result, inputs unchanged --------------------------

def _memmap(x, tmp_path):
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}.bin"
    m = np.memmap(path, dtype=x.dtype, mode="w+", shape=x.shape)
    m[:] = x
    m.flush()
    return np.memmap(path, dtype=x.dtype, mode="r", shape=x.shape)


READABLE = {
    "sparse coo": lambda x, p: torch.from_numpy(x.copy()).to_sparse(),
    "sparse csr": lambda x, p: torch.from_numpy(x.copy()).to_sparse_csr(),  # batched CSR
    "requires grad": lambda x, p: torch.from_numpy(x.copy()).requires_grad_(),
    "transposed view": lambda x, p: torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, -1, -2))).transpose(-1, -2),
    "as_strided": lambda x, p: torch.from_numpy(np.repeat(x, 2, axis=-1)).as_strided(x.shape, tuple(
        s // 8 for s in np.repeat(x, 2, axis=-1).strides[:-1]) + (2,)),
    "expanded": lambda x, p: torch.from_numpy(x[:1].copy()).expand(x.shape),
    # Strided views BLAS reads in another order (transposed: 4.4e-16 apart on AMD EPYC before
    # the kernels copied them contiguous): the bits must not depend on the strides, on any CPU.
    "Fortran order": lambda x, p: np.asfortranarray(x),
    "transposed numpy view": lambda x, p: np.ascontiguousarray(np.swapaxes(x, -1, -2)).swapaxes(-1, -2),
    "negative stride": lambda x, p: np.ascontiguousarray(x[..., ::-1, :])[..., ::-1, :],
    "every other": lambda x, p: np.repeat(x, 2, axis=-2)[..., ::2, :],
    "read-only": lambda x, p: np.require(x.copy(), requirements="C").view(),
    "big-endian": lambda x, p: x.astype(">f8"),
    "memmap": _memmap,
    "masked, nothing masked": lambda x, p: np.ma.array(x, mask=np.zeros(x.shape, bool)),
    "masked, nomask": lambda x, p: np.ma.array(x),
    "list": lambda x, p: x.tolist(),
    "tuple of arrays": lambda x, p: tuple(x),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(READABLE))
def test_readable_inputs_give_the_right_result_and_are_not_modified(kind, tmp_path):
    make = READABLE[kind]
    if kind == "expanded":
        q, k, v = (np.broadcast_to(x[:1], x.shape).copy() for x in (Q, K, V))
    else:
        q, k, v = Q, K, V
    out = ref_bshd(q, k, v)
    given = {n: make(x, tmp_path) for n, x in dict(q=q, k=k, v=v, out=out).items()}
    if kind == "read-only":
        for x in given.values():
            x.flags.writeable = False
    before = {n: x.clone() if isinstance(x, torch.Tensor) else copy.deepcopy(x) for n, x in given.items()}
    for n, x in given.items():  # conversion is exact
        want = dict(q=q, k=k, v=v, out=out)[n]
        np.testing.assert_array_equal(np.asarray(as_numpy(x, n), dtype=np.float64), want)
    # The kernels, in their (..., H, S, D) layout: the same bits as on the plain arrays.
    qb, kb, vb = (make(np.ascontiguousarray(bhsd(x)), tmp_path) for x in (q, k, v))
    plain = [np.ascontiguousarray(bhsd(x)) for x in (q, k, v)]
    if isinstance(qb, torch.Tensor):  # computed with torch (the contract's "Tensors on a device")
        plain = [torch.from_numpy(x) for x in plain]
    for entry in (attnlib.attention, attnlib.reference_attention):
        got, want = entry(qb, kb, vb), entry(*plain)
        assert type(got) is type(want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert check.check_kernel(given["q"], given["k"], given["v"], given["out"]).passed
    assert_attention_close(given["out"], given["q"], given["k"], given["v"])
    wrong = make(out + 1e-3, tmp_path)
    assert not check.check_kernel(given["q"], given["k"], given["v"], wrong).passed
    with pytest.raises(AssertionError):
        assert_attention_close(wrong, given["q"], given["k"], given["v"])
    for n, x in given.items():  # never modified
        b = before[n]
        if isinstance(x, torch.Tensor):
            assert x.layout == b.layout and x.requires_grad == b.requires_grad and x.grad is None
            assert torch.equal(x.to_dense() if x.layout != torch.strided else x,
                               b.to_dense() if b.layout != torch.strided else b)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(b))
            assert type(x) is type(b)


def test_numpy_subclasses_come_back_as_plain_arrays():
    m = np.matrix(Q[0, :, 0])  # (S, D): a 2-D problem
    assert type(as_numpy(m, "q")) is np.ndarray
    out = attnlib.attention(Q[0, :, 0], K[0, :, 0], V[0, :, 0])
    r = check.check_kernel(m, np.matrix(K[0, :, 0]), np.matrix(V[0, :, 0]), np.matrix(out))
    assert r.passed
    assert not check.check_kernel(m, np.matrix(K[0, :, 0]), np.matrix(V[0, :, 0]), np.matrix(out + 1e-3)).passed
    np.testing.assert_array_equal(attnlib.attention(m, np.matrix(K[0, :, 0]), np.matrix(V[0, :, 0])), out)
    ma = np.ma.array(Q)
    assert type(as_numpy(ma, "q")) is np.ndarray and np.shares_memory(as_numpy(ma, "q"), ma)


def test_zero_dimensional_inputs_are_refused_naming_the_argument():
    for x in (torch.tensor(1.0, dtype=torch.float64), np.float64(1.0), 1.0):
        with pytest.raises(ValueError, match="^q"):
            check.check_kernel(x, K, V, OUT)
        with pytest.raises(ValueError, match="^out"):
            check.check_kernel(Q, K, V, x)
        with pytest.raises(ValueError, match="q"):
            attnlib.attention(x, bhsd(K), bhsd(V))


@pytest.mark.slow
def test_torch_views_of_every_float_type():
    """bfloat16 and float16 tensors as strided views and with grad: read exactly."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        q, k, v = (torch.from_numpy(bhsd(x).copy()).to(dtype).transpose(1, 2).requires_grad_() for x in (Q, K, V))
        qn, kn, vn = (np.asarray(as_numpy(x, "q"), dtype=np.float64) for x in (q, k, v))
        out = torch.from_numpy(ref_bshd(qn, kn, vn)).to(dtype)
        assert check.check_kernel(q, k, v, out).passed
        # Computed with torch from the stored values (the contract's "Tensors on a device"):
        # the same bits as from contiguous float64 copies of them.
        got = attnlib.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        want = attnlib.attention(*(torch.from_numpy(np.ascontiguousarray(bhsd(x))) for x in (qn, kn, vn)))
        assert torch.equal(got, want)
        assert q.grad is None


# -- item 14: a diagnosis never turns a FAIL into a traceback ----------------------------------

SQ, HQ = 64, 4  # the other layout fits: read as bhsd, 64 "heads" of 4 positions
SLOPES = 2.0 ** -np.arange(1, HQ + 1)
WINDOW = np.array([3, 7, 15, 31])  # per head
DOCS = np.repeat(np.arange(4), SQ // 4)  # per query position


def alibi(s, b, h, i, j):
    return s - SLOPES[h] * np.abs(i - j)


def head_window(b, h, i, j):
    return (j <= i) & (i - j <= WINDOW[h])


def documents(b, h, i, j):
    return DOCS[i] == DOCS[j]


def _problem(batch=1, layout="bshd", dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    shape = (batch, SQ, HQ, 16) if layout == "bshd" else (batch, HQ, SQ, 16)
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


def _ref(q, k, v, layout, **kw):
    if layout == "bshd":
        return ref_bshd(q, k, v, **kw)
    return attnlib.attention(q, k, v, **kw)


MODS = {
    "alibi score_mod": dict(score_mod=alibi),
    "per-head window mask_mod": dict(mask_mod=head_window),
    "document mask_mod and alibi": dict(mask_mod=documents, score_mod=alibi),
    "torch-written alibi": dict(score_mod=flex.from_torch(
        lambda s, b, h, i, j: s - torch.as_tensor(SLOPES)[h] * (i - j).abs())),
    "a block mask of a per-head mask": dict(block_mask=attnlib.create_block_mask(head_window, None, HQ, SQ, SQ)),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("mods", list(MODS))
def test_mods_indexing_per_head_tables_give_a_verdict(mods, layout):
    kw = MODS[mods]
    q, k, v = _problem(layout=layout)
    ref_kw = {n: x for n, x in kw.items() if n != "block_mask"} | (
        dict(mask_mod=head_window) if "block_mask" in kw else {})
    out = _ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), layout, **ref_kw)
    good = check.check_kernel(q, k, v, out.astype(np.float32), layout=layout, **kw)
    assert good.passed, good.out
    assert_attention_close(out.astype(np.float32), q, k, v, layout=layout, **kw)
    for wrong in (out * 1.01, out + 0.05 * np.random.default_rng(1).standard_normal(out.shape),
                  _ref(q, k, v, layout, **(ref_kw | dict(scale=1.0)))):  # off; noisy; the scale never applied
        r = check.check_kernel(q, k, v, wrong.astype(np.float32), layout=layout, **kw)
        assert not r.passed and r.exit_code == 1
        assert r.diagnosis and all(isinstance(d, str) for d in r.diagnosis)
        assert "Traceback" not in check.format_text(r)
        with pytest.raises(AssertionError, match="not close"):
            assert_attention_close(wrong.astype(np.float32), q, k, v, layout=layout, **kw)


def test_the_scale_alternative_is_still_named_with_a_per_head_score_mod():
    q, k, v = _problem()
    wrong = ref_bshd(q, k, v, score_mod=alibi, scale=1.0)
    r = check.check_kernel(q, k, v, wrong.astype(np.float32), score_mod=alibi)
    assert not r.passed
    assert any("scale 1 (the softmax scale is never applied)" in d for d in r.diagnosis), r.diagnosis


@pytest.mark.slow
def test_the_other_layout_is_still_found_when_the_mods_allow_it():
    """A causal mask_mod indexes no table: the tensors read in the other layout still pass."""
    q, k, v = _problem()

    def causal(b, h, i, j):
        return j <= i

    out_bhsd = attnlib.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                 mask_mod=causal)  # (1, 64, 4, 16) taken as bhsd: 64 heads
    r = check.check_kernel(q, k, v, out_bhsd.astype(np.float32), mask_mod=causal)  # judged as bshd
    assert not r.passed
    assert any("read as --layout bhsd" in d for d in r.diagnosis), r.diagnosis


@pytest.mark.slow
def test_a_mod_raising_anything_on_an_alternative_drops_it():
    """A mask_mod defined on the problem's own positions only (a dict lookup, a custom error)."""
    class OutOfProblem(Exception):
        pass

    def picky(b, h, i, j):
        if np.max(h) >= HQ or np.max(i) >= SQ:
            raise OutOfProblem("no such head")
        return DOCS[np.minimum(i, SQ - 1)] == DOCS[np.minimum(j, SQ - 1)]

    q, k, v = _problem()
    out = ref_bshd(q, k, v, mask_mod=picky)
    assert check.check_kernel(q, k, v, out.astype(np.float32), mask_mod=picky).passed
    r = check.check_kernel(q, k, v, (out * 1.01).astype(np.float32), mask_mod=picky)
    assert not r.passed and r.diagnosis


@pytest.mark.slow
def test_failing_batch_entries_see_their_own_batch_index():
    """The alternatives run on the failing entries alone; a mask_mod indexing a per-entry table
    of documents reads the entry's own row, so the cause is named."""
    docs = np.stack([np.repeat(np.arange(n), SQ // n) for n in (1, 2, 4)])  # (3, SQ): per batch entry

    def per_entry(b, h, i, j):
        return docs[b, i] == docs[b, j]

    q, k, v = _problem(batch=3)
    out = ref_bshd(q, k, v, mask_mod=per_entry, causal=True)
    no_causal = ref_bshd(q, k, v, mask_mod=per_entry)
    wrong = out.copy()
    wrong[2] = no_causal[2]  # entry 2 forgets the causal mask
    r = check.check_kernel(q, k, v, wrong.astype(np.float32), mask_mod=per_entry, causal=True)
    assert not r.passed
    assert any("no causal mask" in d for d in r.diagnosis), r.diagnosis

    def per_entry_table(b, h, i, j):  # (3,) lengths: an index past the failing entries would fail
        return j < np.array([SQ, SQ // 2, SQ // 4])[b]

    out = ref_bshd(q, k, v, mask_mod=per_entry_table)
    wrong = out.copy()
    wrong[1:] = ref_bshd(q, k, v, mask_mod=per_entry_table, scale=1.0)[1:]
    r = check.check_kernel(q, k, v, wrong.astype(np.float32), mask_mod=per_entry_table)
    assert not r.passed
    assert any("scale 1 " in d for d in r.diagnosis), r.diagnosis


def test_gradient_and_lse_diagnoses_with_a_per_head_score_mod():
    q, k, v = (x.astype(np.float64) for x in _problem())

    def grad(s, b, h, i, j):
        return np.ones_like(s)

    dout = np.random.default_rng(2).standard_normal(q.shape)
    out, lse = attnlib.attention(bhsd(q), bhsd(k), bhsd(v), score_mod=alibi, return_lse=True)
    dq, dk, dv = attnlib.reference_attention_backward(bhsd(q), bhsd(k), bhsd(v), bhsd(dout),
                                                      score_mod=alibi, score_mod_grad=grad)[:3]
    r = check.check_kernel(q, k, v, bhsd(out), lse=lse * 1.01, dout=dout, dq=-bhsd(dq), dk=bhsd(dk),
                           dv=bhsd(dv), score_mod=alibi, score_mod_grad=grad)
    assert r.out.passed and r.lse.passed is False and r.grads["dq"].passed is False
    assert any("wrong sign" in n for n in r.grads["dq"].notes), r.grads["dq"].notes


@pytest.mark.slow
def test_attnlib_errors_in_a_diagnosis_are_not_hidden(monkeypatch):
    """Only the user's functions failing drop an alternative: a bug of attnlib's own code
    (here: the kernel raising IndexError itself) still propagates."""
    q, k, v = _problem()
    out = ref_bshd(q, k, v, score_mod=alibi)

    def broken(*args, **kw):
        raise IndexError("attnlib bug")

    monkeypatch.setattr(diagnosis, "forward_on", broken)
    with pytest.raises(IndexError, match="attnlib bug"):
        check.check_kernel(q, k, v, (out * 1.01).astype(np.float32), score_mod=alibi)


def test_guard_mods_wraps_only_the_users_functions():
    opts = Options.parse(mask_mod=head_window, score_mod=alibi)
    g = diagnosis.guard_mods(opts, entries=np.array([2]))
    assert g.scale is None and g.mask_mod is not head_window and opts.mask_mod is head_window
    assert not hasattr(g.mask_mod, "_attnlib_torch_source")
    torch_written = MODS["torch-written alibi"]["score_mod"]  # from_torch's: flex must still see it so
    guarded = diagnosis.guard_mods(Options.parse(score_mod=torch_written)).score_mod
    assert guarded._attnlib_torch_source is torch_written.__wrapped__
    with pytest.raises(diagnosis.ModFailed):
        g.score_mod(np.zeros((1, 1)), np.zeros((1, 1), int), np.full((1, 1), HQ), np.zeros((1, 1), int),
                    np.zeros((1, 1), int))
    seen = []
    diagnosis.guard_mods(Options.parse(mask_mod=lambda b, h, i, j: seen.append(np.asarray(b)) or (i >= j)),
                         entries=np.array([5, 7])).mask_mod(np.array([[0], [1]]), 0, 0, 0)
    assert seen[0].tolist() == [[5], [7]]


def _files(tmp_path):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 2, 4)).astype(np.float32) for _ in range(3))
    out = np.swapaxes(attnlib.attention(*(np.swapaxes(x, 1, 2) for x in (q, k, v)), compute_dtype="float32"), 1, 2)
    paths = {}
    for name, x in dict(q=q, k=k, v=v, out=out).items():
        paths[name] = str(tmp_path / f"{name}.npy")
        np.save(paths[name], x)
    return [arg for name, p in paths.items() for arg in (f"--{name}", p)]


@pytest.mark.parametrize("where", ["missing/x.html", "folder"])
def test_check_html_to_a_bad_path_is_one_line_and_exit_2(tmp_path, capsys, where):
    from attnlib.check import cli

    (tmp_path / "folder").mkdir()
    code = cli.main(_files(tmp_path) + ["--html", str(tmp_path / where)])
    err = capsys.readouterr().err
    assert code == 2 and "--html" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("window", [["-5", "-1"], ["3", "-2"], ["x", "1"]])
def test_check_window_sides_below_minus_one_are_a_usage_error(tmp_path, capsys, window):
    from attnlib.check import cli

    with pytest.raises(SystemExit) as e:
        cli.main(_files(tmp_path) + ["--window", *window])
    assert e.value.code == 2 and "--window" in capsys.readouterr().err
    assert cli.main(_files(tmp_path) + ["--window", "-1", "2"]) in (0, 1)
