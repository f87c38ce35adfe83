"""What does the toy show, quickly? The quick-start demo: `python -m toy.demo` (from the repo root; ~2 min on 2 cores).

The quick start: on the collapse preset (mipu.py's TOY_PRESETS; --presets adds others), grpo, lr-decay, tis
(Step 1), mipu (Steps 1 + 2) and the exact oracle on the TIS update (the ceiling of every Step-2 rule), then two
controls at the rejection rate mipu measured: random rollback on mipu's TIS update, and TIS with its LR times mipu's
acceptance rate (the step-size control); and a gap study (T̂_post against the exact gap at several acceptance batch
sizes, probed along the grpo runs). --all-methods adds mis, step2, the target rule, the oracle on grpo and random
rollback on the grpo update. Writes demo_results.md / .csv and demo_metrics.jsonl (every step of every run) into
--out; with the collapse preset also the figure collapse.png and its table collapse_summary.md, and with
--select-seeds N the selectivity study selectivity.md ("does Step 2 select?", N seeds per arm). Bit-for-bit reproducible for a seed
on one machine, whatever --workers.
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

# The quick start's rows: label -> Config overrides. Two more rows come afterwards, at the rejection rate that mipu
# (paper rule) measured in the same preset: random-rollback-tis at that rate, and tis with its LR times mipu's
# acceptance rate (the step-size control). --all-methods adds MORE_METHODS (and random rollback on the grpo update).
TOY_DEMO_METHODS = {
    "grpo": {"method": "grpo"},
    "lr-decay": {"method": "grpo", "lr_decay": True},
    "tis (Step 1)": {"method": "tis"},
    "mipu": {"method": "mipu"},
    "oracle on tis (ceiling)": {"method": "mipu", "accept_rule": "oracle"},
}
MORE_METHODS = {
    "mis": {"method": "mis"},
    "step2 (Step 2)": {"method": "step2"},
    "mipu, target rule (ours)": {"method": "mipu", "accept_rule": "target"},
    "oracle on grpo": {"method": "step2", "accept_rule": "oracle"},
}
# Steps per preset: x the --steps of the demo. collapse runs 8x (600 at the default 75), so that its mismatch has
# time to grow at the tuned --toy-lr (toy/RESULTS.md, the LR sweep).
STEP_MULTIPLIER = {"collapse": 8}
FOCUS = "collapse"                     # the preset of the figure, the summary table and the selectivity study
DEFAULT_PRESETS = "collapse"           # none (no mismatch), fp8 (k3 ~ 0.002), severe (no collapse): --presets all
RR_TIS, STEP_CONTROL = "random-rollback-tis (mipu's rate)", "step-size control (tis, LR x mipu's accept rate)"
RR_GRPO = "random-rollback (mipu's rate)"
RATE_CAP = 0.99                        # random rollback refuses rate 1; the step-size control keeps LR x >= 0.01
FOCUS_METHODS = ("grpo", "lr-decay", "tis (Step 1)", "mipu", RR_TIS, STEP_CONTROL, "oracle on tis (ceiling)")
TOY_DROP = 0.02                        # a "drop" is a step whose J(μ) falls by more than this
TOY_PROBE_PROMPTS = (4, 16, 64, 256)   # acceptance batches (prompts × G) of the gap study
TOY_PROBE_EVERY = 2                    # probe every 2nd candidate, x the preset's step multiplier (demo ~1 min)
SELECT_ALWAYS_C = 1e9                  # a c so large that the paper rule accepts every candidate
SELECT_RESAMPLES = 100_000             # bootstrap resamples and sign flips of the paired comparison
# the figure: label -> (legend, colour, line style); colours and styles both differ, so print in grey still reads
FOCUS_STYLE = {"grpo": ("grpo (no correction)", "tab:red", ":"),
               "lr-decay": ("lr-decay: grpo, LR decayed linearly to 0.1x", "tab:purple", (0, (1, 1))),
               "tis (Step 1)": ("tis (Step 1 only)", "tab:blue", "-."),
               "mipu": ("mipu (Step 1 + Step 2, paper rule c=0)", "tab:green", "-"),
               RR_TIS: ("random rollback at mipu's rate, tis update", "tab:orange", "--"),
               STEP_CONTROL: ("step-size control: tis at LR x mipu's accept rate", "tab:cyan", (0, (3, 1, 1, 1))),
               "oracle on tis (ceiling)": ("oracle on tis: keep iff exact J(mu) did not fall (ceiling)", "black",
                                           (0, (5, 1, 1, 1, 1, 1)))}


def demo_run(job: tuple) -> list[dict]:
    """One toy run (cfg dict, α, probe sizes, probe period, probe Ĝ_k?). With probe sizes, also T̂_post of each
    probed candidate at those acceptance batch sizes; with probe Ĝ_k, Ĝ_k (the target rule's estimate of
    J(π_{k+1}) − J(μ_k)) of every candidate on target_holdout fresh prompts × G from μ_k. Probes draw from a
    separate generator, so the run itself is unchanged; probe only runs that accept every candidate (grpo, or c
    huge), so the probed tables are the candidate's."""
    cfg_dict, alpha, probe, every, probe_g = job
    cfg = mipu.Config(**cfg_dict)
    torch.set_num_threads(1)           # bit-for-bit: results must not depend on thread count
    run = mipu.ToyEngine(cfg, alpha)
    history = [{"step": -1, "exact/J_pi": run.J[0], "exact/J_mu": run.J[1]}]
    for k in range(cfg.steps):
        lp_mu_k = run.tables[1]
        m = mipu.mipu_step(run)
        gen = torch.Generator().manual_seed(cfg.seed * mipu.ROLLOUT_SEED_MUL + k)
        if probe and k % every == 0:
            m.update({f"probe/t_post_{n}": t_post_probe(run, n, gen)[0] for n in probe})
        if probe_g:
            m["probe/g_k"] = g_k_probe(run, lp_mu_k, gen)
        history.append(m)
    return history


def t_post_probe(run: mipu.ToyEngine, n_prompts: int, gen: torch.Generator) -> tuple[float, float]:
    """T̂_post and its standard error on n_prompts × G fresh samples of the synced μ, drawn from `gen`."""
    val = run.sample(torch.randint(run.cfg.toy_prompts, (n_prompts,), generator=gen), gen)
    logp_new = run.logp(val)
    return (mipu.gap_proxy(logp_new, val.logp_sampler, val.adv, val.mask).item(),
            mipu.gap_se(logp_new, val.logp_sampler, val.adv, val.mask))


def g_k_probe(run: mipu.ToyEngine, lp_mu_k: torch.Tensor, gen: torch.Generator) -> float:
    """Ĝ_k as the target rule computes it, on target_holdout fresh prompts × G sampled from μ_k."""
    cfg, G = run.cfg, run.cfg.num_generations
    prompts = torch.randint(cfg.toy_prompts, (cfg.target_holdout,), generator=gen)
    prompt, tokens, logp_mu = mipu.toy_sample(lp_mu_k, prompts, G, gen)
    adv = mipu.group_advantages(mipu.toy_reward(run.targets, prompt, tokens, cfg.toy_tolerance), G)
    logp_new = mipu.toy_token_logp(run.tables[0], prompt, tokens)
    return mipu.surrogate_gain(logp_new, logp_mu, adv, torch.ones_like(logp_new)).item()


class Done:
    """A run done in this process, with the .get() of a pool's AsyncResult."""

    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


def submit(job: tuple, pool):
    """Start one demo_run job in the pool (or run it here): an object whose .get() returns its history."""
    return pool.apply_async(demo_run, (job,)) if pool else Done(demo_run(job))


def run_jobs(jobs: list[tuple], pool) -> list[list[dict]]:
    """Run demo_run jobs, in a process pool when one is given."""
    return pool.map(demo_run, jobs, chunksize=1) if pool else [demo_run(j) for j in jobs]


def make_pool(workers: int):
    """A fork pool whose workers inherit a warmed-up torch (its first op costs ~2.5 s per process)."""
    demo_run((dataclasses.asdict(mipu.Config(steps=1, toy_prompts=2, prompts_per_step=2, val_prompts=1,
                                             mini_batch_size=4)), 1.0, (), 1, False))
    if workers <= 1:
        return None
    import multiprocessing
    return multiprocessing.get_context("fork").Pool(workers)


def history_column(histories: list[list[dict]], key: str) -> np.ndarray:
    """One metric over every step (not the initial record) of every run, concatenated."""
    return np.concatenate([[m[key] for m in h[1:]] for h in histories])


def final_J(histories: list[list[dict]]) -> np.ndarray:
    return np.array([h[-1]["exact/J_mu"] for h in histories])


def reject_rate(histories: list[list[dict]]) -> float:
    return float(1 - np.mean(history_column(histories, "step2/accepted")))


def collapsed(J: list) -> bool:
    """J(μ) over the last 10% of the run (at least 5 points) stays below half of its best."""
    J = np.asarray(J)
    return bool((J[-max(5, len(J) // 10):] < 0.5 * J.max()).all())


def n_collapsed(histories: list[list[dict]]) -> str:
    return f"{sum(collapsed([m['exact/J_mu'] for m in h]) for h in histories)}/{len(histories)}"


def toy_summary(histories: list[list[dict]]) -> dict:
    """One demo table row from the seeds' histories of one method."""
    final = final_J(histories)
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
        "collapsed": n_collapsed(histories),
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


def preset_base(cfg: mipu.Config, p: str) -> dict:
    """The demo's Config of preset p: like `python mipu.py toy --toy-preset p`, the preset (mipu.TOY_PRESETS)
    fills in the toy flags left at their defaults; STEP_MULTIPLIER x --steps. The method's fields only (a
    TrainConfig's harness fields are not the toy's)."""
    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(mipu.Config)}
    base.update({k: v for k, v in mipu.TOY_PRESETS[p].items() if base[k] == getattr(mipu.Config, k)})
    return {**base, "steps": cfg.steps * STEP_MULTIPLIER.get(p, 1)}


def rollback_at(base: dict, method: str, rate: float) -> dict:
    """Random rollback at `rate`; at rate 0 it is its update method alone (a random method refuses --reject-rate 0)."""
    if rate == 0:
        return {**base, "method": mipu.METHOD_SPEC[method][0]}
    return {**base, "method": method, "reject_rate": min(rate, RATE_CAP)}


def rate_arms(base: dict, rate: float, all_methods: bool) -> dict:
    """The rows set by mipu's rejection rate: random-rollback-tis at it, tis at LR x (1 - rate) (the step-size
    control: the same expected step, no rejection); with all_methods also random rollback on the grpo update."""
    arms = {RR_TIS: rollback_at(base, "random-rollback-tis", rate),
            STEP_CONTROL: {**base, "method": "tis", "toy_lr": base["toy_lr"] * max(1 - rate, 1 - RATE_CAP)}}
    return {**arms, RR_GRPO: rollback_at(base, "random-rollback", rate)} if all_methods else arms


def preset_label(p: str, base: dict) -> str:
    over = " static FP8 logits," if base["toy_logit_fp8"] == "static" else ""
    return f"{p} (alpha={base['toy_mismatch']:g},{over} {base['steps']} steps)"


def toy_demo(cfg: mipu.Config, presets: list[str], n_seeds: int, select_seeds: int, workers: int, out: Path,
             all_methods: bool = False) -> None:
    """The methods × seeds × presets: tables (md, csv) and every step (jsonl) into `out`; for the collapse preset
    also the figure and the summary table, and with select_seeds the selectivity study."""
    t0 = time.time()
    bases = {p: preset_base(cfg, p) for p in presets}
    alphas = {p: bases[p]["toy_mismatch"] for p in presets}
    seeds = [cfg.seed + i for i in range(n_seeds)]
    methods = {**TOY_DEMO_METHODS, **(MORE_METHODS if all_methods else {})}
    keys = [(p, label, s) for p in presets for label in methods for s in seeds]
    # the grpo runs also probe T̂_post at several acceptance batch sizes (the gap study)
    jobs = [({**bases[p], **methods[label], "seed": s}, alphas[p],
             TOY_PROBE_PROMPTS if label == "grpo" and alphas[p] > 0 else (),    # at α = 0, T̂_post ≡ 0
             TOY_PROBE_EVERY * STEP_MULTIPLIER.get(p, 1), False)
            for p, label, s in keys]
    pool = make_pool(workers)
    # mipu's runs first: the rows at its rate queue up as soon as they are done, behind the other first runs
    first = sorted(range(len(keys)), key=lambda i: keys[i][1] != "mipu")
    pending = {keys[i]: submit(jobs[i], pool) for i in first}
    rates = {p: reject_rate([pending[(p, "mipu", s)].get() for s in seeds]) for p in presets}
    second = {p: rate_arms(bases[p], rates[p], all_methods) for p in presets}
    rate_keys = [(p, label, s) for p in presets for label in second[p] for s in seeds]
    pending.update({(p, label, s): submit(({**second[p][label], "seed": s}, alphas[p], (), 1, False), pool)
                    for p, label, s in rate_keys})
    results = {key: pending[key].get() for key in [*keys, *rate_keys]}
    rows, study = [], []
    for p in presets:
        for label in [*methods, *second[p]]:
            rows.append({"preset": preset_label(p, bases[p]), "method": label,
                         **toy_summary([results[(p, label, s)] for s in seeds])})
        if alphas[p] > 0:
            study += gap_study_rows([results[(p, "grpo", s)] for s in seeds], p, cfg.num_generations)
    write_outputs(cfg, out, rows, study, results, rates)
    written = ["demo_results.md", "demo_results.csv"]
    if FOCUS in presets:
        focus = {label: [results[(FOCUS, label, s)] for s in seeds] for label in FOCUS_METHODS}
        title = (f"preset {preset_label(FOCUS, bases[FOCUS])}, --toy-lr {bases[FOCUS]['toy_lr']:g}, "
                 f"seeds {seeds[0]}..{seeds[-1]}")
        plot_focus(out / "collapse.png", focus, title)
        write_summary(out / "collapse_summary.md", focus, title, second[FOCUS][STEP_CONTROL]["toy_lr"])
        written += ["collapse.png", "collapse_summary.md"]
        if select_seeds:
            select = [cfg.seed + i for i in range(select_seeds)]
            (out / "selectivity.md").write_text(selectivity(bases[FOCUS], select, pool, cfg.num_generations))
            written.append("selectivity.md")
    if pool:
        pool.close()
    print(f"toy demo: {time.time() - t0:.1f} s wall; wrote {', '.join(written)} into {out}")


def write_outputs(cfg, out: Path, rows, study, results, rates: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    seeds = sorted({s for _, _, s in results})
    header = (f"Generated by `python -m toy.demo` (seeds {seeds[0]}..{seeds[-1]}, --toy-lr {cfg.toy_lr:g}, "
              f"batch {cfg.prompts_per_step}x{cfg.num_generations}, acceptance {cfg.val_prompts}x"
              f"{cfg.num_generations}, c={cfg.c}). Exact J on all {cfg.toy_prompts} prompts. The rows after mipu's "
              f"are set by the rejection rate mipu measured in the preset ("
              + ", ".join(f"{p}: {r:.3f}" for p, r in rates.items()) + f"): random rollback at that rate, and tis "
              f"at --toy-lr x (1 - rate) (the step-size control).\n")
    md = header + "\n" + mipu.markdown_table(rows) + "\n"
    if study:                                # no gap study without mismatch (T̂_post ≡ 0 there)
        md += ("\nGap study (grpo trajectories; T_post vs exact J(mu_k+1) - J(pi_k+1) at several acceptance "
               "batches, prompts x G samples):\n\n" + mipu.markdown_table(study) + "\n")
    (out / "demo_results.md").write_text(md)
    with open(out / "demo_results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(out / "demo_metrics.jsonl", "w") as f:                # every step of every run (not in git)
        for (preset, label, seed), history in results.items():
            for m in history:
                f.write(json.dumps({"preset": preset, "method": label, "seed": seed, **m}) + "\n")
    print(md)


def plot_focus(path: Path, focus: dict, title: str) -> None:
    """Exact J(μ) per step of the focus methods: mean over seeds, a light band of ± one standard deviation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    for label, histories in focus.items():
        name, colour, style = FOCUS_STYLE[label]
        curves = np.array([[m["exact/J_mu"] for m in h] for h in histories])      # [seeds, steps + 1]
        mean, sd, x = curves.mean(0), curves.std(0), np.arange(curves.shape[1])
        ax.fill_between(x, mean - sd, mean + sd, color=colour, alpha=0.12, lw=0)
        ax.plot(x, mean, color=colour, ls=style, lw=2.2 if label == "mipu" else 1.6, label=name)
    ax.set_title(f"Exact J(μ) of the inference engine, mean ± sd over seeds\n{title}", fontsize=10)
    ax.set_xlabel("training step")
    ax.set_ylabel("exact J(μ) (expected reward of the sampler)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)   # off the lines
    fig.tight_layout()
    # fixed metadata: the same bytes on every run (no software version, no date)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def write_summary(path: Path, focus: dict, title: str, control_lr: float) -> None:
    best = lambda h: np.mean([max(m["exact/J_mu"] for m in r) for r in h])       # noqa: E731
    rows = [{"method": FOCUS_STYLE[label][0], "final J(mu), mean ± sd": f"{final_J(h).mean():.3f} ± "
             f"{final_J(h).std():.3f}", "best J(mu), mean": f"{best(h):.3f}",
             "collapsed runs": n_collapsed(h), "rejection rate": f"{reject_rate(h):.2f}"}
            for label, h in focus.items()]
    path.write_text(f"Generated by `python -m toy.demo`: {title}. Collapsed: J(mu) over the last 10% of steps stays "
                    f"below half of the run's best. The step-size control runs at --toy-lr {control_lr:.4g}.\n\n"
                    f"{mipu.markdown_table(rows)}\n")


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """ROC AUC: P(score of a positive > score of a negative) + P(tie) / 2, from the Mann-Whitney U of the
    average ranks (1 = perfectly separated, 0.5 = chance, 0 = reversed)."""
    if not len(pos) or not len(neg):
        return float("nan")
    x = np.concatenate([pos, neg])
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2)[inv]                  # average 1-based rank of each score
    return float((ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def paired_test(a: np.ndarray, b: np.ndarray, digits: int = 3) -> str:
    """a − b paired by seed: mean, 95% bootstrap CI, two-sided sign-flip permutation p (fixed generator)."""
    d, rng = a - b, np.random.default_rng(0)
    lo, hi = np.quantile(rng.choice(d, (SELECT_RESAMPLES, len(d))).mean(1), (0.025, 0.975))
    flipped = np.abs(rng.choice((-1.0, 1.0), (SELECT_RESAMPLES, len(d))) @ d)
    p = (np.sum(flipped >= abs(d.sum()) - 1e-12) + 1) / (SELECT_RESAMPLES + 1)
    return f"{d.mean():+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}], p = {p:.3f}"


def mean_se(x: np.ndarray, digits: int = 3) -> str:
    return f"{x.mean():.{digits}f} ± {x.std(ddof=1) / len(x) ** 0.5 if len(x) > 1 else 0:.{digits}f}"


def arm_jobs(base: dict, seeds: list[int], over: dict, probe_g: bool = False) -> list[tuple]:
    return [({**base, **over, "seed": s}, base["toy_mismatch"], (), 1, probe_g) for s in seeds]


def statistic_rows(always: list[list[dict]]) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """Per acceptance statistic along always-accepting runs: AUC for the candidates that raise the exact J(μ)
    against those that lower it, and what the rule at c = 0 would keep. Also returns ΔJ(μ) and T̂_post."""
    dj, t = history_column(always, "exact/cand_dJ_mu"), history_column(always, "step2/t_post")
    g_k = history_column(always, "probe/g_k")
    stats = {"T_post (the paper rule's)": t, "G_k + T_post (the target rule's)": g_k + t,
             "exact gap J(mu_k+1) - J(pi_k+1) (T_post without noise)": history_column(always, "exact/cand_gap")}
    up, down = dj > 0, dj < 0
    rows = []
    for name, x in stats.items():
        keep = x >= 0
        rows.append({"statistic": name, "ROC AUC, dJ(mu) > 0 vs < 0": f"{auc(x[up], x[down]):.3f}",
                     "accepted at c = 0": f"{keep.mean():.2f}",
                     "share raising J(mu) among accepted": f"{up[keep].mean():.2f}" if keep.any() else "-",
                     "mean dJ(mu) of accepted": f"{dj[keep].mean():+.5f}" if keep.any() else "-",
                     "mean dJ(mu) of rejected": f"{dj[~keep].mean():+.5f}" if (~keep).any() else "-"})
    return rows, dj, t


def selectivity(base: dict, seeds: list[int], pool, G: int) -> str:
    """Does Step 2 select? The acceptance statistics along always-accepting mipu trajectories against the
    exact ΔJ(μ) of each candidate; then rules against random rollback at their own rate (same TIS update)."""
    always = run_jobs(arm_jobs(base, seeds, {"method": "mipu", "c": SELECT_ALWAYS_C}, probe_g=True), pool)
    rows, dj, t = statistic_rows(always)
    share_up = float((dj > 0).mean())
    c_star = round(float(-np.quantile(t, 1 - share_up)), 5)     # T_post >= -c keeps the share that improved
    arms = {"mipu, paper rule, c = 0": {"method": "mipu", "c": 0.0},
            f"mipu, paper rule, c = {c_star:g} (calibrated)": {"method": "mipu", "c": c_star},
            "oracle on tis (keep iff exact dJ(mu) >= 0)": {"method": "mipu", "accept_rule": "oracle"}}
    runs = chunks(run_jobs([j for over in arms.values() for j in arm_jobs(base, seeds, over)], pool), len(seeds))
    rates = [round(reject_rate(h), 3) for h in runs]
    rr_over = [rollback_at({}, "random-rollback-tis", rate) for rate in rates]
    rr_runs = chunks(run_jobs([j for over in rr_over for j in arm_jobs(base, seeds, over)], pool), len(seeds))
    compare = [{"rule (tis update)": f"always accept (c = {SELECT_ALWAYS_C:g})", "reject rate": "0.000",
                "final J(mu), mean ± SE": mean_se(final_J(always)), "collapsed": n_collapsed(always),
                "random-rollback-tis at that rate": "-", "rule − random, paired: mean [95% CI], p": "-"}]
    compare += [{"rule (tis update)": label, "reject rate": f"{rate:.3f}",
                 "final J(mu), mean ± SE": mean_se(final_J(h)), "collapsed": n_collapsed(h),
                 "random-rollback-tis at that rate": f"{mean_se(final_J(rr))} ({n_collapsed(rr)})",
                 "rule − random, paired: mean [95% CI], p": paired_test(final_J(h), final_J(rr))}
                for label, h, rate, rr in zip(arms, runs, rates, rr_runs)]
    return (f"Generated by `python -m toy.demo` (--select-seeds {len(seeds)}): does Step 2 select? Preset "
            f"{preset_label(FOCUS, base)}, seeds {seeds[0]}..{seeds[-1]} per arm, acceptance batch "
            f"{base['val_prompts']}x{G}.\n\n"
            f"**Which candidates would each statistic accept?** Every candidate of {len(seeds)} always-accepting mipu "
            f"runs (paper rule with c = {SELECT_ALWAYS_C:g}: the TIS update, T_post computed and ignored): "
            f"{len(dj)} candidates, {share_up:.2f} of them raise the exact J(mu) (dJ(mu) = J(mu_k+1) - J(mu_k) > 0). "
            f"AUC: how well the statistic ranks a candidate that raises J(mu) above one that lowers it (0.5 = "
            f"chance). G_k is the target rule's estimate on {base['target_holdout']} fresh prompts x {G} from "
            f"mu_k. Mean dJ(mu) over all candidates: {dj.mean():+.5f}.\n\n{mipu.markdown_table(rows)}\n\n"
            f"**Rules against random rollback at their own rate**, same TIS update, final exact J(mu) (mean ± "
            f"standard error over seeds; collapsed runs). c = {c_star:g} is the c at which T_post >= -c keeps "
            f"{share_up:.2f} of the always-accept candidates, the share that raised J(mu). The paired comparison "
            f"pairs equal seeds (same task and warm start): mean difference, 95% bootstrap CI, two-sided sign-flip "
            f"permutation p ({SELECT_RESAMPLES} resamples each, fixed generator).\n\n{mipu.markdown_table(compare)}\n")


def chunks(xs: list, n: int) -> list[list]:
    return [xs[i:i + n] for i in range(0, len(xs), n)]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m toy.demo", description=__doc__.split("\n")[0])
    mipu.add_config_flags(parser, mipu.SUBCOMMANDS["toy"][0])
    parser.add_argument("--presets", default=DEFAULT_PRESETS,
                        help=f"comma-separated mismatch presets ({', '.join(mipu.TOY_PRESETS)}) or 'all'; "
                        f"collapse runs {STEP_MULTIPLIER['collapse']}x --steps")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per method and preset (--seed, --seed+1, ...; "
                        "the claims study, python -m toy.study, runs 20)")
    parser.add_argument("--select-seeds", type=int, default=0, help="seeds per arm of the selectivity study "
                        "(collapse preset; 0 = skip it; python -m toy.study asks the same on 20 seeds)")
    parser.add_argument("--all-methods", action="store_true", help="also mis, step2, the target rule, the oracle "
                        "on grpo and random rollback on the grpo update")
    parser.add_argument("--workers", type=int, default=2, help="processes running runs in parallel "
                        "(results do not depend on it)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="folder for tables and curves")
    args = vars(parser.parse_args())
    presets = list(mipu.TOY_PRESETS) if args["presets"] == "all" else args["presets"].split(",")
    return mipu.report_errors(check_and_run, args, presets)


def check_and_run(args: dict, presets: list[str]) -> None:
    unknown = [p for p in presets if p not in mipu.TOY_PRESETS]
    if unknown:
        raise mipu.MIPUError(f"unknown --presets {', '.join(unknown)}; expected {', '.join(mipu.TOY_PRESETS)} or all")
    if args["seeds"] < 1 or args["select_seeds"] < 0:
        raise mipu.MIPUError("--seeds must be >= 1 and --select-seeds >= 0")
    toy_demo(mipu.config_from(args), presets, args["seeds"], args["select_seeds"], args["workers"], Path(args["out"]),
             args["all_methods"])


if __name__ == "__main__":
    sys.exit(main())
