"""The CPU LLM demo: `python -m toy.llm_demo` (from the repo root; ~5 minutes on 2 cores with the
README's flags).

Tiny Qwen3 (toy/models/tiny-qwen3, built if missing) -> supervised warm start (SFT) on the arithmetic
problems -> RL through the real vLLM with fp8-sim rollouts, grpo vs mipu on one engine. Curves to
<--out>/llm_demo.png, table to <--out>/llm_demo.md, each run's metrics.jsonl under --output-dir.
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch

import mipu
from toy.make_tiny import build_tiny_model

HERE = Path(__file__).resolve().parent
# The demo's settings (tiny model, 1-2 digit answers): they override the GPU-sized defaults.
LLM_DEMO = dict(rollout_quant="fp8-sim", num_generations=8, prompts_per_step=32, val_prompts=32, mini_batch_size=256,
                micro_batch_size=64, max_new_tokens=6, temperature=1.0, eval_samples=4, eval_temperature=1.0,
                answer_format="last-number")          # the tiny model answers with a bare number
LLM_DEMO_METHODS = ("grpo", "mipu")
LLM_DEMO_EVAL = "eval/arith_test/pass@1"      # J(μ) on the held-out problems
SFT_DEFAULTS = dict(sft_steps=1500, sft_lr=1e-3, sft_batch_size=64)   # tiny model from random init


def sft_warm_start(cfg: mipu.Config, steps: int, lr: float, batch_size: int, out: str) -> str:
    """Supervised warm start: cross-entropy on prompt -> answer + EOS, so the tiny model solves
    some problems before RL. Saves to `out` and returns it."""
    from transformers import AutoTokenizer
    rows = mipu.load_rows(cfg.train_data, cfg.prompt_key, cfg.answer_key)
    model = mipu.load_trainer(cfg.model, "float32", cfg.device)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    prompts = mipu.prompts_of(tokenizer, rows, cfg)             # the prompts RL will sample from
    answers = [tokenizer.encode(r["answer"], add_special_tokens=False) + [tokenizer.eos_token_id] for r in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    for it in range(steps):
        idx = torch.randint(len(rows), (batch_size,), generator=gen).tolist()
        logp, mask = mipu.lean_token_logprobs(model, [prompts[i] for i in idx], [answers[i] for i in idx], 1.0,
                                              batch_size)
        loss = -mipu.masked_mean(logp, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if it % 200 == 0 or it == steps - 1:
            print(f"sft step {it:>5} loss {loss.item():.4f}", flush=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}")
    return out


def rl_curves(base: mipu.Config, llm, eval_sets: dict) -> dict:
    """grpo and mipu from the same warm start on one engine: each run's metrics, step -1 = start."""
    curves = {}
    for method in LLM_DEMO_METHODS:
        cfg = dataclasses.replace(base, method=method, output_dir=f"{base.output_dir}/{method}")
        run = mipu.setup_llm_run(cfg, llm=llm)
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        curves[method] = [{"step": -1, **mipu.eval_metrics(run, eval_sets)}]
        while run.step < base.steps:
            m = mipu.mipu_step(run)
            if (base.eval_every and run.step % base.eval_every == 0) or run.step == base.steps:
                m.update(mipu.eval_metrics(run, eval_sets))
            mipu.log_metrics(Path(cfg.output_dir) / "metrics.jsonl", m)
            curves[method].append(m)
    return curves


def llm_demo(args: dict) -> None:
    cfg = mipu.config_from(args)
    out, tiny, sft_out = Path(args["out"]), args["tiny"], args["sft_out"]
    out.mkdir(parents=True, exist_ok=True)
    if not (Path(tiny) / "config.json").exists():
        build_tiny_model(tiny, seed=cfg.seed)
    data = dict(train_data=str(HERE / "data" / "arith_train.jsonl"), val_data=str(HERE / "data" / "arith_val.jsonl"),
                eval_data=str(HERE / "data" / "arith_test.jsonl"))
    sft_warm_start(dataclasses.replace(cfg, model=tiny, **data), args["sft_steps"], args["sft_lr"],
                   args["sft_batch_size"], sft_out)                   # always: deterministic, ~1 min
    base = dataclasses.replace(cfg, model=sft_out, **data, **LLM_DEMO)
    curves = rl_curves(base, mipu.make_sampler(base, **mipu.vllm_args(base)), mipu.load_eval_sets(base))
    plot(out / "llm_demo.png", curves)
    rows = [{"method": meth, "J(mu) held-out, start": f"{c[0][LLM_DEMO_EVAL]:.3f}",
             "J(mu) held-out, end": f"{c[-1][LLM_DEMO_EVAL]:.3f}",
             "train reward, first 5 steps": f"{np.mean([m['rollout/reward'] for m in c[1:6]]):.3f}",
             "train reward, last 5 steps": f"{np.mean([m['rollout/reward'] for m in c[1:][-5:]]):.3f}",
             "mean k3": f"{np.mean([m['mismatch/k3'] for m in c[1:]]):.2e}",
             "accept rate": f"{np.mean([m['step2/accepted'] for m in c[1:]]):.2f}"}   # step times: BENCHMARKS.md
            for meth, c in curves.items()]
    md = (f"Generated by `python -m toy.llm_demo --steps {base.steps} --eval-every {base.eval_every} "
          f"--learning-rate {base.learning_rate:g} --sft-steps {args['sft_steps']}` (tiny Qwen3, fp8-sim rollouts, "
          f"batch {base.prompts_per_step}x{base.num_generations}, J = pass@1 at temperature {base.eval_temperature} "
          f"on toy/data/arith_test.jsonl, {base.eval_samples} samples per problem).\n\n{mipu.markdown_table(rows)}\n")
    (out / "llm_demo.md").write_text(md)
    print(md)


def plot(path: Path, curves: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("rollout/reward", "train reward (mu samples)"), (LLM_DEMO_EVAL, "J(mu) on held-out problems"),
              ("mismatch/k3", "mismatch k3 KL(mu||pi)"), ("step2/accepted", "accepted (cumulative rate)")]
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.6))
    for ax, (key, title) in zip(axes, panels):
        for method, ms in curves.items():
            pts = [(m["step"], m[key]) for m in ms if key in m]
            x, y = np.array(pts).T if pts else ([], [])
            if key == "step2/accepted":
                y = np.cumsum(y) / np.arange(1, len(y) + 1)
            ax.plot(x, y, label=method, marker="." if key == LLM_DEMO_EVAL else None)
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m toy.llm_demo", description=__doc__.split("\n")[0])
    mipu.add_config_flags(parser, mipu.SUBCOMMANDS["train"][0])
    parser.add_argument("--sft-steps", type=int, default=SFT_DEFAULTS["sft_steps"], help="SFT optimizer steps")
    parser.add_argument("--sft-lr", type=float, default=SFT_DEFAULTS["sft_lr"], help="SFT AdamW learning rate")
    parser.add_argument("--sft-batch-size", type=int, default=SFT_DEFAULTS["sft_batch_size"], help="SFT problems/step")
    parser.add_argument("--tiny", default=str(HERE / "models" / "tiny-qwen3"),
                        help="the tiny model (built here if missing)")
    parser.add_argument("--sft-out", default=str(HERE / "models" / "tiny-qwen3-sft"),
                        help="where the warm-started model goes")
    parser.add_argument("--out", default=str(HERE / "results"), help="folder for llm_demo.md and llm_demo.png")
    args = vars(parser.parse_args())
    return mipu.report_errors(llm_demo, args)


if __name__ == "__main__":
    sys.exit(main())
