"""How fast against TRL? Our grpo step vs TRL's GRPOTrainer step, same model, batch and vLLM colocate, on CPU:
`PYTHONPATH=/tmp/trlpkgs python -m toy.bench_trl --model toy/models/tiny-qwen3 --train-data toy/data/arith_train.jsonl
 --steps 10 --prompts-per-step 8 --mini-batch-size 64 --micro-batch-size 64 --max-new-tokens 8
 --answer-format last-number --output-dir runs/bench_trl` (from the repo root).

Install TRL first: `pip install trl==1.16.0` (or, leaving the venv alone, `pip install --no-deps --target
/tmp/trlpkgs trl==1.16.0 accelerate==1.15.0` and PYTHONPATH=/tmp/trlpkgs). It is not in requirements.txt:
only this benchmark needs it. TRL 1.16 warns that it supports vLLM <= 0.31; with 0.32 it runs on CPU as is.

Ours runs first, in a subprocess (`--engine ours`: setup_llm_run + mipu_step, --method grpo); then TRL in this
process (two vLLM engines in one process would fight over the env vars TRL's colocate mode sets). Each times
--warmup-steps untimed + --steps timed optimizer steps; the medians go to <--output-dir>/bench_trl.md.

Same in both: the model, fp32 trainer, 8 prompts x 8 samples (flags), max 8 new tokens, temperature 1, one
optimizer step per generation batch (TRL: generation batch = mini-batch, num_iterations = --epochs), AdamW
lr 1e-6 constant, clip 0.2, grad-norm clip 1, beta 0, token-mean loss over the batch (TRL's loss_type "dapo"),
group-normalised advantages (TRL: std ddof=1, ours ddof=0: a constant rescale), the same prompt token ids (a
model with a chat template: TRL gets conversational prompts and renders them with --enable-thinking as ours; one
without: the plain text; checked on the first rows before timing, else an error), the reward (mipu.math_reward;
0 for a response cut by max tokens, as ours),
vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with VLLM_CPU_KVCACHE_SPACE=1 GiB and processed logprobs.
Differs (TRL has no option for these): TRL's vLLM gets no enforce_eager (on CPU vLLM then torch.compiles the
model with inductor, no CUDA graphs), dtype "auto" (vLLM CPU downcasts the float32 checkpoint to bfloat16, as
our default --rollout-dtype), prefix caching on, max_num_batched_tokens 4096, engine seed 0 and no per-request
seeds, and 64 requests of n=1 (the prompts repeated 8 times; ours: 8 requests of n=8); TRL syncs with
model.load_weights per tensor (ours: one layerwise reload, digested as sent and as received, plus at start-up and
every PROBE_EVERY-th step the sync probe, a trainer forward and a vLLM prompt-logprob pass), recomputes the old
log-probs only for its vLLM importance-sampling correction (--trl-is-correction, TRL's default: on, a sequence mask;
ours takes them from Step 1's own forward where one optimizer step covers the batch, as here, else recomputes them),
computes entropies in the loss forward. TRL's sampler takes the rows unshuffled, in the order ours draws them: both
sides sample the same prompts at each step (each engine its own samples of them).

The one workaround (TRL cannot sync on CPU): vLLM's CPU linear layers repack their weights after loading and
drop the loadable `weight` (dispatch_cpu_unquantized_gemm), so TRL's bare `model.load_weights` fails on the
first linear ("'Parameter' object has no attribute 'weight_loader'"). cpu_sync_weights loads TRL's parameters
(VLLMGeneration._iter_named_params, then reset_prefix_cache) through mipu.sync_weights, as ours: vLLM's layerwise
reload (mipu.reload_in_worker), which re-runs that repacking, and the tied lm_head's re-processing. Nothing else
in TRL is changed: the phase times come from wrappers around the trainer's own calls.
"""
import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mipu

PHASES = ("step", "sync", "generate", "rollout", "recompute", "update")


def medians(history: list[dict]) -> dict:
    """Median of each phase over the timed steps, the fastest step, and every step's seconds."""
    return {**{k: statistics.median(h[k] for h in history) for k in history[0]},
            "min step": min(h["step"] for h in history), "steps": [round(h["step"], 4) for h in history]}


def engine_info(llm) -> str:
    """How a vLLM engine runs: eager or compiled, its dtype, prefix caching."""
    c = llm.llm_engine.vllm_config
    return (f"enforce_eager={c.model_config.enforce_eager}, compilation mode={c.compilation_config.mode.name}, "
            f"dtype={c.model_config.dtype}, prefix caching={c.cache_config.enable_prefix_caching}")


def grpo_cfg(args: dict) -> mipu.Config:
    cfg = dataclasses.replace(mipu.config_from(args), method="grpo")
    if cfg.mini_batch_size != cfg.batch_size or cfg.epochs != 1:
        raise mipu.MIPUError("one optimizer step per batch: use --mini-batch-size = prompts x generations, --epochs 1")
    return cfg


def bench_ours(args: dict) -> dict:
    """Our grpo step (the phases of mipu_step); sync = reload + the sync check, rollout = generate + rewards."""
    cfg = grpo_cfg(args)
    mipu.check_flags(cfg, "train")
    t0 = time.perf_counter()
    run = mipu.setup_llm_run(cfg)
    startup = time.perf_counter() - t0
    history = [mipu.mipu_step(run) for _ in range(args["warmup_steps"] + cfg.steps)][args["warmup_steps"]:]
    med = medians([{p: m[f"time/{p}"] for p in ("step", "sync", "rollout", "recompute", "update")} for m in history])
    return {**med, "startup": startup, "reward": statistics.mean(m["rollout/reward"] for m in history),
            "vllm": engine_info(run.llm)}


class Timed:
    """Wraps a bound method: the same call, its wall seconds added to `into[name]` (a timing wrapper only)."""
    def __init__(self, fn, into: dict, name: str, when=lambda: True):
        self.fn, self.into, self.name, self.when = fn, into, name, when

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            if self.when():
                self.into[self.name] = self.into.get(self.name, 0.0) + time.perf_counter() - t0


def cpu_sync_weights(vg) -> None:
    """TRL's colocate sync (VLLMGeneration.sync_weights: its parameters, then reset_prefix_cache), the weights loaded
    by mipu.sync_weights: vLLM's layerwise reload plus the tied-lm_head re-processing (see the docstring)."""
    mipu.sync_weights(vg.llm, vg._iter_named_params())
    vg.llm.reset_prefix_cache()


def bench_trl(args: dict) -> dict:
    """TRL GRPOTrainer, vLLM colocate on CPU, settings derived from our Config (see the module docstring)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = grpo_cfg(args)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"          # as mipu.make_sampler
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}.items():
        os.environ.setdefault(k, v)                                # one process; TRL picks a free MASTER_PORT
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    eos = {tokenizer.eos_token_id}

    def reward(completions, completion_ids, answer, **_):          # = mipu.sample_reward on vLLM's output
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]   # chat: the assistant's turn
        return [0.0 if (len(ids) >= cfg.max_new_tokens and ids[-1] not in eos and not cfg.score_truncated)
                else mipu.math_reward(text, ans, cfg.answer_format == "boxed", cfg.reward_timeout)
                for text, ids, ans in zip(texts, completion_ids, answer)]
    rows = mipu.load_prompts(cfg, tokenizer, cfg.train_data)      # as setup_llm_run loads them
    total = args["warmup_steps"] + cfg.steps
    if total * cfg.prompts_per_step > len(rows):
        raise mipu.MIPUError("the steps must fit one pass over --train-data (ours reshuffles at the next, TRL not)")
    # in the order ours draws them (its first pass: step 0's "shuffle" stream), TRL's sampler unshuffled: at every
    # step both sides sample the same prompts
    order = torch.randperm(len(rows), generator=mipu.Engine.generator(SimpleNamespace(cfg=cfg, step=0), "shuffle"))
    rows = [rows[i] for i in order.tolist()]
    chat = bool(getattr(tokenizer, "chat_template", None))      # as mipu.chat_prompt: the template if there is one
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"] + cfg.prompt_suffix}] if chat else
                               r["prompt"] + cfg.prompt_suffix, "answer": r["answer"]} for r in rows])
    targs = GRPOConfig(
        output_dir=cfg.output_dir, use_cpu=True, bf16=False, fp16=False, seed=cfg.seed, report_to="none",
        logging_steps=1, save_strategy="no", max_steps=total, disable_tqdm=True, shuffle_dataset=False,
        per_device_train_batch_size=cfg.micro_batch_size, gradient_accumulation_steps=cfg.batch_size // cfg.micro_batch_size,
        steps_per_generation=cfg.batch_size // cfg.micro_batch_size, num_iterations=cfg.epochs,
        num_generations=cfg.num_generations, max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature,
        learning_rate=cfg.learning_rate, lr_scheduler_type="constant", weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm, epsilon=cfg.clip_eps, beta=0.0, loss_type="dapo", scale_rewards="group",
        use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False,
        vllm_max_model_length=cfg.max_model_len or None,
        vllm_importance_sampling_correction=args["trl_is_correction"],
        chat_template_kwargs={"enable_thinking": cfg.enable_thinking})
    times, history, clock = {}, [], {}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            times.clear()
            clock["t0"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            history.append({"step": time.perf_counter() - clock["t0"], **times})

    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=cfg.model, reward_funcs=reward, args=targs, train_dataset=data,
                          processing_class=tokenizer, callbacks=[StepTimer()])
    startup = time.perf_counter() - t0
    if trainer._tokenize_prompts(data[:8]["prompt"])[0] != mipu.prompts_of(tokenizer, rows[:8], cfg):
        raise mipu.MIPUError("TRL's prompt token ids differ from ours: the comparison would not be like for like")
    vg = trainer.vllm_generation
    vg.sync_weights = Timed(lambda: cpu_sync_weights(vg), times, "sync")
    vg.generate = Timed(vg.generate, times, "generate")
    trainer._generate_and_score_completions = Timed(trainer._generate_and_score_completions, times, "gen_score")
    trainer._get_per_token_logps_and_entropies = Timed(trainer._get_per_token_logps_and_entropies, times,
                                                       "recompute", when=lambda: not torch.is_grad_enabled())
    trainer.remove_callback(PrinterCallback)                       # no metrics dict printed per step
    trainer.train()
    for h in history:
        h.setdefault("recompute", 0.0)
        h["rollout"] = h["gen_score"] - h["sync"] - h["recompute"]    # generate + decode + rewards + advantages
        h["update"] = h["step"] - h["gen_score"]                    # loss forward + backward + optimizer step
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    return {**medians(history[args["warmup_steps"]:]), "startup": startup,
            "reward": statistics.mean(rewards[args["warmup_steps"]:]), "vllm": engine_info(vg.llm)}


def bench(args: dict) -> None:
    cfg = grpo_cfg(args)
    try:
        import trl  # noqa: F401  (checked first: the run of ours takes a minute)
    except ImportError as e:
        raise mipu.MIPUError(f"this benchmark needs TRL: pip install trl==1.16.0 ({e})") from e
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    cmd = [sys.executable, "-m", "toy.bench_trl", *sys.argv[1:], "--engine", "ours"]
    subprocess.run(cmd, check=True, cwd=Path(__file__).resolve().parent.parent)
    ours = json.loads((out / "ours.json").read_text())
    trl_res = bench_trl(args)
    import torch, trl, vllm
    fmt = lambda r, p: f"{r[p]:.3f}" if p in r else "-"
    rows = [{"engine": name, **{p: fmt(r, p) for p in PHASES}, "min step": fmt(r, "min step"),
             "start-up": f"{r['startup']:.1f}",
             "mean reward": f"{r['reward']:.3f}", "step / TRL step": f"{r['step'] / trl_res['step']:.2f}"}
            for name, r in (("mipu grpo", ours), ("TRL GRPOTrainer", trl_res))]
    report = "\n".join([
        f"`python -m toy.bench_trl` on {cfg.model}: {args['warmup_steps']} warm-up + {cfg.steps} timed steps each, "
        f"batch {cfg.prompts_per_step}x{cfg.num_generations}, max {cfg.max_new_tokens} new tokens, one optimizer "
        f"step per batch; median seconds per phase (start-up: engines and trainer, s).", "",
        mipu.markdown_table(rows), "",
        f"vLLM of ours: {ours['vllm']}; of TRL: {trl_res['vllm']}; TRL "
        f"importance-sampling correction: {args['trl_is_correction']}. trl {trl.__version__}, vllm "
        f"{vllm.__version__}, torch {torch.__version__}. Load average before: "
        f"{', '.join(f'{x:.2f}' for x in load0)}; after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}."])
    if any(max(r["steps"]) > 2 * r["min step"] for r in (ours, trl_res)):   # another process took the cores
        report += "\n\nWARNING: a step took over 2x the fastest one: the machine was busy, rerun on an idle one."
    (out / "bench_trl.md").write_text(report + "\n")
    (out / "bench_trl_steps.json").write_text(json.dumps({"mipu grpo": ours["steps"], "TRL": trl_res["steps"]}))
    print(report)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m toy.bench_trl", description=__doc__.split("\n")[0])
    mipu.add_config_flags(parser, mipu.SUBCOMMANDS["train"][0])
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (default: %(default)s)")
    parser.add_argument("--trl-is-correction", action=argparse.BooleanOptionalAction, default=True,
                        help="TRL's vLLM importance-sampling correction (its default; adds the old-logp forward)")
    parser.add_argument("--engine", choices=("both", "ours"), default="both", help=argparse.SUPPRESS)
    args = vars(parser.parse_args())
    if args["engine"] == "ours":
        fn = lambda a: (Path(a["output_dir"]) / "ours.json").write_text(json.dumps(bench_ours(a)))
        return mipu.report_errors(fn, args)
    return mipu.report_errors(bench, args)


if __name__ == "__main__":
    sys.exit(main())
