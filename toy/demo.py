"""The toy demo: `python -m toy.demo` (from the repo root; about a minute on 2 cores).

Every method × seeds × mismatch presets on the toy simulator of mipu.py, the oracle acceptance
(the ceiling of every rule), random rollback at the rejection rate mipu measured (on the grpo
update, the paper's control, and on mipu's TIS update), and a gap study (T̂_post against the
exact gap at several acceptance batch sizes, probed along the grpo runs). Writes demo_results.md / .csv,
demo_curves.png and demo_metrics.jsonl (every step of every run) into --out. Bit-for-bit
reproducible for a seed, whatever --workers.
"""
import argparse
import csv
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

import mipu
from toy.collapse_study import collapsed

# Demo rows: label -> Config overrides. random-rollback is added afterwards with the
# rejection rate that mipu (paper rule) measured in the same preset.
TOY_DEMO_METHODS = {
    "grpo": {"method": "grpo"},
    "lr-decay": {"method": "grpo", "lr_decay": True},
    "mis": {"method": "mis"},
    "tis (Step 1)": {"method": "tis"},
    "step2 (Step 2)": {"method": "step2"},
    "mipu": {"method": "mipu"},
    "mipu, target rule (ours)": {"method": "mipu", "accept_rule": "target"},
    "oracle on grpo (ceiling)": {"method": "step2", "accept_rule": "oracle"},
}
# Demo presets: name -> (alpha, Config overrides, step multiplier). none/fp8/severe are mipu's TOY_PRESETS.
# collapse: the fp8 preset's engine with its logits also through FP8 with one static scale, calibrated at
# the warm start (no headroom): mismatch starts at the fp8 preset's level (k3 ~ 0.002) and grows as the
# logits sharpen past the scale and saturate; 2x the steps, so that the growth has time to happen.
DEMO_PRESETS = {**{p: (a, {}, 1) for p, a in mipu.TOY_PRESETS.items()},
                "collapse": (1.0, {"toy_logit_fp8": "static", "toy_fp8_headroom": 1.0}, 2)}
DEFAULT_PRESETS = "none,collapse"      # fp8 (k3 ~ 0.002) is mild, severe degrades without collapse: `all`
RR_METHODS = {"random-rollback (mipu's rate)": "random-rollback", "random-rollback-tis (mipu's rate)":
              "random-rollback-tis"}
TOY_DROP = 0.02                        # a "drop" is a step whose J(μ) falls by more than this
TOY_PROBE_PROMPTS = (4, 16, 64, 256)   # acceptance batches (prompts × G) of the gap study
TOY_PROBE_EVERY = 2                    # probe every 2nd candidate, x the preset's step multiplier (demo ~1 min)


def demo_run(job: tuple) -> list[dict]:
    """One toy run; with probe sizes, also T̂_post of each probed candidate at those acceptance batch
    sizes, from a separate generator so the run itself is unchanged (grpo never rolls back, so the
    probed tables are the candidate's)."""
    cfg_dict, alpha, probe, every = job
    cfg = mipu.Config(**cfg_dict)
    torch.set_num_threads(1)           # bit-for-bit: results must not depend on thread count
    run = mipu.toy_init(cfg, alpha)
    history = [{"step": -1, "exact/J_pi": run.J[0], "exact/J_mu": run.J[1]}]
    for k in range(cfg.steps):
        m = mipu.toy_step(run, k)
        if probe and k % every == 0:
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + k)
            m.update({f"probe/t_post_{n}": mipu.toy_gap_check(run, n, gen)[0] for n in probe})
        history.append(m)
    return history


def run_jobs(jobs: list[tuple], pool) -> list[list[dict]]:
    """Run (cfg dict, alpha, probe sizes) jobs, in a process pool when one is given."""
    return pool.map(demo_run, jobs, chunksize=1) if pool else [demo_run(j) for j in jobs]


def make_pool(workers: int):
    """A fork pool whose workers inherit a warmed-up torch (its first op costs ~2.5 s per process)."""
    demo_run((dataclasses.asdict(mipu.Config(steps=1, toy_prompts=2, prompts_per_step=2, val_prompts=1,
                                             mini_batch_size=4)), 1.0, (), 1))
    if workers <= 1:
        return None
    import multiprocessing
    return multiprocessing.get_context("fork").Pool(workers)


def history_column(histories: list[list[dict]], key: str) -> np.ndarray:
    """One metric over every step (not the initial record) of every run, concatenated."""
    return np.concatenate([[m[key] for m in h[1:]] for h in histories])


def toy_summary(histories: list[list[dict]]) -> dict:
    """One demo table row from the seeds' histories of one method."""
    final = np.array([h[-1]["exact/J_mu"] for h in histories])
    best = np.array([max(m["exact/J_mu"] for m in h) for h in histories])
    final_pi = np.array([h[-1]["exact/J_pi"] for h in histories])
    drops = [int((np.diff([m["exact/J_mu"] for m in h]) < -TOY_DROP).sum()) for h in histories]
    d_pi = history_column(histories, "exact/cand_dJ_pi")
    d_mu = history_column(histories, "exact/cand_dJ_mu")
    t_post = history_column(histories, "step2/t_post")
    gap = history_column(histories, "exact/cand_gap")
    valid = ~np.isnan(t_post) & (t_post != 0) & (gap != 0)
    return {
        "final J(mu)": f"{final.mean():.3f} ± {final.std():.3f}",
        "best J(mu)": f"{best.mean():.3f} ± {best.std():.3f}",
        "final J(pi)": f"{final_pi.mean():.3f}",
        "J(mu) drops > 0.02 per run": f"{np.mean(drops):.1f}",
        "collapsed": f"{sum(collapsed([m['exact/J_mu'] for m in h]) for h in histories)}/{len(histories)}",
        "accept rate": f"{np.mean(history_column(histories, 'step2/accepted')):.2f}",
        "P(J(mu) down given J(pi) up)": f"{((d_mu < 0) & (d_pi > 0)).sum() / max((d_pi > 0).sum(), 1):.2f}",
        "T_post sign agreement": (f"{(np.sign(t_post[valid]) == np.sign(gap[valid])).mean():.2f}"
                                  if valid.any() else "-"),
        "mean k3": f"{np.mean(history_column(histories, 'mismatch/k3')):.4f}",
    }


def gap_study_rows(histories: list[list[dict]], preset: str, group_size: int) -> list[dict]:
    """T̂_post sign agreement and correlation with the exact gap, per acceptance batch size."""
    probed = [[m for m in h[1:] if f"probe/t_post_{TOY_PROBE_PROMPTS[0]}" in m] for h in histories]
    gap = np.concatenate([[m["exact/cand_gap"] for m in ms] for ms in probed])
    rows = []
    for n in TOY_PROBE_PROMPTS:
        t = np.concatenate([[m[f"probe/t_post_{n}"] for m in ms] for ms in probed])
        ok = (t != 0) & (gap != 0)
        corr = np.corrcoef(t[ok], gap[ok])[0, 1] if ok.sum() > 2 else float("nan")
        rows.append({"preset": preset, "acceptance prompts": n, "samples": n * group_size,
                     "sign agreement": f"{(np.sign(t[ok]) == np.sign(gap[ok])).mean():.2f}",
                     "corr(T_post, exact gap)": f"{corr:.2f}", "T_post = 0": f"{(t == 0).mean():.2f}"})
    return rows


def preset_label(p: str, alpha: float, steps: int) -> str:
    over = " static FP8 logits," if DEMO_PRESETS[p][1] else ""
    return f"{p} (alpha={alpha:g},{over} {steps} steps)"


def rollback_at(base: dict, method: str, rate: float) -> dict:
    """Random rollback at `rate`; at rate 0 it is its update method alone (a random method refuses --reject-rate 0)."""
    if rate == 0:
        return {**base, "method": mipu.METHOD_SPEC[method][0]}
    return {**base, "method": method, "reject_rate": min(rate, 0.99)}


def toy_demo(cfg: mipu.Config, presets: list[str], n_seeds: int, workers: int, out: Path) -> None:
    """All methods × seeds × presets; tables (md, csv), curves (png) and every step (jsonl) into `out`."""
    t0 = time.time()
    alphas = {p: (cfg.toy_mismatch if cfg.toy_mismatch >= 0 else DEMO_PRESETS[p][0]) for p in presets}
    bases = {p: {**dataclasses.asdict(cfg), **DEMO_PRESETS[p][1], "steps": cfg.steps * DEMO_PRESETS[p][2]}
             for p in presets}
    seeds = [cfg.seed + i for i in range(n_seeds)]
    keys = [(p, label, s) for p in presets for label in TOY_DEMO_METHODS for s in seeds]
    # the grpo runs also probe T̂_post at several acceptance batch sizes (the gap study)
    jobs = [({**bases[p], **TOY_DEMO_METHODS[label], "seed": s}, alphas[p],
             TOY_PROBE_PROMPTS if label == "grpo" and alphas[p] > 0 else (),    # at α = 0, T̂_post ≡ 0
             TOY_PROBE_EVERY * DEMO_PRESETS[p][2])
            for p, label, s in keys]
    pool = make_pool(workers)
    results = dict(zip(keys, run_jobs(jobs, pool)))
    rates = {p: 1 - np.mean([m["step2/accepted"] for s in seeds for m in results[(p, "mipu", s)][1:]])
             for p in presets}
    rr_keys = [(p, label, s) for p in presets for label in RR_METHODS for s in seeds]
    rr_jobs = [({**rollback_at(bases[p], RR_METHODS[label], rates[p]), "seed": s}, alphas[p], (), 1)
               for p, label, s in rr_keys]
    results.update(zip(rr_keys, run_jobs(rr_jobs, pool)))
    if pool:
        pool.close()
    labels = list(TOY_DEMO_METHODS) + list(RR_METHODS)
    rows, study = [], []
    for p in presets:
        for label in labels:
            rows.append({"preset": preset_label(p, alphas[p], bases[p]["steps"]), "method": label,
                         **toy_summary([results[(p, label, s)] for s in seeds])})
            if TOY_DEMO_METHODS.get(label, {}).get("accept_rule") == "oracle":   # its T_post IS the exact gap
                rows[-1]["T_post sign agreement"] = "exact"
        if alphas[p] > 0:
            study += gap_study_rows([results[(p, "grpo", s)] for s in seeds], p, cfg.num_generations)
    write_outputs(cfg, out, rows, study, results, presets, labels, seeds, time.time() - t0)


def write_outputs(cfg, out: Path, rows, study, results, presets, labels, seeds, wall) -> None:
    out.mkdir(parents=True, exist_ok=True)
    header = (f"Generated by `python -m toy.demo` (seeds {seeds[0]}..{seeds[-1]}, "
              f"batch {cfg.prompts_per_step}x{cfg.num_generations}, acceptance {cfg.val_prompts}x"
              f"{cfg.num_generations}, c={cfg.c}). Exact J on all {cfg.toy_prompts} prompts.\n")
    md = header + "\n" + mipu.markdown_table(rows) + "\n"
    if study:                                # no gap study without mismatch (T̂_post ≡ 0 there)
        md += ("\nGap study (grpo trajectories; T_post vs exact J(mu_k+1) - J(pi_k+1) at several acceptance "
               "batches, prompts x G samples):\n\n" + mipu.markdown_table(study) + "\n")
    (out / "demo_results.md").write_text(md)
    with open(out / "demo_results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot_curves(out / "demo_curves.png", results, presets, labels, seeds)
    with open(out / "demo_metrics.jsonl", "w") as f:                # every step of every run (not in git)
        for (preset, label, seed), history in results.items():
            for m in history:
                f.write(json.dumps({"preset": preset, "method": label, "seed": seed, **m}) + "\n")
    print(md)
    print(f"toy demo: {wall:.1f} s wall; wrote {out}/demo_results.md, demo_results.csv, demo_curves.png")


def plot_curves(path: Path, results, presets, labels, seeds) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(presets), figsize=(5 * len(presets), 4), squeeze=False)
    for ax, p in zip(axes[0], presets):
        for label in labels:
            curves = np.array([[m["exact/J_mu"] for m in results[(p, label, s)]] for s in seeds])
            ax.plot(np.arange(curves.shape[1]) - 1, curves.mean(0), label=label, lw=1.2)
        ax.set_title(f"preset {p}: exact J(mu), mean of {len(seeds)} seeds", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("J(mu)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m toy.demo", description=__doc__.split("\n")[0])
    mipu.add_config_flags(parser, ("algo", "toy"))
    parser.add_argument("--presets", default=DEFAULT_PRESETS,
                        help=f"comma-separated mismatch presets ({', '.join(DEMO_PRESETS)}) or 'all'; "
                        "collapse runs 2x --steps")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per method and preset (--seed, --seed+1, ...)")
    parser.add_argument("--workers", type=int, default=2, help="processes running runs in parallel "
                        "(results do not depend on it)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent), help="folder for tables and curves")
    args = vars(parser.parse_args())
    presets = list(DEMO_PRESETS) if args["presets"] == "all" else args["presets"].split(",")
    return mipu.report_errors(check_and_run, args, presets)


def check_and_run(args: dict, presets: list[str]) -> None:
    unknown = [p for p in presets if p not in DEMO_PRESETS]
    if unknown:
        raise mipu.MIPUError(f"unknown --presets {', '.join(unknown)}; expected {', '.join(DEMO_PRESETS)} or all")
    if args["seeds"] < 1:
        raise mipu.MIPUError("--seeds must be >= 1")
    toy_demo(mipu.config_from(args), presets, args["seeds"], args["workers"], Path(args["out"]))


if __name__ == "__main__":
    sys.exit(main())
