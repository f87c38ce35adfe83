"""What will a GPU need? The memory plan of a `train` step on one GPU (a rank's under torchrun): GiB per part and
phase, ESTIMATED from a transformers config and the flags, and vLLM's share that fits beside the trainer, a value for
train's --gpu-memory-utilization. No GPU needed (from the repo root):

    python -m toy.memory_plan --model Qwen/Qwen3-1.7B --gpu-gib 80 --auto [train's flags, e.g. --micro-batch-size 4]
    python -m toy.memory_plan --recipe --auto               # GPU.md's recipe: 1.7B on 80 GiB, 4B on 141 GiB
    python -m toy.memory_plan --recipe --auto --gpus 2,4,8  # Qwen3-4B per GPU of --gpu-gib under torchrun (FSDP2)

--recipe needs no model (the shapes are Qwen3's config.json values). Under torchrun the weights, gradients and AdamW
states are sharded over N ranks; FSDP2 adds the gathered root (embeddings, final norm, lm_head), two gathered decoder
layers and the root's unsharded gradient; autocast's bf16 copies, the activations and vLLM's share are per rank as on
one GPU; rank 0 alone loads the model into host RAM. toy/GPU.md explains each part; toy.gpu_check measures them.
"""
import argparse
import math

import torch

import mipu


PLAN_PROMPT_TOKENS = 512   # prompt length the memory plan assumes when --max-model-len is 0 (math prompts: ~100-300)


# bytes per token and layer kept for backward x (hidden, (heads + kv heads) x head_dim, MLP), saved-tensor hooks on
# transformers 5.19's Qwen3 (7 shapes; sdpa: no seq² term). bf16-mixed: residuals, RMSNorms fp32, ~2x Korthikanti's 34·H
ACT_BYTES = {"float32": (24, 16, 16), "bf16-mixed": (26, 10, 8), "bfloat16": (16, 10, 8)}


# GPU memory outside torch's caching allocator in a CUDA process: the CUDA context, cuBLAS/cuDNN handles, workspaces
# (vLLM's profiler logged non_torch_memory 1.79 GiB for Llama-3-8B on one H100, vLLM PR #10511); toy.gpu_check measures
# it
CUDA_CONTEXT_BYTES = 2 * 2**30
# vLLM 0.32's sleep (level 1 or 2: the same GPU memory freed) unmaps its weights and KV cache and copies its pool's
# runtime allocations to host RAM; what it allocated outside that pool stays on the GPU, CUDA graphs too unless
# sleep_mode_offload_cudagraph: < 3 GiB eager by vLLM's test_deep_sleep (tests/.../test_cumem.py)
VLLM_ASLEEP_BYTES = 3 * 2**30
# vLLM's share besides its weights and KV cache: its profiled activation peak, non-torch memory and CUDA graphs
# (PR #10511's log: 1.26 + 1.79 GiB; the graphs about 1 GiB more): bytes the KV cache cannot have
VLLM_RUNTIME_BYTES = 4 * 2**30
ALLOCATOR_SLACK = 0.10    # auto's margin: torch's caching allocator reserves more than the plan's bytes (assumed;
#                           toy/gpu_check prints the measured reserved and allocated peaks)


def share(text: str) -> str | float:       # a script's --gpu-memory-utilization: auto or a number
    return text if text == "auto" else float(text)


def model_sizes(c) -> dict:
    """Element counts of a transformers decoder config `c`: n (every weight, a tied lm_head once), one decoder layer,
    all linear layers (what vLLM's FP8 quantizes), the root FSDP2 keeps whole (embeddings, lm_head, final norm), q + kv
    widths, and the KV cache's elements per token."""
    H, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    hd = getattr(c, "head_dim", None) or H // c.num_attention_heads
    qkv = (c.num_attention_heads + c.num_key_value_heads) * hd               # q (and o), k (and v) widths
    linear = 2 * H * qkv + 3 * H * c.intermediate_size                       # attention + MLP projections
    layer = linear + 2 * hd + 2 * H                                          # + q/k norms, 2 norms
    root = V * H * (1 if getattr(c, "tie_word_embeddings", False) else 2) + H   # embeddings, lm_head, norm
    return {"n": L * layer + root, "layer": layer, "linear": L * linear, "root": root, "qkv": qkv,
            "kv_per_token": 2 * L * c.num_key_value_heads * hd}


def memory_plan(c, cfg: mipu.TrainConfig, gpu_bytes: float, world: int = 1) -> dict:
    """Estimated GiB per part of a training step on one GPU (a rank's under torchrun) from a transformers config `c`
    and the flags. peak = the largest phase: recompute (vLLM awake: rollout, log π_k, sync probe), Step 1 (vLLM asleep
    with --vllm-sleep on), sync. *_host: host RAM (snapshot: per rank; save: rank 0; load: per rank, all at once)."""
    H, L, V, size = c.hidden_size, c.num_hidden_layers, c.vocab_size, model_sizes(c)
    n, layer_n, root = size["n"], size["layer"], size["root"] * (world > 1)   # FSDP2's root: only under torchrun
    b = 2 if cfg.train_dtype == "bfloat16" else 4                            # bytes per weight, grad, Adam moment
    mixed = cfg.train_dtype == "bf16-mixed"
    tokens = cfg.micro_batch_size * (cfg.max_model_len or cfg.max_new_tokens + PLAN_PROMPT_TOKENS)
    layer = tokens * sum(k * d for k, d in zip(ACT_BYTES[cfg.train_dtype], (H, size["qkv"], c.intermediate_size)))
    gib = {"weights": n * b / world, "grads": n * b / world, "optimizer": 2 * n * b / world,   # FSDP2: sharded
           "bf16_copies": 2 * n * mixed,     # autocast's cache in Step 1: every weight in bf16, till it exits
           "head_copy": 2 * V * H * mixed,   # SelectiveLogprobs' weight.to(bf16): a second [V, H], beside the cache's
           "activations": L * tokens * H * b + layer if cfg.grad_checkpointing == "on" else L * layer,  # inputs, 1
           "recompute": layer + tokens * H * b + 6 * cfg.logprob_chunk * V,   # no grad: <= 1 layer's, decoder, chunk
           "logprob_head": 4 * V * H + 6 * cfg.logprob_chunk * V,           # fp32 grad_w; a chunk's fp32 + bf16 logits
           "fsdp_gathered": (root + 2 * layer_n * (world > 1)) * b,         # FSDP2 (fp32): root + computing, next layer
           "fsdp_root_grad": root * b,                                      # the root's unsharded grad, pre-reduce
           "sync": mipu.SYNC_PIECE_BYTES + 2 * (V * H + 2 * layer_n),   # bf16: a piece + its last tensor, 2 vLLM layers
           "cuda_context": CUDA_CONTEXT_BYTES, "vllm_asleep": VLLM_ASLEEP_BYTES * (cfg.vllm_sleep == "on"),
           # host RAM per rank: θ (tied once) and AdamW's 2 moments in one host buffer; rollback copies back in place
           "snapshot_host": 3 * n * b / world * (mipu.METHOD_SPEC[cfg.method][1] != "always"),
           "save_host": 3 * n * b,           # rank 0 at each save: θ and AdamW gathered whole (full_state_dict)
           "load_host": n * b}               # rank 0 at start-up: the whole model (the others: meta), before FSDP2
    gib = {"params_billion": n / 1e9, **{k: v / 2**30 for k, v in gib.items()}}
    awake, step1 = trainer_phases(gib, cfg)
    share = cfg.gpu_memory_utilization
    gib["vllm"] = (auto_share(max(awake.values()), gpu_bytes) if share == "auto" else share) * gpu_bytes / 2**30
    gib["peak_recompute"] = awake["recompute"] + gib["vllm"] + gib["cuda_context"]
    gib["peak_step1"] = step1 + gib["vllm_asleep" if cfg.vllm_sleep == "on" else "vllm"] + gib["cuda_context"]
    gib["peak_sync"] = awake["sync"] + gib["vllm"] + gib["cuda_context"]
    gib["peak"] = max(gib["peak_recompute"], gib["peak_step1"], gib["peak_sync"])
    # one node of `world` ranks: rank 0 loads the model (and optimizer.pt on --resume); later snapshots + one save
    gib["host_peak"] = max((1 + 2 * cfg.resume) * gib["load_host"], world * gib["snapshot_host"] + gib["save_host"])
    return gib


def trainer_phases(gib: dict, cfg: mipu.TrainConfig) -> tuple[dict, float]:
    """From memory_plan's parts: the trainer's GiB in each phase vLLM is awake in, and in Step 1 (CUDA context apart).
    Between Step 1s the gradients are freed (set_to_none) and autocast's cache is empty (it clears at its exit). The
    recompute caches no cast (TrainEngine.trainer_logp): its largest, lm_head's, is freed before SelectiveLogprobs'
    head_copy of the same size: no bf16_copies term there."""
    def total(*keys):     # θ and AdamW are resident in every phase
        return gib["weights"] + gib["optimizer"] + sum(gib[k] for k in keys)

    awake = {"recompute": total("head_copy", "recompute", "fsdp_gathered"), "sync": total("sync")}
    step1 = total("grads", "bf16_copies", "head_copy", "activations", "logprob_head", "fsdp_gathered", "fsdp_root_grad")
    if cfg.vllm_sleep != "on":
        awake["step1"] = step1
    return awake, step1


def auto_share(trainer_gib: float, gpu_bytes: float) -> float:
    """--gpu-memory-utilization auto: the largest fraction of the GPU, in steps of 0.01, beside the trainer's GiB while
    vLLM is awake (plus ALLOCATOR_SLACK) and the CUDA context; 0 when nothing is left."""
    gpu = gpu_bytes / 2**30
    left = gpu - trainer_gib * (1 + ALLOCATOR_SLACK) - CUDA_CONTEXT_BYTES / 2**30
    return max(math.floor(round(100 * left / gpu, 6)) / 100, 0.0) if gpu > 0 else 0.0


def vllm_share(c, cfg: mipu.TrainConfig, gpu_bytes: float, world: int = 1) -> tuple[float, int]:
    """(vLLM's fraction of the GPU: the flag's number or auto's, how many full-length sequences its KV cache holds):
    share − vLLM's weights (fp8: 1 byte per linear weight) − VLLM_RUNTIME_BYTES over one sequence's KV bytes (vLLM's
    kv_cache_dtype auto: the rollout dtype). Full length: --max-model-len, else PLAN_PROMPT_TOKENS + max_new_tokens."""
    size, dt = model_sizes(c), {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.rollout_dtype]
    vllm = memory_plan(c, cfg, gpu_bytes, world)["vllm"] * 2**30
    weights = size["n"] * dt - size["linear"] * (dt - 1) * (cfg.rollout_quant == "fp8")
    seq = cfg.max_model_len or cfg.max_new_tokens + PLAN_PROMPT_TOKENS
    kv_sequences = max(vllm - weights - VLLM_RUNTIME_BYTES, 0) // (size["kv_per_token"] * dt * seq)
    return (round(vllm / gpu_bytes, 6) if gpu_bytes > 0 else 0.0), int(kv_sequences)


def check_memory_plan(cfg: mipu.TrainConfig, gpu: float = 0, world: int = 0) -> float:
    """Print the memory plan and vLLM's share on a GPU of `gpu` bytes (default: the visible GPU's) for one of `world`
    ranks; MIPUError when the peak exceeds the GPU's memory or vLLM's KV cache holds no full-length sequence. Returns
    vLLM's fraction of the GPU (auto resolved)."""
    gpu, world = gpu or torch.cuda.get_device_properties(0).total_memory, world or mipu.rank_world()[1]
    c = mipu.load_pretrained("AutoConfig", cfg.model)
    plan, (share, sequences) = memory_plan(c, cfg, gpu, world), vllm_share(c, cfg, gpu, world)
    print("memory plan, GiB (estimated): " + ", ".join(f"{k} {v:.1f}" for k, v in plan.items()), flush=True)
    seq, batch = cfg.max_model_len or cfg.max_new_tokens + PLAN_PROMPT_TOKENS, cfg.batch_size // world
    how = "auto" if cfg.gpu_memory_utilization == "auto" else "--gpu-memory-utilization"
    print(f"vLLM: {share:.2f} of the GPU ({how}); its KV cache holds ~{sequences} sequences of {seq} tokens "
          f"(estimated) against {batch} per rollout" + (" per rank" if world > 1 else "")
          + ("" if sequences >= batch else ": the rollout runs in waves"), flush=True)
    if plan["peak"] > gpu / 2**30:
        raise mipu.MIPUError(f"the memory plan needs ~{plan['peak']:.0f} GiB, the GPU has {gpu / 2**30:.0f}: lower "
                             "--micro-batch-size or --gpu-memory-utilization, or use --grad-checkpointing on, "
                             "--vllm-sleep on, --train-dtype bfloat16")
    if sequences < 1:
        raise mipu.MIPUError(f"vLLM's {share:.2f} of the GPU leaves no KV cache for one sequence of {seq} tokens "
                             "(estimated): raise --gpu-memory-utilization, or lower --max-model-len or "
                             "--micro-batch-size")
    return share


# ---- the recipe's tables (--recipe)

GIB = 2 ** 30
# the GPU recipe (toy/GPU.md): 4 responses per forward of 4,352 tokens at most, 32 x 8 responses a step, FP8 rollouts
RECIPE = dict(device="cuda", method="mipu", micro_batch_size=4, max_new_tokens=4096, max_model_len=4352,
              prompts_per_step=32, rollout_quant="fp8")
ONE_GPU = (("qwen3-1.7b", 80.0), ("qwen3-4b", 141.0))
# plan key -> row label, in the order of the tables
PARTS = {"weights": "weights, fp32", "grads": "gradients, fp32", "optimizer": "AdamW states, fp32",
         "bf16_copies": "autocast's cached bf16 weight copies (Step 1)", "head_copy": "second bf16 [V, H] head copy",
         "activations": "activations, checkpointed", "recompute": "recompute's working set (no grad)",
         "logprob_head": "log-prob head: fp32 grad of lm_head + a chunk",
         "fsdp_gathered": "FSDP2: gathered root + 2 layers", "fsdp_root_grad": "FSDP2: the root's unsharded gradient",
         "sync": "sync pieces", "cuda_context": "CUDA context, handles (outside torch)", "vllm": "vLLM's share",
         "vllm_asleep": "vLLM asleep in Step 1 (outside its pool)",
         "peak_recompute": "**recompute phase** (vLLM awake)", "peak_step1": "**Step-1 phase** (vLLM asleep)",
         "peak_sync": "**sync phase** (vLLM awake)",
         "peak": "**peak**", "snapshot_host": "host: rollback snapshot, per rank",
         "save_host": "host: rank 0's save gather (θ + AdamW)", "load_host": "host: the model at load, rank 0",
         "host_peak": "**host peak** (one node)"}
# the torchrun table's columns: plan key -> short label
COLUMNS = {"weights": "weights", "grads": "grads", "optimizer": "AdamW", "bf16_copies": "bf16 copies",
           "head_copy": "head copy", "activations": "activations", "recompute": "recompute", "logprob_head":
           "log-prob head", "fsdp_gathered": "gathered root + 2 layers", "fsdp_root_grad": "root grad",
           "vllm": "vLLM share", "peak_recompute": "recompute phase", "peak_step1": "Step-1 phase",
           "peak_sync": "sync phase", "host_peak": "host peak, per node"}


def plan(shape: str, gpu_gib: float, world: int, share) -> tuple[dict, float, int]:
    from toy.bench_trainer import qwen3_config                      # it imports this module
    cfg = mipu.TrainConfig(**RECIPE, gpu_memory_utilization=share)   # no check_flags: no GPU needed to plan for one
    c = qwen3_config(shape)
    return (memory_plan(c, cfg, gpu_gib * GIB, world),
            *vllm_share(c, cfg, gpu_gib * GIB, world))


def one_gpu_table(share) -> str:
    """The recipe on one GPU: a row per plan part, a column per (shape, GPU)."""
    plans = [plan(shape, gib, 1, share) for shape, gib in ONE_GPU]
    head = "| part (key printed by toy.memory_plan) | " + " | ".join(f"{s}, {g:g} GiB GPU" for s, g in ONE_GPU) + " |"
    rows = [head, "|---" * (1 + len(ONE_GPU)) + "|",
            "| parameters, billion (`params_billion`) | " + " | ".join(f"{p['params_billion']:.2f}" for p, *_ in plans)
            + " |"]
    rows += [f"| {label} (`{key}`) | " + " | ".join(f"{p[key]:.2f}" for p, *_ in plans) + " |"
             for key, label in PARTS.items()]
    rows.append("| vLLM's fraction of the GPU; KV cache, sequences of 4352 tokens | "
                + " | ".join(f"{fraction:.2f}; {seqs}" for _, fraction, seqs in plans) + " |")
    return f"GiB, ESTIMATED (`--gpu-memory-utilization {share}`):\n\n" + "\n".join(rows)


def torchrun_table(gpus: list[int], gpu_gib: float, share) -> str:
    """Qwen3-4B per rank of N GPUs: a row per N."""
    lines = ["| GPUs | " + " | ".join(COLUMNS.values()) + " | vLLM's fraction; KV sequences |",
             "|---" * (len(COLUMNS) + 2) + "|"]
    for n in gpus:
        p, fraction, seqs = plan("qwen3-4b", gpu_gib, n, share)
        lines.append(f"| {n} | " + " | ".join(f"{p[k]:.1f}" for k in COLUMNS) + f" | {fraction:.2f}; {seqs} |")
    return (f"Qwen3-4B ({p['params_billion']:.2f} B parameters), GiB per GPU of {gpu_gib:g} GiB "
            f"(`--gpu-memory-utilization {share}`), ESTIMATED:\n\n" + "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m toy.memory_plan", description=__doc__.split("\n")[0])
    mipu.add_config_flags(parser, mipu.SUBCOMMANDS["train"][0], "train")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU (80: H100)")
    parser.add_argument("--world", type=int, default=1, help="torchrun ranks (one GPU each)")
    parser.add_argument("--auto", action="store_true", help="vLLM's share: the largest that fits beside the trainer")
    parser.add_argument("--recipe", action="store_true", help="the tables of GPU.md's recipe (no --model)")
    parser.add_argument("--gpus", default="", help="--recipe: Qwen3-4B per rank of each number of GPUs, e.g. 2,4,8")
    parser.set_defaults(device="cuda")
    args = vars(parser.parse_args())
    gpu, world, auto, recipe, gpus = (args.pop(k) for k in ("gpu_gib", "world", "auto", "recipe", "gpus"))
    if recipe:
        share = "auto" if auto else args["gpu_memory_utilization"]
        print(torchrun_table([int(x) for x in gpus.split(",")], gpu, share) if gpus else one_gpu_table(share))
        return
    cfg = mipu.TrainConfig(**{**args, **({"gpu_memory_utilization": "auto"} if auto else {})})
    raise SystemExit(mipu.report_errors(check_memory_plan, cfg, gpu * 2**30, world))


if __name__ == "__main__":
    main()
