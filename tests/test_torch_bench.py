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
    assert [m["n"] for m in result["memory"]] == [512]
    assert all(m.get("extra_bytes", -1) >= 0 for m in result["memory"]), result["memory"]
    assert "long" not in result  # CUDA only


def test_memory_rows_one_fresh_measurement_per_n_in_order(monkeypatch):
    """`memory_rows` measures each n of ``ns`` once, in order, and keeps a failed one as its row."""
    import attnlib.evidence.fresh as fresh
    from attnlib.bench.device import cpu_extra_bytes, memory_rows

    calls = []

    def measure(fn, n, **options):
        calls.append((fn, n, options))
        return {"extra_bytes": n} if n != 1024 else {"error": "killed"}

    monkeypatch.setattr(fresh, "run_fresh_or_error", measure)
    rows = memory_rows(torch.device("cpu"), (512, 1024, 2048))
    assert calls == [(cpu_extra_bytes, n, {}) for n in (512, 1024, 2048)]
    assert rows == [{"n": 512, "extra_bytes": 512}, {"n": 1024, "error": "killed"}, {"n": 2048, "extra_bytes": 2048}]


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

    # The least of three fresh runs each: the RSS a sampler sees also holds what concurrent
    # threads happen to have alive at once, which another process's load moves (seen: +11 MiB).
    # The noise only adds: the short length's least is taken whole (a noisy short run would
    # loosen the bound); the long length's runs stop once their least meets it: the verdict
    # all three would give (six fresh torch processes took 17 s).
    short = min((run_fresh(cpu_extra_bytes, 4096, d=16) for _ in range(3)), key=lambda r: r["extra_bytes"])
    longs = []
    for _ in range(3):
        longs.append(run_fresh(cpu_extra_bytes, 16384, d=16))
        long = min(longs, key=lambda r: r["extra_bytes"])
        if long["extra_bytes"] < 64 * 2**20 and long["extra_bytes"] <= short["extra_bytes"] + 8 * 2**20:
            break
    assert long["extra_bytes"] < 64 * 2**20, long
    assert long["extra_bytes"] <= short["extra_bytes"] + 8 * 2**20, (short, long)
