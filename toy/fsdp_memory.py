"""The memory plan of toy/GPU.md's recipe, no GPU needed (from the repo root):

    python -m toy.fsdp_memory --one-gpu      # Qwen3-1.7B on an 80 GiB GPU, Qwen3-4B on a 141 GiB GPU
    python -m toy.fsdp_memory                # Qwen3-4B per GPU under torchrun (FSDP2), --gpus 2,4,8 --gpu-gib 80

An ESTIMATE from arithmetic, not a measurement: toy.memory_plan's, with vLLM's share at
--gpu-memory-utilization auto (its vllm_share) unless --gpu-memory-utilization gives one. Under torchrun the weights,
gradients and AdamW states are sharded over N ranks; FSDP2 adds the gathered root (embeddings, final norm, lm_head) and
two gathered decoder layers, and the root's unsharded gradient; autocast's bf16 copies (Step 1), the activations and
vLLM's share are per rank as on one GPU; rank 0 alone loads the model into host RAM.
"""
import argparse

import mipu
from toy import memory_plan
from toy.bench_trainer import qwen3_config

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
    cfg = mipu.TrainConfig(**RECIPE, gpu_memory_utilization=share)   # not validated: no GPU needed to plan for one
    c = qwen3_config(shape)
    return (memory_plan.memory_plan(c, cfg, gpu_gib * GIB, world),
            *memory_plan.vllm_share(c, cfg, gpu_gib * GIB, world))


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--one-gpu", action="store_true", help="the recipe on one GPU (1.7B: 80 GiB, 4B: 141 GiB)")
    parser.add_argument("--gpus", default="2,4,8", help="comma-separated numbers of GPUs (torchrun ranks)")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU (80: H100)")
    parser.add_argument("--gpu-memory-utilization", default="auto", type=memory_plan.share,
                        help="vLLM's share: auto or a fraction")
    args = parser.parse_args()
    share = args.gpu_memory_utilization
    print(one_gpu_table(share) if args.one_gpu else
          torchrun_table([int(x) for x in args.gpus.split(",")], args.gpu_gib, share))


if __name__ == "__main__":
    main()
