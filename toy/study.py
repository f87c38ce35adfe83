"""What does the toy show? Its claims study: `python -m toy.study [--preset collapse|collapse-long|rare-long]
[--seeds 20]` (from the repo root; 30-70 min on 2 cores).

The numbers the README's "What the toy shows" cites, on --seeds seeds of one preset, into toy/results/study_<preset>.md:
1. Collapse: every arm's runs, collapsed per seed (toy.demo.collapsed: J(μ) over the last 10 % of steps
   stays below half of the run's best), with a Wilson 95 % interval.
2. Selectivity: along always-accepting mipu runs (the TIS update; T̂_post computed and ignored), how well each
   statistic ranks the candidates that raise the exact J(μ) above those that lower it: ROC AUC pooled over all
   candidates and within windows of --window steps of one run (the choice a rule faces), 95 % bootstrap intervals
   over seeds. Statistics: T̂_post (the paper's), the exact gap, ΔJ(π) and Δgap, and Ĝ^μ at two sample sizes.
   Ĝ^μ = mean_i (μ_{k+1}(y_i)/μ_k(y_i) − 1)·A_i on fresh y ~ μ_k, geometric-mean ratio as mipu.surrogate_gain: an
   inference-side estimate of J(μ_{k+1}) − J(μ_k); ours, not the paper's.
3. Equal acceptance rates: the paper rule (c = 0), a Ĝ^μ rule (ours: accept iff Ĝ^μ ≥ 0 on val_prompts × G fresh
   samples of μ_k, the paper rule's sample cost) and the exact oracle, all on the TIS update, each next to random
   rollback at its rejection rate and to TIS with its LR scaled by its acceptance rate (the step-size control),
   paired by seed: mean difference of the final exact J(μ), 95 % bootstrap interval, sign-flip p.
Bit-for-bit reproducible, whatever --workers: single-threaded runs, one seeded generator per run, and the probes
and the Ĝ^μ rule draw from generators of their own, so probing leaves a run unchanged.

The collapse search, `--search all` (or configs from --list): which engine error collapses grpo. Per configuration
(mechanism + mismatch α, CONFIGS) grpo and the oracle on its update (step2, --accept-rule oracle), at α and at α = 0
(is the oracle just a better optimizer?); k3 and mean |Δlog p| on grpo's rollouts. `--search-rules static-h1`: every
rule of SEARCH_RULES there, each next to random rollback at its rejection rate on the grpo update and on its own.
Seeds 0.. (5), 300 steps by default; tables to toy/results/collapse/search.md and rules_<config>.md; runs cached in
runs.jsonl there (not in git; key = the full Config and α), so a rerun runs only what is missing:

    python -m toy.study --search all --seeds 5 --steps 300 --toy-lr 0.02      # ~10 min on 2 cores
    python -m toy.study --search-rules static-h1 --seeds 5 --steps 300 --toy-lr 0.02
"""
import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

import mipu
from toy import demo

HERE = Path(__file__).resolve().parent

# preset -> steps. collapse: the demo's horizon (toy.demo.preset_base). collapse-long: 4 x the 250 steps in which
# grpo collapsed in 16/20 seeds at --toy-lr 0.02, 4 x the default (at the default: 1/20, toy/results/study_collapse-long.md)
STUDY_PRESETS = {"collapse": demo.preset_base(mipu.Config(), "collapse")["steps"], "collapse-long": 1000,
                 "rare-long": 300}
# preset -> method -> Adam LR: each method at its own best of `python -m toy.sweep --preset rare-long --methods
# tis,grpo,mipu --lrs 0.007,0.005,0.0035,0.0025 --horizons 150,300` (toy/results/sweep_rare-long.md, 300 steps); the rules
# and their controls run at mipu's. mipu's four cells tie (it rejects almost every candidate): TIS's LR, its update.
# A preset not named here runs every arm at --toy-lr.
METHOD_LRS = {"rare-long": {"grpo": 0.0035, "tis": 0.005, "mipu": 0.005}}
FIRST_SEED = 1000                 # seeds 1000, 1001, ...: none of them was used to choose a preset or a setting
WINDOW = 15                       # steps per window of the within-window AUC
GMU_PROMPTS = (32, 128)           # Ĝ^μ probes: prompts × G fresh samples from μ_k
BOOTSTRAP = 2000                  # resamples of seeds for the AUC intervals (fixed generator)
Z95 = 1.959964                    # two-sided 95 % normal quantile (Wilson interval)
RATE_CAP = 0.99                   # random rollback refuses rate 1; the step-size control keeps LR x >= 1 - RATE_CAP
RULE_STREAM, PROBE_STREAM = 1 << 40, 1 << 41     # seed offsets: the Ĝ^μ rule's and the probes' generators
MAX_WORKERS = 2                   # the machines this runs on have 2 cores
ALWAYS = "mipu, always accept (c = 1e9): the probed runs"
# label -> (Config overrides, kind); kind: plain, probe (Ĝ^μ probes on their own generators), gmu (the Ĝ^μ rule)
BASE_ARMS = {"grpo (no correction)": ({"method": "grpo"}, "plain"),
             "grpo without mismatch (alpha = 0: mu = pi)": ({"method": "grpo", "toy_mismatch": 0.0}, "plain"),
             "tis (Step 1 only)": ({"method": "tis"}, "plain"),
             ALWAYS: ({"method": "mipu", "c": demo.SELECT_ALWAYS_C}, "probe")}
# the Ĝ^μ rule draws val_prompts × G fresh samples of μ_k: at 32 (the default) the paper rule's sample cost
RULES = {"paper rule, c = 0 (mipu)": ({"method": "mipu"}, "plain"),
         **{f"G^mu rule, {n}x8, c = 0 (ours)": ({"method": "mipu", "val_prompts": n}, "gmu") for n in GMU_PROMPTS},
         "oracle: keep iff exact dJ(mu) >= 0": ({"method": "mipu", "accept_rule": "oracle"}, "plain")}
STATS = ("t_post", "gap", "dJ_pi", "dgap", *(f"gmu_{n}" for n in GMU_PROMPTS))   # the selectivity statistics


def stat_names(base: dict) -> dict:
    """statistic key -> (its name in the tables, a short name for the per-window columns)."""
    G = base["num_generations"]
    return {"t_post": (f"T_post, {base['val_prompts']}x{G} (the paper rule's)", "T_post"),
            "gap": ("exact gap J(mu_k+1) - J(pi_k+1) (T_post without noise)", "gap"),
            "dJ_pi": ("exact dJ(pi) = J(pi_k+1) - J(pi_k)", "dJ(pi)"),
            "dgap": ("exact change of the gap, gap_k+1 - gap_k", "d gap"),
            **{f"gmu_{n}": (f"G^mu, {n}x{G} (ours)", f"G^mu {n}x{G}") for n in GMU_PROMPTS}}


# ---- the runs: every use of the toy's engine API (mipu.ToyEngine, mipu.mipu_step) is in this section

def mu_k_sample(cfg: mipu.Config, targets, lp_mu_k, n_prompts: int, gen: torch.Generator) -> tuple:
    """n_prompts × G fresh samples of μ_k: (prompt [B], tokens [B, H], log μ_k [B, H], rewards [B], advantages [B])."""
    G = cfg.num_generations
    prompts = torch.randint(cfg.toy_prompts, (n_prompts,), generator=gen)
    prompt, tokens, logp_k = mipu.toy_sample(lp_mu_k, prompts, G, gen)
    rewards = mipu.toy_reward(targets, prompt, tokens, cfg.toy_tolerance)
    return prompt, tokens, logp_k, rewards, mipu.group_advantages(rewards, G)


def g_mu_of(lp_mu_new, prompt, tokens, logp_k, adv) -> float:
    """Ĝ^μ = mean_i (ρ_i − 1) A_i on samples of μ_k, ρ_i the geometric-mean μ_{k+1}/μ_k of response i."""
    logp_new = mipu.toy_token_logp(lp_mu_new, prompt, tokens)                           # [B, H]
    return mipu.surrogate_gain(logp_new, logp_k, adv, torch.ones_like(logp_new)).item()


def g_mu(cfg: mipu.Config, targets, lp_mu_k, lp_mu_new, n_prompts: int, gen: torch.Generator) -> float:
    """Ĝ^μ on n_prompts × G fresh samples of μ_k drawn from gen."""
    prompt, tokens, logp_k, _, adv = mu_k_sample(cfg, targets, lp_mu_k, n_prompts, gen)
    return g_mu_of(lp_mu_new, prompt, tokens, logp_k, adv)


class GmuEngine(mipu.ToyEngine):
    """The Ĝ^μ rule (ours): Step 2's batch is val_prompts × G fresh samples of μ_k, drawn from a generator of its
    own, and the rule compares Ĝ^μ on it with c, in place of T̂_post (step2/stat then holds Ĝ^μ; step2/t_post is
    T̂_post on that batch). mipu.verdict's oracle branch compares exact_terms()'s sum with −c (c_se 0): the engine
    takes that branch, with (Ĝ^μ, 0) as its terms."""

    def __init__(self, cfg: mipu.Config, alpha: float):
        super().__init__(cfg, alpha)
        self.cfg = dataclasses.replace(cfg, accept_rule="oracle", c_se=0.0)   # the branch, not the exact J
        self.rule_gen = torch.Generator().manual_seed(cfg.seed + RULE_STREAM)
        self.val = None

    def acceptance_rollout(self) -> mipu.Rollout:          # after the sync: self.prev holds θ_k's tables
        prompt, tokens, logp_k, rewards, adv = mu_k_sample(self.cfg, self.targets, self.prev[0][1],
                                                           self.cfg.val_prompts, self.rule_gen)
        self.val = mipu.Rollout(prompt, tokens, logp_k, torch.ones_like(logp_k), rewards, adv,
                                torch.zeros_like(rewards))
        return self.val

    def exact_terms(self) -> tuple[float, float]:          # Ĝ^μ of μ_{k+1} on the acceptance batch, and −0.0:
        val = self.val                                     # x + (−0.0) is x, bit for bit (−0.0 too)
        return g_mu_of(self.tables[1], val.prompt_ids, val.completion_ids, val.logp_sampler, val.adv), -0.0


def study_run(job: tuple) -> dict:
    """One run (cfg dict, α, kind), reduced to the per-step series the tables need: the exact J of the accepted θ
    (initial value first), and of every candidate its verdict, the statistic the rule decided on, T̂_post, the
    exact gap, ΔJ(π), ΔJ(μ), Δgap and (kind probe) Ĝ^μ at each probe size, from generators of their own."""
    cfg_dict, alpha, kind = job
    cfg = mipu.Config(**cfg_dict)
    torch.set_num_threads(1)             # bit-for-bit: results must not depend on thread count
    eng = (GmuEngine if kind == "gmu" else mipu.ToyEngine)(cfg, alpha)
    s = {"J_pi": [eng.J[0]], "J_mu": [eng.J[1]], **{k: [] for k in ("accepted", "stat", "gap", "dJ_pi", "dJ_mu",
                                                                     "dgap")}}
    s.update({f"gmu_{n}": [] for n in GMU_PROMPTS} if kind == "probe" else {})
    for k in range(cfg.steps):
        lp_mu_k, gap_k = eng.tables[1], s["J_mu"][-1] - s["J_pi"][-1]
        m = mipu.mipu_step(eng)
        for key, v in (("J_pi", m["exact/J_pi"]), ("J_mu", m["exact/J_mu"]), ("accepted", m["step2/accepted"]),
                       ("stat", m["step2/stat"]), ("gap", m["exact/cand_gap"]), ("dJ_pi", m["exact/cand_dJ_pi"]),
                       ("dJ_mu", m["exact/cand_dJ_mu"]), ("dgap", m["exact/cand_gap"] - gap_k)):
            s[key].append(v)
        for i, n in enumerate(GMU_PROMPTS if kind == "probe" else ()):    # after the step: μ_{k+1} is accepted
            gen = torch.Generator().manual_seed(PROBE_STREAM + (cfg.seed * 1_000_003 + k) * len(GMU_PROMPTS) + i)
            s[f"gmu_{n}"].append(g_mu(cfg, eng.targets, lp_mu_k, eng.tables[1], n, gen))
    s["t_post"] = s["stat"]              # the probed runs' rule is the paper's: the statistic is T̂_post
    return s


def run_arms(arms: dict, base: dict, seeds: list[int], pool) -> dict:
    """label -> the runs of that arm (Config overrides, kind), one per seed."""
    jobs = [({**base, **over, "seed": s}, {**base, **over}["toy_mismatch"], kind) for over, kind in arms.values()
            for s in seeds]
    runs = pool.map(study_run, jobs, chunksize=1) if pool else [study_run(j) for j in jobs]
    return {label: runs[i * len(seeds):(i + 1) * len(seeds)] for i, label in enumerate(arms)}


def controls(rates: dict, lr: float) -> dict:
    """Per rule, at its measured rejection rate: random rollback on the TIS update, and TIS at LR x acceptance."""
    arms = {}
    for label, rate in rates.items():
        arms[("random", label)] = (demo.rollback_at({}, "random-rollback-tis", rate), "plain")
        arms[("step", label)] = ({"method": "tis", "toy_lr": lr * max(1 - rate, 1 - RATE_CAP)}, "plain")
    return arms


def check_configs(arms: dict, base: dict, seeds: list[int]) -> None:
    """Every run's Config is valid (one MIPUError line), before any run starts."""
    for over, _ in arms.values():
        for s in (seeds[0], seeds[-1]):
            mipu.Config(**{**base, **over, "seed": s})


# ---- statistics and tables

def wilson(k: int, n: int) -> tuple[float, float]:
    """Wilson score 95 % interval of a proportion k/n."""
    p, z2 = k / n, Z95 ** 2
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), Z95 * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def n_collapsed(runs: list[dict]) -> str:
    k = sum(demo.collapsed(r["J_mu"]) for r in runs)
    lo, hi = wilson(k, len(runs))
    return f"{k}/{len(runs)} [{lo:.2f}, {hi:.2f}]"


def final(runs: list[dict]) -> np.ndarray:
    return np.array([r["J_mu"][-1] for r in runs])


def reject_rate(runs: list[dict]) -> float:
    return float(1 - np.mean(np.concatenate([r["accepted"] for r in runs])))


def collapse_rows(res: dict) -> list[dict]:
    return [{"arm": label if isinstance(label, str) else arm_name(label), "collapsed, k/n [Wilson 95%]":
             n_collapsed(runs), "final J(mu), mean ± SE": demo.mean_se(final(runs)),
             "best J(mu), mean": f"{np.mean([max(r['J_mu']) for r in runs]):.3f}",
             "reject rate": f"{reject_rate(runs):.3f}"} for label, runs in res.items()]


def arm_name(key: tuple) -> str:
    kind, rule = key
    return f"{'random-rollback-tis' if kind == 'random' else 'tis, LR x accept rate'} at the rate of: {rule}"


def auc_parts(x: np.ndarray, dj: np.ndarray, window: int) -> tuple[float, float]:
    """Σ over windows of one run of (AUC · pairs) and the pairs (improving × worsening candidates) of each window."""
    u = pairs = 0.0
    for w in range(0, len(x), window):
        up, down = x[w:w + window][dj[w:w + window] > 0], x[w:w + window][dj[w:w + window] < 0]
        if len(up) and len(down):
            u, pairs = u + demo.auc(up, down) * len(up) * len(down), pairs + len(up) * len(down)
    return u, pairs


def auc_cells(runs: list[dict], key: str, window: int, idx: np.ndarray) -> tuple[str, str]:
    """ROC AUC of statistic `key` for ΔJ(μ) > 0 against < 0: pooled over every candidate, and within windows
    (pairs of candidates from one run and one window only), each with a 95 % bootstrap interval over seeds
    (idx: [BOOTSTRAP, seeds] resampled seed indices)."""
    xs, ds = [np.asarray(r[key]) for r in runs], [np.asarray(r["dJ_mu"]) for r in runs]
    ups, downs = [x[d > 0] for x, d in zip(xs, ds)], [x[d < 0] for x, d in zip(xs, ds)]
    u, pairs = np.array([auc_parts(x, d, window) for x, d in zip(xs, ds)]).T                    # [seeds] each
    pooled = [demo.auc(np.concatenate([ups[i] for i in ix]), np.concatenate([downs[i] for i in ix])) for ix in idx]
    with np.errstate(invalid="ignore"):                  # a resample without a pair: NaN, left out
        within = u[idx].sum(1) / pairs[idx].sum(1)
        point = u.sum() / pairs.sum()
    cell = lambda x, boot: f"{x:.3f} [{np.nanquantile(boot, 0.025):.3f}, {np.nanquantile(boot, 0.975):.3f}]"
    return cell(demo.auc(np.concatenate(ups), np.concatenate(downs)), pooled), cell(point, within)


def selectivity_rows(runs: list[dict], base: dict, window: int) -> list[dict]:
    idx = np.random.default_rng(0).integers(len(runs), size=(BOOTSTRAP, len(runs)))
    dj = np.concatenate([r["dJ_mu"] for r in runs])
    rows = []
    for key, (name, _) in stat_names(base).items():
        pooled, within = auc_cells(runs, key, window, idx)
        keep = np.concatenate([r[key] for r in runs]) >= 0
        rows.append({"statistic": name, "AUC pooled [95% CI]": pooled,
                     f"AUC within {window}-step windows [95% CI]": within, "share >= 0": f"{keep.mean():.2f}",
                     "share raising J(mu) among >= 0": f"{(dj[keep] > 0).mean():.2f}" if keep.any() else "-"})
    return rows


def window_rows(runs: list[dict], base: dict, window: int) -> list[dict]:
    """Per window of steps, every seed's candidates: how many raise J(μ), the mean exact gap, per-window AUCs."""
    rows, steps = [], len(runs[0]["dJ_mu"])
    for w in range(0, steps, window):
        cut = {k: np.concatenate([r[k][w:w + window] for r in runs]) for k in ("dJ_mu", *STATS)}
        up, down = cut["dJ_mu"] > 0, cut["dJ_mu"] < 0
        rows.append({"steps": f"{w}-{min(w + window, steps) - 1}", "candidates": len(up),
                     "share raising J(mu)": f"{up.mean():.2f}", "mean exact gap": f"{cut['gap'].mean():+.4f}",
                     **{f"AUC {short}": f"{demo.auc(cut[k][up], cut[k][down]):.2f}"
                        for k, (_, short) in stat_names(base).items()}})
    return rows


def equal_rate_rows(res: dict, rates: dict, lrs: dict) -> list[dict]:
    """Each rule next to random rollback at its rejection rate and TIS at LR x its acceptance rate (same seeds)."""
    tis = res["tis (Step 1 only)"]
    cell = lambda runs: f"{demo.mean_se(final(runs))} ({n_collapsed(runs).split()[0]})"     # noqa: E731
    rows = [{"rule (TIS update)": "none: tis, always accept", "reject rate": "0.000",
             "final J(mu), mean ± SE (collapsed)": cell(tis),
             "random-rollback-tis at that rate": "-", "rule − random, paired: mean [95% CI], p": "-",
             "tis at LR x accept rate (step-size control)": "-", "rule − step-size control, paired": "-",
             "random − step-size control, paired": "-"}]
    for label in RULES:
        h, rr, st = final(res[label]), final(res[("random", label)]), final(res[("step", label)])
        rows.append({"rule (TIS update)": label, "reject rate": f"{rates[label]:.3f}",
                     "final J(mu), mean ± SE (collapsed)": cell(res[label]),
                     "random-rollback-tis at that rate": cell(res[("random", label)]),
                     "rule − random, paired: mean [95% CI], p": demo.paired_test(h, rr),
                     "tis at LR x accept rate (step-size control)": f"LR {lrs[label]:.4g}: "
                                                                    f"{cell(res[('step', label)])}",
                     "rule − step-size control, paired": demo.paired_test(h, st),
                     "random − step-size control, paired": demo.paired_test(rr, st)})
    return rows


def preset_text(preset: str, base: dict) -> str:
    return (f"preset {preset} (alpha={base['toy_mismatch']:g}, FP8 weights, {base['toy_logit_fp8']} FP8 logits; "
            f"{base['toy_prompts']} prompts, {base['toy_horizon']} tokens over {base['toy_vocab']} symbols, reward 1 "
            f"iff at most {base['toy_tolerance']} wrong, warm start to a mean target-token prob of "
            f"{base['toy_init_prob']:g}; width {base['toy_dim']}; {base['steps']} steps, Adam LR "
            f"{base['toy_lr']:g}), batch "
            f"{base['prompts_per_step']}x{base['num_generations']}, acceptance {base['val_prompts']}x"
            f"{base['num_generations']}")


def own_text(own: dict) -> str:
    if not own:
        return ""
    return ("; each method at its own LR (" + ", ".join(f"{m} {lr:g}" for m, lr in own.items()) + "; the rules and "
            "their controls at mipu's)")


def write_study(path: Path, command: str, preset: str, base: dict, seeds: list[int], window: int, res: dict,
                rates: dict, lrs: dict, own: dict) -> None:
    always = res[ALWAYS]
    dj = np.concatenate([r["dJ_mu"] for r in always])
    G, n = base["num_generations"], len(seeds)
    text = (
        f"Generated by `{command}`: {preset_text(preset, base)}; seeds {seeds[0]}..{seeds[-1]}, one run per seed "
        f"and arm{own_text(own)}.\n\n**Collapse.** A run collapses when its exact J(mu) over the last 10% of steps (at least 5) "
        f"stays below half of its best. Interval: Wilson 95% over the {n} seeds. Final J(mu): mean ± standard "
        f"error over seeds.\n\n{mipu.markdown_table(collapse_rows(res))}\n\n"
        f"**Which candidates would each statistic accept?** Every candidate of the {n} always-accepting mipu runs "
        f"(the TIS update; T_post computed and ignored): {len(dj)} candidates, {(dj > 0).mean():.2f} of them raise "
        f"the exact J(mu). AUC: P(a candidate that raises J(mu) scores above one that lowers it), ties 1/2; pooled "
        f"over every candidate, and within windows (only pairs of candidates of one run and one window of {window} "
        f"steps). Interval: 95% bootstrap over seeds ({BOOTSTRAP} resamples, fixed generator). G^mu = mean_i "
        f"(mu_k+1(y_i)/mu_k(y_i) - 1) A_i on fresh y ~ mu_k (geometric-mean ratio, as mipu.surrogate_gain), an "
        f"inference-side estimate of J(mu_k+1) - J(mu_k): ours, not the paper's; its probes draw from generators "
        f"of their own. share >= 0: what a rule 'statistic >= 0' would keep.\n\n"
        f"{mipu.markdown_table(selectivity_rows(always, base, window))}\n\n"
        f"Per window of steps (every seed's candidates of that window pooled; AUC without interval):\n\n"
        f"{mipu.markdown_table(window_rows(always, base, window))}\n\n"
        f"**Rules at equal acceptance rates**, all on the TIS update, final exact J(mu) (mean ± SE; collapsed "
        f"runs). The G^mu rule (ours) keeps a candidate iff G^mu >= 0 on n x {G} fresh samples of mu_k, from a "
        f"generator of its own; at n = {base['val_prompts']} it costs as many samples as the paper rule. Each "
        f"rule's rejection rate (over all its candidates) sets two controls: random-rollback-tis at that rate "
        f"(capped at {RATE_CAP}), and tis with its LR scaled by the acceptance rate, 1 - rate (at least "
        f"{1 - RATE_CAP:g}): the step-size control. Paired by seed (same task and warm start): mean difference, "
        f"95% bootstrap CI, two-sided sign-flip permutation p "
        f"({demo.SELECT_RESAMPLES} resamples, fixed generator).\n\n"
        f"{mipu.markdown_table(equal_rate_rows(res, rates, lrs))}\n")
    path.write_text(text)
    print(text)


def first_arms(preset: str, steps: int, toy_lr: float) -> tuple[dict, dict, dict]:
    """(base Config dict, method -> own LR, the arms before the controls): toy_lr 0 = each method's METHOD_LRS where
    the preset has them (the base, and so the rules and their controls, at mipu's), else mipu.py's default; a
    toy_lr given: every arm's."""
    own = {} if toy_lr else METHOD_LRS.get(preset, {})
    base = {**demo.preset_base(mipu.Config(toy_lr=own.get("mipu", toy_lr or mipu.Config.toy_lr)), preset),
            "steps": steps}
    first = {label: ({"toy_lr": own[over["method"]], **over} if over["method"] in own else over, kind)
             for label, (over, kind) in {**BASE_ARMS, **RULES}.items()}
    return base, own, first


def study(preset: str, n_seeds: int, steps: int, first_seed: int, window: int, workers: int, out: Path,
          command: str, toy_lr: float = 0.0) -> Path:
    """Every arm on n_seeds seeds of the preset, then each rule's controls at its rate; the tables into out. toy_lr:
    as first_arms."""
    t0 = time.time()
    base, own, first = first_arms(preset, steps, toy_lr)
    seeds = list(range(first_seed, first_seed + n_seeds))
    check_configs(first, base, seeds)
    pool = demo.make_pool(workers)
    res = run_arms(first, base, seeds, pool)
    rates = {label: round(reject_rate(res[label]), 3) for label in RULES}
    second = controls(rates, base["toy_lr"])
    check_configs(second, base, seeds)
    res.update(run_arms(second, base, seeds, pool))
    if pool:
        pool.close()
    lrs = {label: second[("step", label)][0]["toy_lr"] for label in RULES}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"study_{preset}.md"
    write_study(path, command, preset, base, seeds, window, res, rates, lrs, own)
    print(f"toy study: {time.time() - t0:.1f} s wall; wrote {path}")
    return path


# ---- the collapse search (--search, --search-rules)

# name -> (mechanism, Config overrides, α). α = 1 is the FP8/bf16 engine as is (the fp8 preset).
CONFIGS = {
    "base-a1": ("none (the fp8 preset)", {}, 1.0),
    "base-a8": ("none (the severe preset)", {}, 8.0),
    "dyn-a1": ("FP8 logits, dynamic per-row scale", dict(toy_logit_fp8="dynamic"), 1.0),
    "dyn-a4": ("FP8 logits, dynamic per-row scale", dict(toy_logit_fp8="dynamic"), 4.0),
    "static-h1": ("FP8 logits, static scale, saturating", dict(toy_logit_fp8="static", toy_fp8_headroom=1.0), 1.0),
    "static-h1.5": ("FP8 logits, static scale, saturating", dict(toy_logit_fp8="static", toy_fp8_headroom=1.5), 1.0),
    "static-h2": ("FP8 logits, static scale, saturating", dict(toy_logit_fp8="static", toy_fp8_headroom=2.0), 1.0),
}
SEARCH_ARMS = {"grpo": ({"method": "grpo"}, True), "oracle": ({"method": "step2", "accept_rule": "oracle"}, True),
               "grpo-a0": ({"method": "grpo"}, False), "oracle-a0": ({"method": "step2", "accept_rule": "oracle"}, False)}
# Acceptance rules compared in a collapse configuration (--search-rules): label -> Config overrides.
SEARCH_RULES = {
    "grpo (always accept)": {"method": "grpo"},
    "tis (always accept)": {"method": "tis"},
    "step2: grpo + paper rule, c=0": {"method": "step2"},
    "step2: grpo + paper rule, c=0.03": {"method": "step2", "c": 0.03},
    "step2: grpo + paper rule, c=0 + 2 SE": {"method": "step2", "c_se": 2.0},
    "step2: grpo + target rule": {"method": "step2", "accept_rule": "target"},
    "mipu: paper rule, c=0": {"method": "mipu"},
    "mipu: paper rule, c=0.01": {"method": "mipu", "c": 0.01},
    "mipu: paper rule, c=0.03": {"method": "mipu", "c": 0.03},
    "mipu: paper rule, c=0 + 2 SE": {"method": "mipu", "c_se": 2.0},
    "mipu: target rule": {"method": "mipu", "accept_rule": "target"},
    "oracle on grpo (ceiling)": {"method": "step2", "accept_rule": "oracle"},
    "oracle on tis (ceiling)": {"method": "mipu", "accept_rule": "oracle"},
}


def job_key(job: tuple) -> str:
    return json.dumps({"cfg": job[0], "alpha": job[1]}, sort_keys=True)


def run_job(job: tuple) -> dict:
    """One toy run (cfg dict, α), reduced to the per-step series the tables need."""
    t0 = time.time()
    torch.set_num_threads(1)
    h = list(mipu.toy_steps(mipu.Config(**job[0]), job[1]))
    series = {k: [m[k] for m in h[1:]] for k in ("mismatch/k3", "mismatch/abs_dlogp_mean", "step2/accepted",
                                                  "exact/cand_J_pi", "step2/g_k")}
    return {"key": job_key(job), "J_mu": [m["exact/J_mu"] for m in h], "wall": time.time() - t0, **series}


@dataclasses.dataclass
class Runner:
    """A process pool (or None) and the run cache (a dict mirrored in a jsonl file)."""
    pool: object
    path: Path
    cache: dict

    def run_all(self, jobs: list) -> list[dict]:
        """Results of jobs, running (and caching) the ones not in the cache."""
        todo = list({job_key(j): j for j in jobs if job_key(j) not in self.cache}.values())
        with open(self.path, "a") as f:
            for res in (self.pool.imap_unordered(run_job, todo) if self.pool else map(run_job, todo)):
                f.write(json.dumps(res) + "\n")
                f.flush()
                self.cache[res["key"]] = res
        return [self.cache[job_key(j)] for j in jobs]


def base_cfg(name: str, steps: int, lr: float = 0.0) -> tuple[dict, float]:
    _, over, alpha = CONFIGS[name]
    base = {**dataclasses.asdict(mipu.Config(toy_lr=lr or mipu.Config.toy_lr)), **over, "steps": steps}
    return base, alpha


def worst_drop(J: list) -> float:
    """Largest fall of J(μ) below its running best."""
    J = np.asarray(J)
    return float((np.maximum.accumulate(J) - J).max())


def fmt(x) -> str:           # mean ± sd
    x = np.asarray(x)
    return f"{x.mean():.3f} ± {x.std():.3f}"


def k_collapsed(runs: list[dict]) -> str:
    return f"{sum(demo.collapsed(r['J_mu']) for r in runs)}/{len(runs)}"


def first_mean_end(runs: list[dict], key: str, digits: int) -> str:
    """Mismatch over the first 10 steps / the whole run / the last 10% of steps, mean over seeds."""
    tail = max(5, len(runs[0][key]) // 10)
    parts = [np.mean([np.mean(r[key][:10]) for r in runs]), np.mean([np.mean(r[key]) for r in runs]),
             np.mean([np.mean(r[key][-tail:]) for r in runs])]
    return " / ".join(f"{p:.{digits}f}" for p in parts)


def search_row(name: str, seeds: list, steps: int, runner: Runner, lr: float = 0.0) -> dict:
    """One configuration of the search: grpo and the oracle, at α and at α = 0."""
    base, alpha = base_cfg(name, steps, lr)
    r = {arm: runner.run_all([({**base, **kw, "seed": s}, alpha if at_alpha else 0.0) for s in seeds])
         for arm, (kw, at_alpha) in SEARCH_ARMS.items()}
    g, o = r["grpo"], r["oracle"]
    final = {arm: [x["J_mu"][-1] for x in runs] for arm, runs in r.items()}
    return {
        "config": name, "mechanism": CONFIGS[name][0], "alpha": f"{alpha:g}",
        "k3 (first 10 / mean / end)": first_mean_end(g, "mismatch/k3", 4),
        "mean abs dlogp (first 10 / mean / end)": first_mean_end(g, "mismatch/abs_dlogp_mean", 3),
        "grpo final J(mu)": fmt(final["grpo"]), "grpo best J(mu)": fmt([max(x["J_mu"]) for x in g]),
        "grpo worst drop": fmt([worst_drop(x["J_mu"]) for x in g]),
        "oracle final J(mu)": fmt(final["oracle"]),
        "oracle accept rate": f"{np.mean([np.mean(x['step2/accepted']) for x in o]):.2f}",
        "alpha=0 final J grpo / oracle": f"{np.mean(final['grpo-a0']):.3f} / {np.mean(final['oracle-a0']):.3f}",
        "collapsed grpo / oracle / alpha=0": f"{k_collapsed(g)} / {k_collapsed(o)} / {k_collapsed(r['grpo-a0'])}",
    }


def search_reject_rate(runs: list[dict]) -> float:
    return float(1 - np.mean([np.mean(x["step2/accepted"]) for x in runs]))


def rollback_control(base: dict, alpha: float, rate: float, method: str, seeds: list, runner: Runner) -> str:
    """Random rollback (method random-rollback or random-rollback-tis) at `rate`: final J(μ), collapses."""
    if round(rate, 2) == 0:       # the rate the runs would take: a random method refuses --reject-rate 0
        return "-"
    runs = runner.run_all([({**base, "method": method, "reject_rate": round(min(rate, 0.99), 2), "seed": s}, alpha)
                                  for s in seeds])
    return f"{fmt([x['J_mu'][-1] for x in runs])} ({k_collapsed(runs)})"


def g_k_bias(runs: list[dict]) -> str:
    """Mean error of Ĝ_k against the exact J(π_{k+1}) − J(μ_k), and their correlation."""
    g = np.concatenate([x["step2/g_k"] for x in runs])
    exact = np.concatenate([np.array(x["exact/cand_J_pi"]) - np.array(x["J_mu"][:-1]) for x in runs])
    ok = ~np.isnan(g)
    return f"{(g[ok] - exact[ok]).mean():+.4f} ({np.corrcoef(g[ok], exact[ok])[0, 1]:.2f})" if ok.sum() > 2 else "-"


def rules_rows(name: str, seeds: list, steps: int, runner: Runner, lr: float = 0.0) -> list[dict]:
    """Every rule of SEARCH_RULES in configuration `name`, with random rollback at its rejection rate."""
    base, alpha = base_cfg(name, steps, lr)
    rows = []
    for label, kw in SEARCH_RULES.items():
        runs = runner.run_all([({**base, **kw, "seed": s}, alpha) for s in seeds])
        rate = search_reject_rate(runs)
        tis_update = mipu.METHOD_SPEC[kw["method"]][0] == "tis"
        rows.append({
            "rule": label, "reject rate": f"{rate:.2f}",
            "final J(mu) (collapsed)": f"{fmt([x['J_mu'][-1] for x in runs])} ({k_collapsed(runs)})",
            "random rollback, grpo update, same rate": rollback_control(base, alpha, rate, "random-rollback",
                                                                        seeds, runner),
            "random rollback, tis update, same rate": rollback_control(base, alpha, rate, "random-rollback-tis",
                                                                       seeds, runner) if tis_update else "-",
            "G_k bias vs exact J(pi_k+1)-J(mu_k) (corr)": g_k_bias(runs) if kw.get("accept_rule") == "target" else "-",
        })
    return rows


def search(args) -> None:
    """--search / --search-rules: the tables into args.out (default toy/results/collapse), runs cached there."""
    arg, rules = (args.search_rules, True) if args.search_rules else (args.search, False)
    names = list(CONFIGS) if arg == "all" else arg.split(",")
    if unknown := [n for n in names if n not in CONFIGS]:
        raise mipu.MIPUError(f"unknown configs {unknown} (see --list)")
    out = Path(args.out or HERE / "results" / "collapse")
    out.mkdir(parents=True, exist_ok=True)
    cache_path, cache = out / "runs.jsonl", {}
    if cache_path.exists():
        cache = {r["key"]: r for r in map(json.loads, cache_path.read_text().splitlines())}
    seeds, steps, lr = list(range(args.first_seed, args.first_seed + args.seeds)), args.steps or 300, args.toy_lr
    t0, pool = time.time(), demo.make_pool(args.workers)
    runner = Runner(pool, cache_path, cache)
    if rules:
        rows = [{"config": n, **r} for n in names for r in rules_rows(n, seeds, steps, runner, lr)]
        path = out / f"rules_{'_'.join(names)}.md"
    else:
        rows = [search_row(n, seeds, steps, runner, lr) for n in names]
        path = out / "search.md"
    if pool:
        pool.close()
    table = mipu.markdown_table(rows)
    command = (f"python -m toy.study --search{'-rules' if rules else ''} {arg} --first-seed {args.first_seed} "
               f"--seeds {args.seeds} --steps {steps}" + (f" --toy-lr {lr:g}" if lr else ""))
    path.write_text(f"Generated by `{command}` (seeds {seeds[0]}..{seeds[-1]}, {steps} steps, Adam LR "
                    f"{lr or mipu.Config.toy_lr:g}, defaults otherwise).\n\n{table}\n")
    print(table + f"\n\n{time.time() - t0:.1f} s wall; wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m toy.study", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="collapse", choices=list(STUDY_PRESETS), help="mipu.TOY_PRESETS entry")
    ap.add_argument("--seeds", type=int, help="seeds per arm, >= 2 (default 20; --search: 5)")
    ap.add_argument("--first-seed", type=int, help=f"seeds --first-seed, --first-seed + 1, ... (default {FIRST_SEED}; "
                    "--search: 0)")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (0 = the preset's: "
                    + ", ".join(f"{p} {s}" for p, s in STUDY_PRESETS.items()) + "; --search: 300)")
    ap.add_argument("--toy-lr", type=float, default=0.0, help=f"every arm's Adam LR (0 = each method's "
                    f"own where METHOD_LRS names the preset, else mipu.py's {mipu.Config.toy_lr:g}); the step-size "
                    "controls scale it")
    ap.add_argument("--window", type=int, default=WINDOW, help="steps per window of the within-window AUC")
    ap.add_argument("--workers", type=int, default=MAX_WORKERS, help=f"processes, 1..{MAX_WORKERS} (results do not "
                    "depend on it)")
    ap.add_argument("--out", help="folder for study_<preset>.md (default toy/results; --search: toy/results/collapse)")
    ap.add_argument("--search", help="the collapse search instead, in these configs (comma-separated, or all)")
    ap.add_argument("--search-rules", help="the acceptance rules at equal rates in these collapse configs instead")
    ap.add_argument("--list", action="store_true", help="print the collapse search's configs and exit")
    args = ap.parse_args()
    if args.list:
        for n, (mech, over, a) in CONFIGS.items():
            print(f"{n:12s} {mech}: {over} alpha={a:g}")
        return 0
    return mipu.report_errors(check_and_run, args)


def check_and_run(args) -> None:
    searching = bool(args.search or args.search_rules)
    args.seeds = (5 if searching else 20) if args.seeds is None else args.seeds
    args.first_seed = (0 if searching else FIRST_SEED) if args.first_seed is None else args.first_seed
    if args.seeds < 2 or args.steps < 0 or args.window < 1 or not 1 <= args.workers <= MAX_WORKERS:
        raise mipu.MIPUError(f"--seeds must be >= 2, --steps >= 0, --window >= 1, --workers in 1..{MAX_WORKERS}")
    if searching:
        return search(args)
    extra = {"first-seed": (args.first_seed, FIRST_SEED), "steps": (args.steps, 0), "window": (args.window, WINDOW),
             "toy-lr": (args.toy_lr, 0.0)}
    command = f"python -m toy.study --preset {args.preset} --seeds {args.seeds}" + "".join(
        f" --{flag} {value}" for flag, (value, default) in extra.items() if value != default)
    study(args.preset, args.seeds, args.steps or STUDY_PRESETS[args.preset], args.first_seed, args.window,
          args.workers, Path(args.out or HERE / "results"), command, args.toy_lr)

if __name__ == "__main__":
    sys.exit(main())
