"""``python -m attnlib bench --device``: the device section runs (the CPU part where no CUDA
device is), measures what it says, and its figures are consistent."""

import json

import pytest

torch = pytest.importorskip("torch")

from attnlib.bench import cli  # noqa: E402
from attnlib.bench.device import device_section  # noqa: E402


@pytest.mark.slow
def test_device_section_on_a_machine_without_the_asked_device():
    result = device_section("cuda" if not torch.cuda.is_available() else "cpu", repeats=1,
                            shapes=((1, 2, 256, 16),), mask_n=512, memory_ns=(512,))
    if not torch.cuda.is_available():
        assert "no CUDA device" in result["note"] and result["device"] == "cpu"
    assert result["gemm"]["tile_tflops"] > 0 and result["gemm"]["square_tflops"] > 0
    rows = result["forward"]
    assert [r["case"] for r in rows] == ["(1, 2, 256, 16) causal", "(1, 2, 256, 16) full"]
    for r in rows:
        assert r["max |torch - numpy|"] < 1e-13
        assert r["torch / numpy"] == pytest.approx(r["attnlib (torch)"] / r["attnlib (numpy)"])
        assert "torch SDPA float64" in r and r["tflops"] > 0
    assert [m["case"] for m in result["masks"]][0].startswith("sliding window")
    assert all("SDPA / attnlib" in m for m in result["masks"])
    assert [m["n"] for m in result["memory"]] == [512]  # flatness in n: the test below
    assert all(m.get("extra_bytes", -1) >= 0 for m in result["memory"]), result["memory"]
    assert "long" not in result  # CUDA only


@pytest.mark.slow
def test_bench_cli_device_writes_json(tmp_path, monkeypatch, capsys):
    import attnlib.bench.device as device

    real = device.device_section  # the CLI's wiring, at the smallest sizes (the section is tested above)
    monkeypatch.setattr(device, "device_section", lambda dev, **kw: real(
        dev, **{**kw, "shapes": ((1, 1, 128, 16),), "mask_n": 256, "memory_ns": (256,)}))
    path = tmp_path / "device.json"
    assert cli.main(["--device", "cpu", "--quick", "--repeats", "1", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["device"] == "cpu" and data["forward"] and data["memory"]
    assert "float64 GEMM" in capsys.readouterr().out


@pytest.mark.slow
def test_the_cpu_kernels_memory_is_flat_in_n():
    """RSS one call adds above its inputs and output, in a fresh process after a warm-up: a few
    512 x 512 tiles per thread (2 MiB each), the same at 4x the length."""
    from attnlib.bench.device import cpu_extra_bytes
    from attnlib.evidence.fresh import run_fresh

    # The least of up to three fresh runs each, stopping once the leasts meet the verdict: the
    # RSS a sampler sees also holds what concurrent threads happen to have alive at once, which
    # another process's load moves (seen: +11 MiB). The noise only adds, so another run can only
    # lower a least (six fresh torch processes took 17 s; a quiet machine needs one pair).
    runs = {4096: [], 16384: []}
    for _ in range(3):
        for n, rows in runs.items():
            rows.append(run_fresh(cpu_extra_bytes, n, d=16))
        short, long = (min(rows, key=lambda r: r["extra_bytes"]) for rows in runs.values())
        if long["extra_bytes"] < 64 * 2**20 and long["extra_bytes"] <= short["extra_bytes"] + 8 * 2**20:
            break
    assert long["extra_bytes"] < 64 * 2**20, long
    assert long["extra_bytes"] <= short["extra_bytes"] + 8 * 2**20, (short, long)
