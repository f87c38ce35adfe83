"""Does a real model learn on a CPU? `python -m toy.real_demo` (after `python -m toy.make_real`).

SmolLM2-135M-Instruct under fp8-sim rollouts learns two-digit sums: each method in --methods on each seed in
--seeds, the same steps and LR, on one vLLM engine. Held-out pass@1 of μ (vLLM) on --eval-data before and after,
problem by problem: each problem's after-minus-before pass rate, its mean over problems with a 95% interval
(mean ± 1.96 sd / sqrt(problems)). Answers "does each method improve the model", not which is best (20 seeds).
With --tune, the LR is chosen instead: tis at each of --lrs on --seeds, scored on --val-data (not --eval-data).
Table to <--out>.md (with the first method's lead over each other, paired per problem, seed by seed), per-problem
pass rates to <--out>.jsonl, each run's metrics under --output-dir.
With --gap, the inference gap of one engine pair at θ = --model instead: Step 2's T̂_post over --gap-batches
batches at θ and after one Step-1 update of --method (tis); at θ pass@1 of μ (vLLM) and of π (the trainer's own
samples), paired per problem. A row appended to <--out>.md (default toy/results/real_gap), the per-problem pass rates
and per-batch T̂_post to <--out>.jsonl.
With --tiny, the tiny random Qwen3 (toy.make_tiny's, built at --model if missing) on the arithmetic problems instead
(TINY_DEMO); --sft-steps N warm-starts --model by N supervised steps first (into --sft-out), so that RL has something
to sharpen: `python -m toy.real_demo --tiny --sft-steps 300 --methods grpo,mipu --seeds 0` (~7 min on 2 cores).
"""
import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

import mipu
from toy.make_tiny import build_tiny_model

HERE = Path(__file__).resolve().parent
# The demo's settings: the README's learning run (24 new tokens: a sum and its stop fit; the suffix asks for a bare
# number, which last-number scores; fp8-sim), at the LR --tune chose (toy/results/real_demo_tune.md)
REAL_DEMO = dict(model=str(HERE / "models" / "smollm2-135m-instruct"), train_data=str(HERE / "data" / "sums_train.jsonl"),
                 val_data=str(HERE / "data" / "sums_val.jsonl"), eval_data=str(HERE / "data" / "sums_test.jsonl"),
                 rollout_quant="fp8-sim", prompts_per_step=8, max_new_tokens=24, steps=20, learning_rate=1e-5,
                 prompt_suffix=" Answer with the number only.", answer_format="last-number")
# --tiny: the tiny model's settings (1-2 digit answers, a bare number; fp8-sim), 50 steps at the LR of its old demo
TINY_DEMO = dict(model=str(HERE / "models" / "tiny-qwen3"), train_data=str(HERE / "data" / "arith_train.jsonl"),
                 val_data=str(HERE / "data" / "arith_val.jsonl"), eval_data=str(HERE / "data" / "arith_test.jsonl"),
                 rollout_quant="fp8-sim", prompts_per_step=32, mini_batch_size=256, micro_batch_size=64,
                 max_new_tokens=6, eval_temperature=1.0, steps=50, learning_rate=2e-4, answer_format="last-number")
SFT_LR, SFT_BATCH = 1e-3, 64         # --sft-steps: AdamW's LR and problems per step (the tiny model from random init)


def demo_config(args: dict, **more) -> mipu.Config:
    """The flags given, REAL_DEMO's (--tiny: TINY_DEMO's) for those not; --tiny builds the tiny model where missing,
    --sft-steps warm-starts the model and returns the config of the warm-started one."""
    cfg = mipu.config_from(args)
    demo = {**(TINY_DEMO if args["tiny"] else REAL_DEMO), **more}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in demo.items() if k in args["defaults"]})
    if args["tiny"] and not (Path(cfg.model) / "config.json").exists():
        build_tiny_model(cfg.model, seed=0)
    mipu.check_flags(cfg, "train")                              # the flags' errors, before any engine
    if args["sft_steps"]:
        out = args["sft_out"] or f"{cfg.model}-sft"
        cfg = dataclasses.replace(cfg, model=sft_warm_start(cfg, args["sft_steps"], out))
    return cfg


def sft_warm_start(cfg: mipu.Config, steps: int, out: str) -> str:
    """Supervised warm start: cross-entropy on prompt -> answer + EOS, so the model solves some problems before RL.
    Saves to `out` and returns it."""
    rows = mipu.load_rows(cfg.train_data, cfg.prompt_key, cfg.answer_key)
    model = mipu.load_trainer(cfg.model, dataclasses.replace(cfg, train_dtype="float32", grad_checkpointing="off"))
    tokenizer = mipu.load_pretrained("AutoTokenizer", cfg.model)
    prompts = mipu.prompts_of(tokenizer, rows, cfg)             # the prompts RL will sample from
    answers = [tokenizer.encode(r["answer"], add_special_tokens=False) + [tokenizer.eos_token_id] for r in rows]
    opt, gen = torch.optim.AdamW(model.parameters(), lr=SFT_LR), torch.Generator().manual_seed(cfg.seed)
    for it in range(steps):
        idx = torch.randint(len(rows), (SFT_BATCH,), generator=gen).tolist()
        logp, mask = mipu.token_logprobs(model, [prompts[i] for i in idx], [answers[i] for i in idx], 1.0,
                                         SFT_BATCH, cfg.logprob_chunk)
        loss = -mipu.masked_mean(logp, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if it % 200 == 0 or it == steps - 1:
            print(f"sft step {it:>5} loss {loss.item():.4f}", flush=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def pass_rates(run: mipu.TrainEngine, rows: list, seed: int) -> list[float]:
    """Each problem's pass rate over cfg.eval_samples samples of μ (mipu.evaluate's, kept per problem)."""
    cfg = run.cfg
    samples = mipu.generate(run.llm, mipu.prompts_of(run.tokenizer, rows, cfg), cfg.eval_samples,
                            cfg.max_new_tokens, cfg.eval_temperature, seed)
    hits = np.zeros(len(rows))
    for s in samples:
        hits[s["prompt_idx"]] += mipu.sample_reward(s, rows[s["prompt_idx"]]["answer"], cfg, run.score) or 0.0
    return (hits / cfg.eval_samples).tolist()


def paired(before: list, after: list) -> str:
    """The mean per-problem difference after - before, with its 95% interval."""
    d = np.array(after) - np.array(before)
    half = 1.96 * d.std(ddof=1) / math.sqrt(len(d))
    return f"{d.mean():+.3f} [{d.mean() - half:+.3f}, {d.mean() + half:+.3f}]"


GEN_BATCH = 256      # trainer samples a generate call: 1024 of a 135M model's 24 tokens in 4 calls


def trainer_pass_rates(run: mipu.TrainEngine, rows: list, seed: int) -> list[float]:
    """pass_rates of π: the trainer's own samples (HF generate in its precision, plain temperature sampling: no top-k
    or top-p, as vLLM's), the same prompts, tokens and scoring; prompts left-padded, GEN_BATCH at a time."""
    import transformers
    cfg, tok, model = run.cfg, run.tokenizer, run.model
    eos = model.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    gen = transformers.GenerationConfig(do_sample=True, temperature=cfg.eval_temperature, top_k=0, top_p=1.0,
                                        max_new_tokens=cfg.max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    stops = set(eos if isinstance(eos, list) else [eos])
    prompts, score = mipu.prompts_of(tok, rows, cfg), run.score
    jobs, hits = [i for i in range(len(rows)) for _ in range(cfg.eval_samples)], np.zeros(len(rows))
    torch.manual_seed(seed)
    for at in range(0, len(jobs), GEN_BATCH):
        idx = jobs[at:at + GEN_BATCH]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in idx])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx])
        with torch.no_grad(), mipu.train_autocast(cfg):
            out = model.generate(input_ids=ids.to(cfg.device), attention_mask=mask.to(cfg.device),
                                 generation_config=gen)
        for i, seq in zip(idx, out[:, width:].tolist()):
            end = next((t for t, x in enumerate(seq) if x in stops), None)       # vLLM's text stops before the EOS
            sample = {"text": tok.decode(seq[:end], skip_special_tokens=True), "truncated": end is None}
            hits[i] += mipu.sample_reward(sample, rows[i]["answer"], cfg, score) or 0.0
    return (hits / cfg.eval_samples).tolist()


def t_post_batches(run: mipu.TrainEngine, seeds: list) -> tuple[list, list]:
    """Step 2's T̂_post and the mismatch k3 of a batch of μ per seed: the default Step-2 batch (--val-prompts x G),
    the validation prompts in turn from the first (the same prompts at each θ)."""
    t_post, k3, run.val_pos = [], [], 0
    for seed in seeds:
        ro = run.sample(run.next_val_rows(run.cfg.val_prompts), seed)
        logp = run.logp(ro)
        t_post.append(mipu.gap_proxy(logp, ro.logp_sampler, ro.adv, ro.mask).item())
        k3.append(mipu.mismatch_metrics(logp, ro.logp_sampler, ro.mask)["k3"])
    return t_post, k3


def mean_se(x: list) -> str:
    return f"{np.mean(x):+.2e} ± {np.std(x, ddof=1) / math.sqrt(len(x)):.1e}"


def gap_row(args: dict, argv: list) -> None:
    """--gap: one row of toy/results/real_gap.md for this engine pair and θ (see the docstring)."""
    cfg, batches, t0 = demo_config(args, method="tis"), args["gap_batches"], time.time()
    if batches < 2 or not cfg.val_data:
        raise mipu.MIPUError("--gap needs --gap-batches >= 2 (T_post's standard error) and --val-data")
    out = Path(args["out"] or HERE / "results" / "real_gap")
    command = "python -m toy.real_demo " + " ".join(argv)
    run = mipu.setup_llm_run(cfg, llm=mipu.make_sampler(cfg, **mipu.vllm_args(cfg)))    # θ synced to μ
    problems = mipu.load_prompts(cfg, run.tokenizer, cfg.eval_data)[:args["problems"] or None]
    seeds = [run.rollout_seed(-1 - j) for j in range(2 * batches)]  # blocks below step 0's: fresh, none a step's
    out.parent.mkdir(parents=True, exist_ok=True)

    def kept(measured: str, values: list) -> list:                  # one jsonl line per measured set, as it goes
        keep(out, {"command": command, "set": measured, "values": values})
        return values

    mu = kept("pass mu", pass_rates(run, problems, 12345))
    pi = kept("pass pi", trainer_pass_rates(run, problems, 12345))
    t_post, k3 = t_post_batches(run, seeds[:batches])
    kept("t_post theta", t_post)
    kept("k3 theta", k3)
    step = mipu.mipu_step(run)                                       # one candidate update from θ, synced
    after = kept("t_post after update", t_post_batches(run, seeds[batches:])[0])
    row = {"rollout, trainer": f"{cfg.rollout_quant}, {cfg.train_dtype}", "θ": "/".join(Path(cfg.model).parts[-2:]),
           "T_post at θ ± SE": mean_se(t_post), "after 1 update ± SE": mean_se(after),
           "update: method, LR, grad norm": f"{cfg.method}, {cfg.learning_rate:g}, {step['step1/grad_norm']:.3g}",
           "batches": batches, "pass@1 μ": f"{np.mean(mu):.3f}", "pass@1 π": f"{np.mean(pi):.3f}",
           "μ − π [95% CI]": paired(pi, mu), "problems x samples": f"{len(problems)} x {cfg.eval_samples}",
           "k3 mean": f"{np.mean(k3):.2e}", "wall (s)": f"{time.time() - t0:.0f}", "command": f"`{command}`"}
    table = mipu.markdown_table([row]).splitlines()
    md = out.with_suffix(".md")
    if not md.exists():
        md.write_text(f"The inference gap at θ, by engine pair (`python -m toy.real_demo --gap`): Step 2's T̂_post "
                      f"(mean ± SE over Step-2 batches of --val-prompts x G), and after one candidate update; pass@1 "
                      f"of μ (vLLM) and π (the trainer's own samples, HF generate), paired per problem.\n\n"
                      + "\n".join(table[:2]) + "\n")
    with open(md, "a") as f:
        f.write(table[2] + "\n")
    print("\n".join(table), flush=True)


def real_demo(args: dict, argv: list) -> None:
    base, tune = demo_config(args), args["tune"]
    out = Path(args["out"] or HERE / "results" / ("real_demo_tune" if tune else "real_demo_tiny" if args["tiny"] else
                                                  "real_demo"))
    seeds = [int(s) for s in (args["seeds"] or ("0" if tune else "1,2")).split(",")]
    arms = ([("tis", float(lr)) for lr in args["lrs"].split(",")] if tune else
            [(m, base.learning_rate) for m in args["methods"].split(",")])
    scored = mipu.load_prompts(base, mipu.load_pretrained("AutoTokenizer", base.model),
                               base.val_data if tune else base.eval_data)
    llm, eval_seed = mipu.make_sampler(base, **mipu.vllm_args(base)), 12345   # one engine; one eval seed: paired
    rows, before, afters, t0 = [], None, {}, time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".jsonl").write_text("")
    for seed in seeds:
        rejected = base.reject_rate             # random-rollback(-tis): mipu's measured rate on this seed, if it ran
        for method, lr in arms:
            step2 = mipu.METHOD_SPEC[method][1]
            cfg = dataclasses.replace(base, method=method, learning_rate=lr, seed=seed,
                                      reject_rate=rejected if step2 == "random" else 0.0,
                                      accept_rule=base.accept_rule if step2 == "gap" else "paper",
                                      c_se=base.c_se if step2 == "gap" else 0.0,
                                      output_dir=f"{base.output_dir}/{method}-lr{lr:g}-s{seed}")
            run = mipu.setup_llm_run(cfg, llm=llm)                 # θ_0 from the model folder, synced to μ
            lp = run.probe_ref[2]                                  # the probe's start-up gap: mean |vLLM - trainer|
            gap0 = (lp[0] - lp[1]).abs().mean().item()
            if before is None:
                before = pass_rates(run, scored, eval_seed)
                keep(out, {"run": "before", "pass": before})
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            ms, t = [], time.time()
            while run.step < cfg.steps:
                ms.append(mipu.mipu_step(run))
                mipu.log_metrics(Path(cfg.output_dir) / "metrics.jsonl", ms[-1])
            after = pass_rates(run, scored, eval_seed)
            keep(out, {"run": f"{method} lr {lr:g} seed {seed}", "pass": after})
            afters[method, lr, seed] = after
            least_share = np.nanmin([m.get("sync/probe_share", np.nan) for m in ms] + [np.inf])   # steps that probed
            if step2 == "gap":          # within (0, 1), as --reject-rate must be
                rejected = float(np.clip(1 - np.mean([m["step2/accepted"] for m in ms]), 0.01, 0.99))
            rows.append({"method": method, "LR": f"{lr:g}", "seed": seed, "pass@1 before": f"{np.mean(before):.3f}",
                         "pass@1 after": f"{np.mean(after):.3f}", "after - before [95% CI]": paired(before, after),
                         "reward, first 5 / last 5 steps": f"{np.mean([m['rollout/reward'] for m in ms[:5]]):.3f} / "
                                                           f"{np.mean([m['rollout/reward'] for m in ms[-5:]]):.3f}",
                         "accepted": f"{np.mean([m['step2/accepted'] for m in ms]):.2f}",
                         "mean k3": f"{np.mean([m['mismatch/k3'] for m in ms]):.4f}",
                         "sync probe: start-up gap, least share": f"{gap0:.3f}, {least_share:.2f}",
                         "wall (s)": f"{time.time() - t:.0f}"})
            which = base.val_data if tune else base.eval_data       # the table so far, rewritten after each run
            md = (f"Generated by `python -m toy.real_demo {' '.join(argv)}` ({Path(base.model).name}, rollouts "
                  f"{base.rollout_quant}, trainer {base.train_dtype}, batch {base.prompts_per_step}x"
                  f"{base.num_generations}, {base.steps} steps, pass@1 of μ on {Path(which).name}: {len(scored)} "
                  f"problems x {base.eval_samples} samples at temperature {base.eval_temperature}, sampled with seed "
                  f"{eval_seed} before and after; interval: mean ± 1.96 sd/sqrt(n) of the per-problem differences). "
                  f"Wall {time.time() - t0:.0f} s.\n\n{mipu.markdown_table(rows)}\n")
            if len(arms) > 1 and not tune:
                md += f"\n{arms[0][0]} against each other arm on the same seed, paired per problem:\n\n" \
                      f"{mipu.markdown_table(versus(afters, arms, seeds))}\n"
            out.with_suffix(".md").write_text(md)
    print(md)


def versus(afters: dict, arms: list, seeds: list) -> list[dict]:
    """The first arm minus each other, paired per problem on each seed that both ran (one before, one eval seed: the
    same problems and samples' seeds), the mean over those seeds and on how many the first arm was ahead."""
    rows = []
    for arm in arms[1:]:
        done = [s for s in seeds if (*arms[0], s) in afters and (*arm, s) in afters]
        diffs = [np.mean(np.subtract(afters[(*arms[0], s)], afters[(*arm, s)])) for s in done]
        rows.append({"against": arm[0], **{f"seed {s}": paired(afters[(*arm, s)], afters[(*arms[0], s)])
                                           if s in done else "-" for s in seeds},
                     "mean over seeds": f"{np.mean(diffs):+.3f}" if done else "-",
                     "seeds ahead": f"{sum(d > 0 for d in diffs)} of {len(done)}"})
    return rows


def keep(out: Path, line: dict) -> None:
    """One line appended to <out>.jsonl as each measurement ends: a cut-off demo keeps what it measured."""
    with open(out.with_suffix(".jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toy.real_demo", description=__doc__.split("\n")[0])
    mipu.add_config_flags(parser, mipu.SUBCOMMANDS["train"][0])
    parser.set_defaults(output_dir="runs/real_demo")
    parser.add_argument("--methods", default="grpo,tis,mipu", help="the methods compared (comma-separated)")
    parser.add_argument("--seeds", help="seeds, comma-separated (default 1,2; with --tune 0)")
    parser.add_argument("--tune", action="store_true", help="choose the LR: tis at each of --lrs, on --val-data")
    parser.add_argument("--lrs", default="1e-5,2e-5,4e-5", help="--tune's learning rates")
    parser.add_argument("--out", help="<out>.md and <out>.jsonl (default toy/results/real_demo, with --tune "
                        "real_demo_tune, with --gap real_gap, with --tiny real_demo_tiny)")
    parser.add_argument("--gap", action="store_true", help="measure the inference gap at θ = --model instead (a row "
                        "appended to <out>.md; --method: the update's, default tis)")
    parser.add_argument("--gap-batches", type=int, default=16, help="--gap: Step-2 batches per T_post")
    parser.add_argument("--problems", type=int, default=0, help="--gap: the first N problems of --eval-data (0: all)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on arithmetic instead (TINY_DEMO; built "
                        "at --model if missing)")
    parser.add_argument("--sft-steps", type=int, default=0, help="supervised warm-start steps of --model first")
    parser.add_argument("--sft-out", help="where the warm-started model goes (default: --model's folder + -sft)")
    argv = sys.argv[1:] if argv is None else argv
    args = vars(parser.parse_args(argv))
    given = {a.split("=")[0][2:].replace("-", "_") for a in argv if a.startswith("--")}
    args["defaults"] = (set(REAL_DEMO) | set(TINY_DEMO) | {"method"}) - given   # the demo's, only where not given
    return mipu.report_errors(gap_row if args["gap"] else real_demo, args, argv)


if __name__ == "__main__":
    sys.exit(main())
