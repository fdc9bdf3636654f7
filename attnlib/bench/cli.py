"""``python -m attnlib bench``: the performance tables, printed (and saved as JSON)."""

from __future__ import annotations

import argparse
import json
import sys

from .load import under_load
from .masks import mask_cases, time_masks
from .peers import DEFAULT, backward_implementations, implementations
from .phases import phase_breakdown
from .roofline import roofline_seconds, tile_rates
from .timing import BACKWARD_CASES, CASES, QUICK_BACKWARD_CASES, QUICK_CASES, BenchCase, time_cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnlib bench",
        description="Time attnlib (default arguments: every CPU) against dense numpy and torch.")
    parser.add_argument("--quick", action="store_true", help="small cases, a smoke run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mask-n", type=int, default=16384, help="sequence length of the mask cases")
    parser.add_argument("--no-torch", action="store_true", help="leave PyTorch out even if installed")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="time the oracle on this torch device instead (cuda, cuda:1, cpu): GEMM "
                             "rate, attnlib against SDPA float64 (and numpy on the CPU), masks, memory "
                             "against n and, on CUDA, n = 131072 causal")
    args = parser.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    if args.device is not None:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            print("attnlib bench --device needs torch: pip install attnlib[torch]", file=sys.stderr)
            return 2
        from .device import MEMORY_NS, device_section
        from .timing import SHAPES

        results = device_section(args.device, repeats=args.repeats, mask_n=2048 if args.quick else args.mask_n,
                                 shapes=((1, 1, 1024, 64),) if args.quick else SHAPES,
                                 memory_ns=(1024, 4096) if args.quick else MEMORY_NS, log=log)
    else:
        results = _tables(args, log)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


def _tables(args, log) -> dict:
    """The performance tables on the CPU (no ``--device``): every section, logged as it goes."""
    torch = not args.no_torch
    cases = QUICK_CASES if args.quick else CASES
    impls = implementations(workers=(1,), include_torch=torch)
    peer = next((n for n in impls if n.startswith("torch")), None)
    results = {"rates": {}}
    for d in sorted({c.d for c in cases}):
        r = results["rates"][d] = tile_rates(d=d)
        log(f"tile rates, D={d}, {r['workers']} threads: q k^T {r['qk_gflops']:.1f} GFLOP/s, "
            f"v^T p {r['pv_gflops']:.1f} GFLOP/s, exp {r['exp_gps']:.2f} G/s")
    results["forward"] = time_cases(cases, impls, args.repeats, log)
    log("\nforward, default arguments:")
    for row in results["forward"]:
        case = BenchCase(row["b"], row["h"], row["n"], row["d"], row["causal"])
        roof = roofline_seconds(case, results["rates"][case.d]) / row[DEFAULT]
        vs = f", attnlib/torch {row[DEFAULT] / row[peer]:.2f}" if peer else ""
        log(f"  {row['case']}: {row[DEFAULT]:.3f} s, roofline {roof:.0%}{vs}")
    results["phases"] = phase_breakdown(cases[1] if len(cases) > 1 else cases[0], repeats=3)
    log(f"\nphases of {results['phases']['case']} (one thread):")
    for p in results["phases"]["phases"]:
        log(f"  {p['phase']:<28} {p['seconds']:.3f} s  {p['share']:.0%}")
    mask_n = 2048 if args.quick else args.mask_n
    log(f"\nmasks at n = {mask_n}:")
    results["masks"] = time_masks(mask_cases(mask_n), repeats=max(1, args.repeats // 2),
                                  include_torch=torch, log=log)
    log("\nbackward (gradients only):")
    results["backward"] = time_cases(QUICK_BACKWARD_CASES if args.quick else BACKWARD_CASES,
                                     backward_implementations(workers=(), include_torch=torch,
                                                              include_dense=False),
                                     args.repeats, log)
    results["load"] = under_load(cases[0], repeats=args.repeats)
    log(f"\nunder load, {results['load']['case']}: {results['load']['slowdown']:.2f}x the quiet time")
    return results


if __name__ == "__main__":
    sys.exit(main())
