"""Search for a toy preset in the paper's regime (issue 41): `python -m toy.paper_search` (from the repo root).

Each configuration (mechanism + size, on top of mipu.TOY_PRESETS' `collapse`) runs tis, grpo, mipu and step2 on
--seeds seeds from --first-seed, and grpo at alpha = 0 (mu = pi; one run per seed, shared: it does not depend on
the mismatch flags). Per configuration it measures the issue's bands ("first"/"last": the first/last tenth of the
steps; a tenth of a run's k3 is its mean over those steps, then the mean over seeds):
  k3      per-token k3 of tis's rollouts, first tenth in [0.003, 0.03], last/first in [2, 5]
  gap     the exact J(mu_k) - J(pi_k) along tis's run: the run means' 95 % t-interval over seeds contains 0
  grpo    collapsed (toy.collapse_study.collapsed) in >= half of the seeds, grpo at alpha = 0 in none
  mipu    rejection rate over the first tenth in [0.3, 0.7], over the last lower (step2's reported beside it)
Runs are cached in --cache (default /tmp/toy_paper_runs.jsonl; key = the full Config and alpha).
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import mipu
from toy import demo
from toy.collapse_study import collapsed

OUT = Path(__file__).resolve().parent / "results"
# name -> Config overrides on the collapse preset (alpha 1, FP8 weights, static FP8 logits at headroom 1).
# scale: toy_scale_bias b, toy_scale_jitter tau (engine logits x exp(b + tau xi)); h: toy_fp8_headroom
CONFIGS = {f"h{h:g}-b{b:g}-t{t:g}": {"toy_fp8_headroom": h, "toy_scale_bias": b, "toy_scale_jitter": t}
           for h, b, t in ((1.0, 0, 0), (1.0, 0.1, 0.1), (1.1, 0, 0), (1.25, 0, 0.1), (1.1, 0.1, 0.1),
                           (1.0, 0.2, 0.1), (1.25, 0.05, 0.1), (1.25, 0.1, 0.1), (1.25, 0.2, 0.1))}
# no FP8 logits: the FP8 weights and the engine scale alone
CONFIGS.update({f"off-b{b:g}-t{t:g}": {"toy_logit_fp8": "off", "toy_scale_bias": b, "toy_scale_jitter": t}
                for b, t in ((0, 0.2), (0.1, 0.1), (0, 0.1))})
# FP8 weights' error x alpha (no FP8 logits), with and without the jitter
CONFIGS.update({f"a{a:g}-t{t:g}": {"toy_logit_fp8": "off", "toy_mismatch": a, "toy_scale_jitter": t}
                for a, t in ((3, 0), (3, 0.05), (4, 0.05))})
ARMS = {"tis": {"method": "tis"}, "grpo": {"method": "grpo"}, "mipu": {"method": "mipu"},
        "step2": {"method": "step2"}}
T95 = {5: 2.776, 6: 2.571, 8: 2.365, 10: 2.262, 20: 2.093}   # t quantile at n - 1 df


def base_cfg(steps: int, lr: float) -> dict:
    return {**demo.preset_base(mipu.Config(toy_lr=lr), "collapse"), "steps": steps}


def study_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The flags paper_study and paper_curves share: one config of CONFIGS on the study seeds."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    ap.add_argument("--config", required=True, choices=list(CONFIGS))
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=6200)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--toy-lr", type=float, default=0.005)
    return ap


def study_cfg(a: argparse.Namespace) -> dict:
    return {**base_cfg(a.steps, a.toy_lr), **CONFIGS[a.config]}


def run_job(job: tuple) -> dict:
    """One run (cfg dict, alpha) reduced to its per-step series."""
    cfg, alpha = job
    h = mipu.toy_run(mipu.Config(**cfg).validate(), alpha)
    return {"key": key(job), "J_mu": [m["exact/J_mu"] for m in h], "J_pi": [m["exact/J_pi"] for m in h],
            **{k: [m[k] for m in h[1:]] for k in ("mismatch/k3", "step2/accepted", "step2/t_post")}}


def key(job: tuple) -> str:
    return json.dumps({"cfg": job[0], "alpha": job[1]}, sort_keys=True)


def runs(jobs: list, cache: Path) -> list[dict]:
    have = {}
    if cache.exists():
        for line in cache.read_text().splitlines():
            r = json.loads(line)
            have[r["key"]] = r
    out = []
    for j in jobs:
        if key(j) not in have:
            have[key(j)] = r = run_job(j)
            with cache.open("a") as f:
                f.write(json.dumps(r) + "\n")
        out.append(have[key(j)])
    return out


def tenth(x, last: bool) -> float:
    x = np.asarray(x, float)
    n = max(len(x) // 10, 1)
    return float(x[-n:].mean() if last else x[:n].mean())


def bands(res: dict, a0: list) -> dict:
    """The issue's bands from one configuration's runs (arm -> runs over seeds) and the alpha = 0 grpo runs."""
    k3f = np.mean([tenth(r["mismatch/k3"], False) for r in res["tis"]])
    k3l = np.mean([tenth(r["mismatch/k3"], True) for r in res["tis"]])
    gap = np.array([np.mean(np.subtract(r["J_mu"], r["J_pi"])[1:]) for r in res["tis"]])
    n = len(gap)
    half = T95.get(n, 1.96) * gap.std(ddof=1) / np.sqrt(n)
    gf = np.mean([tenth(np.subtract(r["J_mu"], r["J_pi"])[1:], False) for r in res["tis"]])
    gl = np.mean([tenth(np.subtract(r["J_mu"], r["J_pi"])[1:], True) for r in res["tis"]])
    coll = sum(collapsed(r["J_mu"]) for r in res["grpo"])
    coll0 = sum(collapsed(r["J_mu"]) for r in a0)
    rej = {m: [np.mean([1 - tenth(r["step2/accepted"], last) for r in res[m]]) for last in (False, True)]
           for m in ("mipu", "step2") if m in res}
    b = {"k3 tis first": f"{k3f:.4f}", "k3 last/first": f"{k3l / k3f:.2f}",
         "gap tis: run mean [95% CI]": f"{gap.mean():+.4f} [{gap.mean() - half:+.4f}, {gap.mean() + half:+.4f}]",
         "gap first / last": f"{gf:+.4f} / {gl:+.4f}",
         "grpo collapsed / alpha=0": f"{coll}/{n} / {coll0}/{len(a0)}",
         "final J(mu) tis / grpo": f"{np.mean([r['J_mu'][-1] for r in res['tis']]):.3f} / "
                                   f"{np.mean([r['J_mu'][-1] for r in res['grpo']]):.3f}"}
    ok = {"k3": 0.003 <= k3f <= 0.03 and 2 <= k3l / k3f <= 5, "gap": abs(gap.mean()) <= half,
          "grpo": coll >= n / 2 and coll0 == 0}
    for m, (f, l) in rej.items():
        b[f"{m} reject first / last"] = f"{f:.2f} / {l:.2f}"
    if "mipu" in rej:
        ok["mipu"] = 0.3 <= rej["mipu"][0] <= 0.7 and rej["mipu"][1] < rej["mipu"][0]
    b["bands met"] = ", ".join(k for k, v in ok.items() if v) or "none"
    b["bands broken"] = ", ".join(k for k, v in ok.items() if not v) or "none"
    return b


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m toy.paper_search", description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="all", help="comma-separated CONFIGS names, or all")
    ap.add_argument("--arms", default="tis,grpo", help="comma-separated of " + ",".join(ARMS))
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--first-seed", type=int, default=6000)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--toy-lr", type=float, default=0.005)
    ap.add_argument("--out", default=str(OUT / "paper_search.md"))
    ap.add_argument("--cache", default="/tmp/toy_paper_runs.jsonl", help="run cache (jsonl)")
    a = ap.parse_args()
    t0, load0 = time.time(), os.getloadavg()[0]
    names = list(CONFIGS) if a.configs == "all" else a.configs.split(",")
    base, seeds = base_cfg(a.steps, a.toy_lr), range(a.first_seed, a.first_seed + a.seeds)
    OUT.mkdir(exist_ok=True)
    cache = Path(a.cache)
    a0 = runs([({**base, "method": "grpo", "seed": s}, 0.0) for s in seeds], cache)
    rows, loads = [], [load0]
    for name in names:
        alpha = {**base, **CONFIGS[name]}["toy_mismatch"]
        res = {arm: runs([({**base, **CONFIGS[name], **ARMS[arm], "seed": s}, alpha) for s in seeds], cache)
               for arm in a.arms.split(",")}
        rows.append({"config": name, **bands(res, a0)})
        loads.append(os.getloadavg()[0])
        print(rows[-1], f"{time.time() - t0:.0f} s", flush=True)
    cmd = "python -m toy.paper_search " + " ".join(sys.argv[1:])
    text = (f"Generated by `{cmd}`: seeds {seeds[0]}..{seeds[-1]}, {a.steps} steps, Adam LR {a.toy_lr:g}, on the "
            f"collapse preset with each row's overrides (CONFIGS in toy/paper_search.py). Wall {time.time() - t0:.0f} "
            f"s (runs cached from earlier calls not counted), 1-min load {min(loads):.1f}-{max(loads):.1f} on "
            f"{os.cpu_count()} cores.\n\n{mipu.markdown_table(rows)}\n")
    Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
