"""Does a real model learn on a CPU? `python -m toy.real_demo` (after `python -m toy.make_real`).

SmolLM2-135M-Instruct under fp8-sim rollouts learns two-digit sums: each method in --methods on each seed in
--seeds, the same steps and LR, on one vLLM engine. Held-out pass@1 of μ (vLLM) on --eval-data before and after,
problem by problem: each problem's after-minus-before pass rate, its mean over problems with a 95% interval
(mean ± 1.96 sd / sqrt(problems)). Answers "does each method improve the model", not which is best (20 seeds).
With --tune, the LR is chosen instead: tis at each of --lrs on --seeds, scored on --val-data (not --eval-data).
Table to <--out>.md, per-problem pass rates to <--out>.jsonl, each run's metrics under --output-dir.
"""
import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

import mipu

HERE = Path(__file__).resolve().parent
# The demo's settings: the README's learning run (24 new tokens: a sum and its stop fit; the suffix asks for a bare
# number, which last-number scores; fp8-sim), at the LR --tune chose (toy/results/real_demo_tune.md)
REAL_DEMO = dict(model=str(HERE / "models" / "smollm2-135m-instruct"), train_data=str(HERE / "data" / "sums_train.jsonl"),
                 val_data=str(HERE / "data" / "sums_val.jsonl"), eval_data=str(HERE / "data" / "sums_test.jsonl"),
                 rollout_quant="fp8-sim", prompts_per_step=8, max_new_tokens=24, steps=20, learning_rate=1e-5,
                 prompt_suffix=" Answer with the number only.", answer_format="last-number")


def pass_rates(run: mipu.TrainEngine, rows: list, seed: int) -> list[float]:
    """Each problem's pass rate over cfg.eval_samples samples of μ (mipu.evaluate's, kept per problem)."""
    cfg = run.cfg
    samples = mipu.generate(run.llm, mipu.prompts_of(run.tokenizer, rows, cfg), cfg.eval_samples,
                            cfg.max_new_tokens, cfg.eval_temperature, seed)
    score = mipu.worker_score(cfg)
    hits = np.zeros(len(rows))
    for s in samples:
        hits[s["prompt_idx"]] += mipu.sample_reward(s, rows[s["prompt_idx"]]["answer"], cfg, score) or 0.0
    return (hits / cfg.eval_samples).tolist()


def paired(before: list, after: list) -> str:
    """The mean per-problem difference after - before, with its 95% interval."""
    d = np.array(after) - np.array(before)
    half = 1.96 * d.std(ddof=1) / math.sqrt(len(d))
    return f"{d.mean():+.3f} [{d.mean() - half:+.3f}, {d.mean() + half:+.3f}]"


def real_demo(args: dict, argv: list) -> None:
    base = dataclasses.replace(mipu.config_from(args), **{k: v for k, v in REAL_DEMO.items() if k in args["defaults"]})
    tune = args["tune"]
    out = Path(args["out"] or HERE / "results" / ("real_demo_tune" if tune else "real_demo"))
    seeds = [int(s) for s in (args["seeds"] or ("0" if tune else "1,2")).split(",")]
    arms = ([("tis", float(lr)) for lr in args["lrs"].split(",")] if tune else
            [(m, base.learning_rate) for m in args["methods"].split(",")])
    scored = mipu.load_prompts(base, mipu.load_pretrained("AutoTokenizer", base.model),
                               base.val_data if tune else base.eval_data)
    llm, eval_seed = mipu.make_sampler(base, **mipu.vllm_args(base)), 12345   # one engine; one eval seed: paired
    rows, per_problem, before, t0 = [], [], None, time.time()
    for seed in seeds:
        for method, lr in arms:
            cfg = dataclasses.replace(base, method=method, learning_rate=lr, seed=seed,
                                      output_dir=f"{base.output_dir}/{method}-lr{lr:g}-s{seed}")
            run = mipu.setup_llm_run(cfg, llm=llm)                 # θ_0 from the model folder, synced to μ
            gap0 = ref = run.probe_ref                              # the probe's start-up gap, its bound's reference
            margin = math.inf                                       # the least bound / gap over the run's probes
            if before is None:
                before = pass_rates(run, scored, eval_seed)
                per_problem.append({"run": "before", "pass": before})
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            ms, t = [], time.time()
            while run.step < cfg.steps:
                ms.append(mipu.mipu_step(run))
                if math.isfinite(gap := ms[-1]["sync/probe_mean_abs_dlogp"]):   # TrainEngine.sync's bound, replayed
                    margin = min(margin, cfg.sync_tol * max(ref, mipu.SYNC_GAP_FLOOR) / gap)
                    ref = min(max(ref, gap), mipu.PROBE_GAP0_MAX)
                mipu.log_metrics(Path(cfg.output_dir) / "metrics.jsonl", ms[-1])
            after = pass_rates(run, scored, eval_seed)
            per_problem.append({"run": f"{method} lr {lr:g} seed {seed}", "pass": after})
            rows.append({"method": method, "LR": f"{lr:g}", "seed": seed, "pass@1 before": f"{np.mean(before):.3f}",
                         "pass@1 after": f"{np.mean(after):.3f}", "after - before [95% CI]": paired(before, after),
                         "reward, first 5 / last 5 steps": f"{np.mean([m['rollout/reward'] for m in ms[:5]]):.3f} / "
                                                           f"{np.mean([m['rollout/reward'] for m in ms[-5:]]):.3f}",
                         "accepted": f"{np.mean([m['step2/accepted'] for m in ms]):.2f}",
                         "mean k3": f"{np.mean([m['mismatch/k3'] for m in ms]):.4f}",
                         "sync probe: start-up gap, least bound/gap": f"{gap0:.3f}, {margin:.2f}",
                         "wall (s)": f"{time.time() - t:.0f}"})
            print(mipu.markdown_table(rows[-1:]), flush=True)
    which = base.val_data if tune else base.eval_data
    md = (f"Generated by `python -m toy.real_demo {' '.join(argv)}` ({Path(base.model).name}, fp8-sim "
          f"rollouts, batch {base.prompts_per_step}x{base.num_generations}, {base.steps} steps, pass@1 of μ on "
          f"{Path(which).name}: {len(scored)} problems x {base.eval_samples} samples at temperature "
          f"{base.eval_temperature}, sampled with seed {eval_seed} before and after; interval: mean ± 1.96 sd/sqrt(n) "
          f"of the per-problem differences). Wall {time.time() - t0:.0f} s.\n\n{mipu.markdown_table(rows)}\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in per_problem))
    print(md)


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toy.real_demo", description=__doc__.split("\n")[0])
    mipu.add_config_flags(parser, mipu.SUBCOMMANDS["train"][0])
    parser.set_defaults(output_dir="runs/real_demo")
    parser.add_argument("--methods", default="grpo,tis,mipu", help="the methods compared (comma-separated)")
    parser.add_argument("--seeds", help="seeds, comma-separated (default 1,2; with --tune 0)")
    parser.add_argument("--tune", action="store_true", help="choose the LR: tis at each of --lrs, on --val-data")
    parser.add_argument("--lrs", default="1e-5,2e-5,4e-5", help="--tune's learning rates")
    parser.add_argument("--out", help="<out>.md and <out>.jsonl (default toy/results/real_demo, with --tune "
                        "real_demo_tune)")
    argv = sys.argv[1:] if argv is None else argv
    args = vars(parser.parse_args(argv))
    given = {a.split("=")[0][2:].replace("-", "_") for a in argv if a.startswith("--")}
    args["defaults"] = set(REAL_DEMO) - given           # REAL_DEMO fills in only the flags not given
    return mipu.report_errors(real_demo, args, argv)


if __name__ == "__main__":
    sys.exit(main())
