"""Estimated GPU memory per rank of `torchrun --nproc_per_node N mipu.py train` (FSDP2) for Qwen3-4B, no GPU
needed: `python -m toy.fsdp_memory` (from the repo root). An ESTIMATE from arithmetic, not a measurement.

mipu.memory_plan (the start-up check's arithmetic; weights, gradients and AdamW states sharded over N ranks)
for the README's GPU recipe flags, plus what FSDP2 adds on every rank: the root module (embeddings, final norm,
lm_head) gathered from forward to backward and two gathered decoder layers (the one computing and the one
prefetched), in fp32 during Step 1. The sync's pieces (gathered one tensor at a time), autocast's bf16 weight copies
and the activations are per rank as on one GPU (not divided by N).
"""
import argparse

import mipu
from toy.bench_trainer import qwen3_config

GIB = 2 ** 30
# the README's GPU recipe (Qwen3 math RL): 4 responses per forward of 4,352 tokens at most, vLLM's share 0.3
RECIPE = dict(device="cuda", method="mipu", micro_batch_size=4, max_new_tokens=4096, max_model_len=4352,
              gpu_memory_utilization=0.3)


def fsdp_gathered(c) -> float:
    """GiB every rank holds whole in Step 1: the gathered root + 2 decoder layers (fp32)."""
    H, hd, inter = c.hidden_size, c.head_dim, c.intermediate_size
    layer = 2 * H * hd * (c.num_attention_heads + c.num_key_value_heads) + 3 * H * inter + 2 * hd + 2 * H
    root = c.vocab_size * H + H                                   # tied embeddings / lm_head, final norm
    return (root + 2 * layer) * 4 / GIB


def table(gpus: list[int], gpu_gib: float) -> str:
    c = qwen3_config("qwen3-4b")
    cfg = mipu.TrainConfig(**RECIPE)           # not validated: no GPU needed to plan for one
    gathered = fsdp_gathered(c)
    lines = ["| GPUs | weights | grads | AdamW | bf16 copies | activations | log-prob head | gathered root + 2 layers "
             "| vLLM share | Step 1 (vLLM asleep) | sync pieces | sync (vLLM awake) | host RAM for the snapshot |",
             "|---" * 13 + "|"]
    for n in gpus:
        p = mipu.memory_plan(c, cfg, gpu_gib * GIB, world=n)
        step1 = sum(p[k] for k in ("weights", "grads", "optimizer", "bf16_copies", "activations", "logprob_head"))
        step1 += gathered
        sync = p["weights"] + p["optimizer"] + p["vllm"] + p["sync"]
        lines.append(f"| {n} | " + " | ".join(f"{p[k]:.1f}" for k in ("weights", "grads", "optimizer", "bf16_copies",
                                                                    "activations", "logprob_head"))
                     + f" | {gathered:.1f} | {p['vllm']:.1f} | {step1:.1f} | {p['sync']:.1f} | {sync:.1f} "
                     f"| {p['snapshot_host']:.1f} |")
    return f"Qwen3-4B ({p['params_billion']:.2f} B parameters), GiB per GPU of {gpu_gib:g} GiB, ESTIMATED:\n\n" + \
        "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", default="2,4,8", help="comma-separated numbers of GPUs (torchrun ranks)")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU (80: H100)")
    args = parser.parse_args()
    print(table([int(x) for x in args.gpus.split(",")], args.gpu_gib))


if __name__ == "__main__":
    main()
