"""Assertions for a kernel's own test suite: ``attnlib.testing.assert_attention_close``, and
``assert_invariant`` over a sweep of the kernel's own knobs.

>>> import numpy as np, attnlib
>>> from attnlib.testing import assert_attention_close
>>> q, k, v = (x.astype(np.float32) for x in attnlib.random_qkv(64, 64, 16, heads=2, batch=(1,), seed=0))
>>> out = attnlib.attention(q, k, v, causal=True, compute_dtype="float32", block_k=16)
>>> assert_attention_close(out, q, k, v, layout="bhsd", causal=True)

Every verdict `assert_attention_close` makes, passing or failing, is handed to whoever is
`recording` (the pytest plugin's ``--attnlib-report``, `attnlib.pytest_plugin`); `record`
hands them a verdict of one's own.
"""

from __future__ import annotations

import contextlib
import contextvars

from .check import KernelCheck, check_kernel, format_text
from .check.sweep import Sweep, sweep_kernel

#: The callables each verdict goes to (`record`): `recording`'s lists, the pytest plugin's.
_listeners: list = []
#: The assert a verdict comes from, for the report's rows: an `attnlib.compat` twin sets its name.
_entry = contextvars.ContextVar("attnlib_entry", default="assert_attention_close")
#: ``device=`` for the checks when the caller gives none (the plugin's ``--attnlib-device``).
_default_device = None


def record(result: KernelCheck) -> None:
    """Hand a `~attnlib.check.KernelCheck` (``check_kernel``'s verdict) to every active
    `recording`, as `assert_attention_close` does with each of its own: a kernel's suite that
    calls ``check_kernel`` itself puts its verdicts in the ``--attnlib-report`` this way."""
    if not isinstance(result, KernelCheck):
        raise TypeError(f"result must be a KernelCheck (check_kernel's verdict), got {type(result).__name__}")
    for listener in tuple(_listeners):  # a listener may stop listening while called
        listener(result)


@contextlib.contextmanager
def recording():
    """Collect the verdicts `assert_attention_close` and `record` make while it is open.

    >>> import numpy as np, attnlib
    >>> q, k, v = attnlib.random_qkv(32, 32, 16, heads=2, seed=0)
    >>> with recording() as verdicts:
    ...     assert_attention_close(attnlib.attention(q, k, v), q, k, v, layout="bhsd")
    >>> [v.passed for v in verdicts]
    [True]
    """
    found = []
    _listeners.append(found.append)
    try:
        yield found
    finally:
        _listeners.remove(found.append)  # bound methods compare by their list's identity


def assert_attention_close(out, q, k, v, *, lse=None, dout=None, dq=None, dk=None, dv=None, dlse=None,
                           layout="bshd", dtype=None, causal=False, causal_align="bottom_right",
                           window=None, softcap=None, scale=None, kv_lengths=None, q_lengths=None, sinks=None,
                           dsinks=None, mask_mod=None, score_mod=None, block_mask=None, score_mod_grad=None,
                           key_leftpad=None, attention_chunk=None, sink_token_length=0,
                           cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, block_table=None,
                           cache_seqlens=None, workers=None, names=None, lse_dtype=None, lse_base=None,
                           lse_sink=None, lse_empty=None, q_descale=None, k_descale=None, v_descale=None,
                           qv=None, dqv=None, gather_kv_indices=None, max_scores=None, scheduler=None,
                           device=None, dropout_p=None, dropout_mask=None, sum_exp=None, k_mean=None,
                           intermediate_dtype=None):
    """Assert that a kernel's ``out`` (and ``lse``, gradients) is attention of ``q, k, v``
    to within what a correct kernel in its precision differs by.

    The verdict of `attnlib.check.check_kernel` (the same rule, reference and diagnosis),
    raised as an ``AssertionError`` for a pytest suite.

    Parameters
    ----------
    out, q, k, v : array
        The kernel's output and inputs: numpy arrays, torch tensors on any device and in
        any float type (bfloat16, float16, float8 through ``ml_dtypes``), or anything with
        ``__array__``/``__dlpack__``; never modified, converted exactly.  Shapes
        ``(batch, seqlen, nheads, headdim)`` for ``layout="bshd"`` (FlashAttention's,
        the default) or ``(batch, nheads, seqlen, headdim)`` for ``"bhsd"`` (PyTorch
        SDPA's); 3-D without the batch axis.
    lse, dout, dq, dk, dv, dsinks : array, optional
        The kernel's log-sum-exp ``(batch, nheads, seqlen_q)``, and the upstream gradient
        with the kernel's gradients (layouts of out, q, k, v; ``dsinks`` that of ``sinks``).
    dlse : array, optional
        The loss's gradient with respect to ``lse`` (FlashAttention 4's ``dlse``; ring attention):
        the gradients judged are those of a loss of ``out`` and ``lse``.
    layout, dtype, causal, causal_align, window, softcap, scale, kv_lengths, q_lengths, sinks, workers
        As in `attnlib.check.check_kernel`: the attention the kernel computes, and its
        compute precision (default: the type ``q`` is stored in).
    device : str or torch.device, optional
        Where the reference is computed with torch; default: torch tensors' own device (a
        kernel's CUDA tensors are judged on its GPU), numpy inputs on the host's cores; under
        ``pytest --attnlib-device DEVICE``, that device.
    cu_seqlens_q, cu_seqlens_k, seqused_k : array of int, optional
        A varlen kernel (``layout="thd"``, FlashAttention's ``flash_attn_varlen_func``).
    block_table, cache_seqlens : array of int, optional
        A paged KV cache: ``k`` and ``v`` are then its pages.
    mask_mod, score_mod, block_mask, score_mod_grad : optional
        FlexAttention-style programmable attention (`attnlib.core.flex`; a function written with
        torch ops goes through `attnlib.core.flex.from_torch`).
    key_leftpad, attention_chunk, sink_token_length : optional
        Left-padded keys, chunked attention, sink tokens inside a window (as in `attention`).
    lse_base, lse_sink, lse_empty : optional
        The kernel's LSE convention: base ``"e"`` or ``2``, the sink ``"included"`` or
        ``"excluded"``, empty rows ``"-inf"`` or ``"+inf"`` (default: either).
    qv, dqv : array, optional
        MLA's second query (FlashAttention 3/4's ``qv``, default scale ``1/sqrt(D + Dv)``) and
        the kernel's gradient of it.
    q_descale, k_descale, v_descale : array, optional
        An fp8 kernel's descales ``(batch, nheads_k)``: the attention of the dequantised values.
    gather_kv_indices : array of int, optional
        Top-k sparse keys (DeepSeek sparse attention, FlashMLA's ``indices``).
    max_scores : array, optional
        FlexAttention's aux ``max_scores`` ``(batch, nheads, seqlen_q)``, judged with the
        score's own allowance.
    dropout_p, dropout_mask : optional
        Dropout with the kernel's keep mask (an array, or ``keep(b, h, q_idx, kv_idx)``).
    sum_exp : array, optional
        With ``max_scores``: the row statistics in place of an LSE (cuDNN's, tokamax's).
    k_mean : array, optional
        SageAttention's mean key, subtracted before ``k`` was quantised (added back here).
    intermediate_dtype : str, optional
        The type the kernel rounds the weights to before ``p @ v`` (FlashAttention's name).
    names, lse_dtype, scheduler : optional
        How messages name each tensor, the type the kernel stored ``lse`` in, and a Dask
        cluster for the float64 reference.

    Every keyword argument is `attnlib.check.check_kernel`'s, passed on as given (the two
    signatures are kept equal by a test).  The verdict, passing or failing, goes to any
    `recording` first (`record`).

    Raises
    ------
    AssertionError
        When any judged tensor exceeds its allowance; the message is the check's full
        verdict: per-head errors, the worst positions, and the likely causes.
    attnlib.check.UnusableInput
        (a ValueError) Inputs that cannot be judged: inconsistent shapes, non-float data,
        NaN or inf in the inputs; `attnlib.check.UnreadableInput` (a TypeError as well) for
        arguments holding no values to read: torch tensors on the ``meta`` device, fake,
        nested, quantized or complex ones, numpy masked arrays with a masked entry, ragged
        lists.  Each message names the argument.

    Notes
    -----
    The rule below float64 is FlashAttention's "twice the naive error" counted in ulps of
    each entry's own size: ``|kernel - ref| <= (2 r + 2) u``, ``u`` an ulp of the kernel's
    type at ``|ref| + sqrt(sum_j p_j**2 v_j**2) + w S sqrt(sum_j p_j**2 (v_j - ref)**2)``
    (the scores' rounding: ``S`` the row's score size, ``w`` the state's epsilon over the
    type's), ``r`` the largest ``|naive - ref| / u``
    over the head, ``naive`` plain attention in the kernel's precision and ``ref`` attnlib's
    float64 result; no absolute term anchored at 0.3 (`attnlib.check.rule` says why).  A
    float64 kernel is held to the float64 rounding bound of the verdict gate.  ``docs/semantics.md`` has the
    contract (masks, alignment, empty rows, sinks).
    """
    # the keyword arguments, every one check_kernel's
    if device is None:
        device = _default_device
    options = {name: x for name, x in locals().items() if name not in ("out", "q", "k", "v")}
    result = check_kernel(q, k, v, out, **options)
    if _listeners:  # passing or failing, before raising
        record(result)
    if not result.passed:
        raise AssertionError("attention output not close to the float64 reference\n\n"
                             + format_text(result))


def assert_invariant(kernel, q, k, v, *, knobs: dict, repeats: int = 1, deterministic: bool = False,
                     dout=None, **check_options) -> Sweep:
    """Assert that ``kernel(q, k, v, **setting)`` is attention of ``q, k, v`` at every setting
    of its own ``knobs`` (split counts, GQA packing, tile or page sizes: their cartesian
    product), and with ``deterministic`` that ``repeats`` further runs of each setting give
    the same bits.

    Each setting is judged by `attnlib.check.check_kernel` (``check_options``: the attention
    the kernel computes, as in `assert_attention_close`); the kernel returns ``out``,
    ``(out, lse)`` or a dict with ``out`` and any of ``lse, dq, dk, dv`` (``dout=`` is passed
    to it when given).  FlashAttention issues 1647 and 2244: results that change with
    ``num_splits``, a "deterministic" backward that is not.

    Returns
    -------
    Sweep
        Every setting's verdict, repeatability and distance from the first setting
        (`attnlib.check.sweep`); ``Sweep.summary()`` prints it.

    Raises
    ------
    AssertionError
        Naming the settings that fail (with the first one's full verdict), and with
        ``deterministic`` those whose repeated runs differ and in which tensors.

    Examples
    --------
    >>> import numpy as np, attnlib
    >>> from attnlib.testing import assert_invariant
    >>> q, k, v = (x.astype(np.float32) for x in attnlib.random_qkv(64, 64, 16, heads=2, batch=(1,), seed=0))
    >>> def kernel(q, k, v, kv_splits, block_k):
    ...     return attnlib.attention(q, k, v, causal=True, compute_dtype="float32", kv_splits=kv_splits, block_k=block_k)
    >>> sweep = assert_invariant(kernel, q, k, v, knobs={"kv_splits": [1, 3], "block_k": [16, 64]},
    ...                          deterministic=True, layout="bhsd", causal=True)
    >>> len(sweep.settings)
    4
    """
    if check_options.get("device") is None and _default_device is not None:
        check_options["device"] = _default_device
    sweep = sweep_kernel(kernel, q, k, v, knobs=knobs, repeats=repeats, dout=dout, **check_options)
    if sweep.passed(deterministic):
        return sweep
    parts = []
    if sweep.failing:
        parts.append(f"{len(sweep.failing)} of {len(sweep.settings)} settings fail: "
                     + "; ".join(", ".join(f"{n}={x!r}" for n, x in s.knobs.items()) for s in sweep.failing))
    if deterministic and sweep.nondeterministic:
        parts.append(f"{len(sweep.nondeterministic)} settings are not deterministic (repeated runs differ)")
    text = "\n".join(parts) + "\n\n" + sweep.summary()
    if sweep.failing:
        text += "\n\nthe first failing setting's verdict:\n" + sweep.failing[0].text
    raise AssertionError(text)


__all__ = ["assert_attention_close", "assert_invariant", "record", "recording"]
