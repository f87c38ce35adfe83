"""The numbers behind mipu.py's flag bounds (the constants above limit_checks): where the toy breaks, and the host
RAM its sizes take against mipu.toy_bytes' estimate.

    python -m toy.limits                 # all tables, ~5 min on 2 cores
    python -m toy.limits --only memory   # one of: mismatch, lr, headroom, memory
"""
import argparse
import dataclasses
import json
import math
import resource
import subprocess
import sys

import numpy as np
import torch

import mipu

SEEDS = range(20)
# the sizes whose peak RSS is measured (each in a fresh process): the default toy, then one flag raised at a time
MEMORY_SIZES = [{}, {"toy_vocab": 128}, {"toy_vocab": 256}, {"toy_prompts": 256, "toy_vocab": 64},
                {"toy_dim": 1024}, {"toy_dim": 2048}, {"val_prompts": 20000}, {"val_prompts": 60000}]


def engine(**kw) -> mipu.ToyEngine:
    """A warm-started toy (no mismatch in its tables: the callers build their own)."""
    return mipu.ToyEngine(mipu.Config(**kw).validate("toy"), 0.0)


def mismatch_table() -> str:
    """Largest |log π − log μ| over the warm start's table at α, per logit mode: min-max over the seeds."""
    rows = ["| --toy-logit-fp8 | " + " | ".join(f"alpha {a:g}" for a in (1, 10, 100, 200)) + " |", "|---" * 5 + "|"]
    for mode in ("off", "dynamic", "static"):
        gaps = []
        for seed in SEEDS:
            pol = engine(seed=seed, toy_logit_fp8=mode).policy         # static: headroom 1, the collapse preset's
            with torch.no_grad():
                pi, eng = pol.logits(), pol.logits(engine=True)
                lp = torch.log_softmax(pi, -1)
                gaps.append([(lp - torch.log_softmax(pi + a * (eng - pi), -1)).abs().max().item()
                             for a in (1, 10, 100, 200)])
        lo, hi = np.min(gaps, 0), np.max(gaps, 0)
        rows.append(f"| {mode} | " + " | ".join(f"{a:.1f}-{b:.1f}" for a, b in zip(lo, hi)) + " |")
    return "\n".join(rows)


def one_step(**kw) -> str:
    """J(μ) after one mipu step (median over the seeds), or the error a seed's step ends in."""
    J = []
    for seed in SEEDS:
        cfg = mipu.Config(seed=seed, steps=1, method="grpo", **kw)        # unchecked: the bounds are what is tested
        try:
            J.append(mipu.toy_run(cfg, 1.0)[-1]["exact/J_mu"])
        except (RuntimeError, mipu.MIPUError) as e:
            return f"seed {seed}: {type(e).__name__}: {str(e)[:56]}"
    return f"{np.median(J):.3f}"


def lr_table() -> str:
    rows = ["| --toy-lr | J(mu) after one grpo step (median, seeds 0-19) |", "|---|---|"]
    rows += [f"| {lr:g} | {one_step(toy_lr=lr)} |" for lr in (0.02, 0.1, 0.3, 1.0, 1e18, 1e20, 3e37, 1e38)]
    return "\n".join(rows)


def headroom_table() -> str:
    """J(μ) at the warm start (static FP8 logits) and the number of distinct logit values in μ's table."""
    rows = ["| --toy-fp8-headroom | J(mu) at the warm start (median, seeds 0-19) | distinct logits of mu (seed 0) |",
            "|---|---|---|"]
    for h in (1.0, 1e3, 1e5, mipu.TOY_FP8_HEADROOM_MAX, 1e6):
        J, distinct = [], 0
        for seed in SEEDS:
            cfg = mipu.Config(seed=seed, toy_logit_fp8="static", toy_fp8_headroom=h, toy_mismatch=1.0)
            run = mipu.ToyEngine(cfg, 1.0)
            J.append(run.J[1])
            if seed == 0:
                with torch.no_grad():
                    distinct = run.policy.logits(engine=True).unique().numel()
        rows.append(f"| {h:g} | {np.median(J):.3f} | {distinct} |")
    return "\n".join(rows)


def memory_child(kw: dict) -> None:
    """Peak RSS of a 2-step toy run minus that of a tiny one (torch's own start-up), as JSON."""
    mipu.toy_run(mipu.Config(steps=1, toy_prompts=2, prompts_per_step=2, val_prompts=2), 1.0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024          # Linux: KiB
    cfg = mipu.Config(steps=2, **kw)
    mipu.toy_run(cfg, 1.0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"measured": peak - base, "estimated": mipu.toy_bytes(cfg)}))


def memory_table() -> str:
    rows = ["| sizes | peak RSS over torch's own, MiB | mipu.toy_bytes, MiB |", "|---|---|---|"]
    for kw in MEMORY_SIZES:
        p = subprocess.run([sys.executable, "-m", "toy.limits", "--memory-child", json.dumps(kw)], capture_output=True,
                           text=True, check=True)
        m = json.loads(p.stdout.splitlines()[-1])
        sizes = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in kw.items()) or "defaults"
        rows.append(f"| {sizes} | {m['measured'] / 2**20:.0f} | {m['estimated'] / 2**20:.0f} |")
    return "\n".join(rows)


TABLES = {"mismatch": ("Largest |log pi - log mu| (nats) at the warm start, seeds 0-19 (float32's exp overflows "
                       "at 88.7)", mismatch_table),
          "lr": ("--toy-lr", lr_table), "headroom": ("--toy-fp8-headroom (static FP8 logits)", headroom_table),
          "memory": ("Host RAM of a toy run (2 steps; Linux ru_maxrss)", memory_table)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=tuple(TABLES), help="one table")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.memory_child:
        return memory_child(json.loads(args.memory_child)) or 0
    for name, (title, table) in TABLES.items():
        if args.only in (None, name):
            print(f"{title}\n\n{table()}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
