"""How fast, and what does Step 2 cost? `python -m toy.bench --model toy/models/tiny-qwen3 ...` (repo root).

Runs grpo and mipu variants interleaved step by step in one process on one vLLM engine and
prints median seconds per phase, the rollout wrapper against a bare LLM.generate, the sync check's
parts (probe, digests) against the push, and the wall time of the toy demo; the report also goes to
<--output-dir>/bench.md. --syncs N times train's sync phase alone (any --model, e.g. SmolLM2); --probe-steps N
runs N steps of --method with the sync probe after each, for --vllm-compile off against on.
"""
import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import mipu

PHASES = ("rollout", "recompute", "update", "sync", "gap_check", "rollback", "step")
BENCH_VARIANTS = {   # label -> Config overrides; c = ±1e9 makes every candidate accepted / rejected
    "grpo": {"method": "grpo"},
    "mipu heldout (val batch = train batch)": {"method": "mipu", "c": 1e9},
    "mipu heldout, every step rejected": {"method": "mipu", "c": -1e9},
}


def bench(args: dict) -> None:
    """Per-phase medians of grpo and mipu variants, interleaved step by step on one vLLM engine."""
    cfg = mipu.config_from(args, "train")
    if args["syncs"]:
        return bench_syncs(mipu.setup_llm_run(cfg), args["syncs"])
    if args["probe_steps"]:
        return bench_probe_steps(cfg, args["probe_steps"])
    llm = mipu.make_sampler(cfg, **mipu.vllm_args(cfg))
    runs = {label: mipu.setup_llm_run(dataclasses.replace(cfg, val_prompts=cfg.prompts_per_step, **kw), llm=llm)
            for label, kw in BENCH_VARIANTS.items()}
    history = {label: [] for label in runs}
    for _ in range(cfg.steps):
        for label, run in runs.items():
            share_engine(run)                # the engine is shared: load this run's θ first (not timed)
            history[label].append(mipu.mipu_step(run))
    base = {p: float(np.median([m[f"time/{p}"] for m in history["grpo"]])) for p in PHASES}
    rows = []
    for label, ms in history.items():
        med = {p: float(np.median([m[f"time/{p}"] for m in ms])) for p in PHASES}
        rows.append({"variant": label, **{p: f"{med[p]:.3f}" for p in PHASES},
                     "step / grpo step": f"{med['step'] / base['step']:.2f}",
                     "(sync+rollback) / step": f"{(med['sync'] + med['rollback']) / med['step']:.2f}",
                     "rejected": f"{1 - np.mean([m['step2/accepted'] for m in ms]):.2f}"})
    wrapper, bare = bench_rollout(runs["grpo"], repeats=max(cfg.steps, 3))
    share_engine(runs["grpo"])
    push, probe, digests = bench_sync_check(runs["grpo"], repeats=max(cfg.steps, 3))
    lines = [f"`python -m toy.bench` on {cfg.model}: {cfg.steps} steps per variant, batch "
             f"{cfg.prompts_per_step}x{cfg.num_generations}, max {cfg.max_new_tokens} new tokens, "
             f"rollout-quant {cfg.rollout_quant}; median seconds per phase.", "", mipu.markdown_table(rows), "",
             f"rollout wrapper `generate`: {wrapper:.4f} s; bare `LLM.generate`: {bare:.4f} s; "
             f"throughput ratio wrapper/bare = {bare / wrapper:.3f}", "",
             f"sync check per sync: probe {probe:.4f} s, digests {digests:.4f} s (the push itself, sync_weights: "
             f"{push:.4f} s)"]
    if args["bench_toy"]:                    # as the user runs it: a fresh process, default flags
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "toy.demo", "--out", str(Path(cfg.output_dir) / "bench-toy")],
                       check=True, capture_output=True, cwd=Path(__file__).resolve().parent.parent)
        lines.append(f"toy demo (`python -m toy.demo`, defaults): {time.time() - t0:.1f} s wall")
    report = "\n".join(lines) + "\n"
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.output_dir) / "bench.md").write_text(report)
    print(report)


def digest_cols_in_worker(model) -> int:
    return model.mipu_cols


def share_engine(run: mipu.TrainEngine) -> None:
    """Sync this run's θ into the vLLM engine the runs share. The digests' column offset is the engine's (the last
    run's check set it): the run takes it first."""
    [run.cols] = run.llm.apply_model(digest_cols_in_worker)
    run.sync()


def bench_rollout(run: mipu.TrainEngine, repeats: int) -> tuple[float, float]:
    """Median seconds of our `generate` (+ packing into a Rollout) vs a bare LLM.generate, same prompts."""
    from vllm import SamplingParams, TokensPrompt
    cfg = run.cfg
    rows = run.train_rows[: cfg.prompts_per_step]
    prompt_ids = mipu.prompts_of(run.tokenizer, rows, cfg)      # the prompts sample() gives vLLM
    params = SamplingParams(n=cfg.num_generations, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                            seed=cfg.seed, logprobs=0)
    wrapper, bare = [], []
    for i in range(repeats):                 # interleaved, so machine noise hits both alike
        t0 = time.perf_counter()
        run.sample(rows, seed=cfg.seed + i)
        t1 = time.perf_counter()
        run.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        t2 = time.perf_counter()
        wrapper.append(t1 - t0)
        bare.append(t2 - t1)
    return float(np.median(wrapper)), float(np.median(bare))


def bench_sync_check(run: mipu.TrainEngine, repeats: int) -> tuple[float, float, float]:
    """Median seconds of a sync's parts: the push (the reference's, LLMEngine.pushed into sync_weights; vLLM's
    digests of what each layer receives included: its hook is permanent), the probe (check_probe: the last probe's
    responses re-scored, and a fresh one once the trainer moved), the digests (the same push with TrainEngine.pushed's
    digests as sent, then check_digests: vLLM's fetched and compared; less the push's median)."""
    def digested_push():
        run.sent = {}
        mipu.sync_weights(run.llm, run.pushed())
        run.check_digests()
    parts = {
        "push": lambda: mipu.sync_weights(run.llm, mipu.LLMEngine.pushed(run)),
        "probe": run.check_probe,
        "digests": digested_push,
    }
    times = {k: [] for k in parts}
    for _ in range(repeats):                 # interleaved, so machine noise hits all alike
        for k, f in parts.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                f()
            times[k].append(time.perf_counter() - t0)
    push, probe, digested = (float(np.median(times[k])) for k in parts)
    return push, probe, digested - push


def bench_syncs(run: mipu.TrainEngine, n: int) -> None:
    """train's sync phase alone (TrainEngine.sync: the push and the digests; steps not a multiple of PROBE_EVERY),
    n times, θ moved by N(0, 1e-5) noise (an LR-1e-5 step's size) before each; a probe (check_probe) every 5th."""
    gen, syncs, probes = torch.Generator().manual_seed(0), [], []
    for i in range(n):
        with torch.no_grad():
            for p in run.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-5)
        run.step = 1 + i + i // 9
        t0 = time.perf_counter()
        run.sync()
        syncs.append(time.perf_counter() - t0)
        if i % 5 == 0:
            t0 = time.perf_counter()
            with torch.no_grad():
                run.check_probe()
            probes.append(time.perf_counter() - t0)
    print(f"sync phase: median {np.median(syncs):.3f} s of {n} ({run.cfg.rollout_quant}); probe: median "
          f"{np.median(probes):.3f} s of {len(probes)}")


def bench_probe_steps(cfg: mipu.TrainConfig, n: int, llm=None) -> None:
    """What --vllm-compile costs and changes, run once per setting: start-up (the engine, its compile included), the
    start-up line's T̂_post(θ_0), then n >= 2 steps, each followed by check_probe (untimed: does a reload reach the
    compiled model? share: vLLM's mean |Δ log p| over the trainer's since the last compared probe, mipu.probe_moved;
    a step whose sync probed (PROBE_EVERY) reports that probe), with k3 and seconds per step."""
    t0 = time.perf_counter()
    run = mipu.setup_llm_run(cfg, llm=llm)
    startup = time.perf_counter() - t0
    t_post, se = mipu.startup_gap(run)
    ms, probes = [], []
    for _ in range(n):
        ms.append(m := mipu.mipu_step(run))
        if "sync/probe_gap" not in m:            # else this step's sync probed: a second probe would see no move
            with torch.no_grad():
                m = run.check_probe()
        probes.append((m["sync/probe_gap"], m["sync/probe_share"]))
    col = lambda k: [m[k] for m in ms]
    print(mipu.markdown_table([{
        "vllm-compile": cfg.vllm_compile, "start-up s": f"{startup:.1f}", "T_post(θ_0) ± SE": f"{t_post:.5f} ± {se:.5f}",
        "first step s": f"{ms[0]['time/step']:.2f}", "median of the others s": f"{np.median(col('time/step')[1:]):.2f}",
        "k3 first step, median": f"{ms[0]['mismatch/k3']:.5f}, {np.median(col('mismatch/k3')):.5f}",
        "probe gap max": f"{max(g for g, _ in probes):.5f}",
        "share after each step (NaN: not compared)": " ".join(f"{b:.2f}" for _, b in probes)}]))


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m toy.bench", description=__doc__.split("\n")[0])
    mipu.add_config_flags(parser, mipu.SUBCOMMANDS["train"][0])
    parser.add_argument("--bench-toy", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the toy demo (python -m toy.demo with its defaults)")
    parser.add_argument("--syncs", type=int, default=0, help="only time N of train's syncs (bench_syncs); no steps")
    parser.add_argument("--probe-steps", type=int, default=0,
                        help="only run N steps of --method, the probe after each (bench_probe_steps)")
    return mipu.report_errors(bench, vars(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
