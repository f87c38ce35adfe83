"""The toy's collapse study: `python -m toy.collapse_study` (from the repo root; ~10 min on 2 cores).

Part 1, the search (default): per configuration (mechanism + mismatch α) and seed it runs grpo at α,
the oracle acceptance on the grpo update (method step2, --accept-rule oracle: keep a candidate iff the
exact J(μ_{k+1}) ≥ J(μ_k)) at α, and both again at α = 0 (same task, no mismatch: is the oracle just a
better optimizer?). A run collapses when J(μ) over its last 10% of steps (at least 5) stays below half
of the run's best J(μ); a configuration collapses when ≥ 3 of 5 grpo seeds do and α = 0 does not.
Mismatch (k3, mean |Δlog p|) is measured on grpo's own rollouts. -> toy/results/collapse/search.md

Part 2, `--rules static-h1`: every acceptance rule of RULES in that configuration, each next to random
rollback at the same rejection rate, on the grpo update (the paper's control) and on the rule's own
update (random-rollback-tis for rules on mipu's TIS update). -> toy/results/collapse/rules_<config>.md

    python -m toy.collapse_study --list
    python -m toy.collapse_study --seeds 5 --steps 300
    python -m toy.collapse_study --rules static-h1 --seeds 5 --steps 300

Runs are cached in toy/results/collapse/runs.jsonl (not in git; key = the full Config and α), so a rerun only
runs what is missing. Every run is bit-for-bit reproducible for its seed.
"""
import argparse
import dataclasses
import json
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np
import torch

import mipu

OUT = Path(__file__).resolve().parent / "results" / "collapse"

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
ARMS = {"grpo": ({"method": "grpo"}, True), "oracle": ({"method": "step2", "accept_rule": "oracle"}, True),
        "grpo-a0": ({"method": "grpo"}, False), "oracle-a0": ({"method": "step2", "accept_rule": "oracle"}, False)}
# Acceptance rules compared in a collapse configuration (--rules): label -> Config overrides.
RULES = {
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
    h = mipu.toy_run(mipu.Config(**job[0]).validate(), job[1])
    series = {k: [m[k] for m in h[1:]] for k in ("mismatch/k3", "mismatch/abs_dlogp_mean", "step2/accepted",
                                                  "exact/cand_J_pi", "step2/g_k")}
    return {"key": job_key(job), "J_mu": [m["exact/J_mu"] for m in h], "wall": time.time() - t0, **series}


@dataclasses.dataclass
class Runner:
    """A process pool and the run cache (a dict mirrored in a jsonl file)."""
    pool: object
    path: Path
    cache: dict

    def run_all(self, jobs: list) -> list[dict]:
        """Results of jobs, running (and caching) the ones not in the cache."""
        todo = list({job_key(j): j for j in jobs if job_key(j) not in self.cache}.values())
        with open(self.path, "a") as f:
            for res in self.pool.imap_unordered(run_job, todo):
                f.write(json.dumps(res) + "\n")
                f.flush()
                self.cache[res["key"]] = res
        return [self.cache[job_key(j)] for j in jobs]


def base_cfg(name: str, steps: int, lr: float = 0.0) -> tuple[dict, float]:
    _, over, alpha = CONFIGS[name]
    base = {**dataclasses.asdict(mipu.Config(toy_lr=lr or mipu.Config.toy_lr)), **over, "steps": steps}
    return base, alpha


def collapsed(J: list) -> bool:
    """J(μ) over the last 10% of the run (at least 5 points) stays below half of its best."""
    J = np.asarray(J)
    return bool((J[-max(5, len(J) // 10):] < 0.5 * J.max()).all())


def worst_drop(J: list) -> float:
    """Largest fall of J(μ) below its running best."""
    J = np.asarray(J)
    return float((np.maximum.accumulate(J) - J).max())


def fmt(x) -> str:
    x = np.asarray(x)
    return f"{x.mean():.3f} ± {x.std():.3f}"


def n_collapsed(runs: list[dict]) -> str:
    return f"{sum(collapsed(r['J_mu']) for r in runs)}/{len(runs)}"


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
         for arm, (kw, at_alpha) in ARMS.items()}
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
        "collapsed grpo / oracle / alpha=0": f"{n_collapsed(g)} / {n_collapsed(o)} / {n_collapsed(r['grpo-a0'])}",
    }


def reject_rate(runs: list[dict]) -> float:
    return float(1 - np.mean([np.mean(x["step2/accepted"]) for x in runs]))


def rollback_control(base: dict, alpha: float, rate: float, method: str, seeds: list, runner: Runner) -> str:
    """Random rollback (method random-rollback or random-rollback-tis) at `rate`: final J(μ), collapses."""
    if round(rate, 2) == 0:       # the rate the runs would take: a random method refuses --reject-rate 0
        return "-"
    runs = runner.run_all([({**base, "method": method, "reject_rate": round(min(rate, 0.99), 2), "seed": s}, alpha)
                                  for s in seeds])
    return f"{fmt([x['J_mu'][-1] for x in runs])} ({n_collapsed(runs)})"


def g_k_bias(runs: list[dict]) -> str:
    """Mean error of Ĝ_k against the exact J(π_{k+1}) − J(μ_k), and their correlation."""
    g = np.concatenate([x["step2/g_k"] for x in runs])
    exact = np.concatenate([np.array(x["exact/cand_J_pi"]) - np.array(x["J_mu"][:-1]) for x in runs])
    ok = ~np.isnan(g)
    return f"{(g[ok] - exact[ok]).mean():+.4f} ({np.corrcoef(g[ok], exact[ok])[0, 1]:.2f})" if ok.sum() > 2 else "-"


def rules_rows(name: str, seeds: list, steps: int, runner: Runner, lr: float = 0.0) -> list[dict]:
    """Every rule of RULES in configuration `name`, with random rollback at its rejection rate."""
    base, alpha = base_cfg(name, steps, lr)
    rows = []
    for label, kw in RULES.items():
        runs = runner.run_all([({**base, **kw, "seed": s}, alpha) for s in seeds])
        rate = reject_rate(runs)
        tis_update = mipu.METHOD_SPEC[kw["method"]][0] == "tis"
        rows.append({
            "rule": label, "reject rate": f"{rate:.2f}",
            "final J(mu) (collapsed)": f"{fmt([x['J_mu'][-1] for x in runs])} ({n_collapsed(runs)})",
            "random rollback, grpo update, same rate": rollback_control(base, alpha, rate, "random-rollback",
                                                                        seeds, runner),
            "random rollback, tis update, same rate": rollback_control(base, alpha, rate, "random-rollback-tis",
                                                                       seeds, runner) if tis_update else "-",
            "G_k bias vs exact J(pi_k+1)-J(mu_k) (corr)": g_k_bias(runs) if kw.get("accept_rule") == "target" else "-",
        })
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m toy.collapse_study", description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names (see --list)")
    ap.add_argument("--rules", default="", help="compare the acceptance rules in these configs instead")
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1")
    ap.add_argument("--steps", type=int, default=300, help="steps per run")
    ap.add_argument("--toy-lr", type=float, default=0.0, help="Adam LR of the toy (0 = mipu.py's default; the "
                    "committed tables ran at 0.02)")
    ap.add_argument("--workers", type=int, default=2, help="processes (results do not depend on it)")
    ap.add_argument("--out", default=str(OUT), help="folder for the tables and the run cache runs.jsonl")
    ap.add_argument("--list", action="store_true", help="print the configurations and exit")
    args = ap.parse_args()
    if args.list:
        for n, (mech, over, a) in CONFIGS.items():
            print(f"{n:12s} {mech}: {over} alpha={a:g}")
        return 0
    return mipu.report_errors(study, args)


def study(args) -> None:
    names = (args.rules or args.configs).split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise mipu.MIPUError(f"unknown configs {unknown} (see --list)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache_path, cache = out / "runs.jsonl", {}
    if cache_path.exists():
        cache = {r["key"]: r for r in map(json.loads, cache_path.read_text().splitlines())}
    seeds, t0 = list(range(args.seeds)), time.time()
    torch.set_num_threads(1)
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        runner = Runner(pool, cache_path, cache)
        if args.rules:
            rows = [{"config": n, **r} for n in names for r in rules_rows(n, seeds, args.steps, runner, args.toy_lr)]
            path, cmd = out / f"rules_{'_'.join(names)}.md", f"--rules {args.rules} "
        else:
            rows = [search_row(n, seeds, args.steps, runner, args.toy_lr) for n in names]
            path, cmd = out / "search.md", ""
    table = mipu.markdown_table(rows)
    lr = f" --toy-lr {args.toy_lr:g}" if args.toy_lr else ""
    path.write_text(f"Generated by `python -m toy.collapse_study {cmd}--seeds {args.seeds} --steps {args.steps}{lr}` "
                    f"(seeds 0..{args.seeds - 1}, {args.steps} steps, Adam LR {args.toy_lr or mipu.Config.toy_lr:g}, "
                    f"defaults otherwise).\n\n{table}\n")
    print(table + f"\n\n{time.time() - t0:.1f} s wall; wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
