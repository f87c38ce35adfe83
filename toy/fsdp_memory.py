"""Estimated GPU memory per rank of `torchrun --nproc_per_node N mipu.py train` (FSDP2), no GPU needed:
`python -m toy.fsdp_memory` (from the repo root). An ESTIMATE from arithmetic, not a measurement.

Counts the parameters of the model shape exactly (built on torch's meta device, no download) and applies
--train-dtype bf16-mixed (the GPU default): fp32 weights, fp32 gradients and two fp32 AdamW states, all
sharded over N ranks by FSDP2; plus what every rank holds whole: the root module (embeddings, final norm,
lm_head; FSDP2 keeps it gathered from forward to backward), two gathered decoder layers (the one computing
and the one prefetched), and during a sync the engine-dtype (bf16) copy of all weights handed to vLLM.
Not included: activations (per micro-batch, the same as on one GPU), vLLM's own share
(--gpu-memory-utilization x the GPU), CUDA/NCCL workspaces. The rollback snapshot lives in host RAM.
"""
import argparse

import torch

# Qwen3-4B's published config.json (Qwen/Qwen3-4B on the HF hub)
QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
GIB = 2 ** 30


def estimate(world: int) -> dict:
    """GiB per rank for `world` ranks: {part: GiB}."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_4B))
    total = sum(p.numel() for p in model.parameters())                       # tied lm_head counted once
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    root = total - layer * len(model.model.layers)
    fp32 = 4
    return {"params (B)": total / 1e9, "weights": total * fp32 / world / GIB, "grads": total * fp32 / world / GIB,
            "adamw": 2 * total * fp32 / world / GIB, "gathered root + 2 layers": (root + 2 * layer) * fp32 / GIB,
            "sync bf16 copy": total * 2 / GIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", default="1,2,4,8", help="comma-separated world sizes")
    args = parser.parse_args()
    rows = {n: estimate(n) for n in (int(x) for x in args.gpus.split(","))}
    keys = list(next(iter(rows.values())))
    print("| GPUs | " + " | ".join(keys) + " | total during Step 1 | peak at a sync |")
    print("|---" * (len(keys) + 3) + "|")
    for n, r in rows.items():
        step1 = r["weights"] + r["grads"] + r["adamw"] + r["gathered root + 2 layers"]
        sync = r["weights"] + r["adamw"] + r["sync bf16 copy"]
        print(f"| {n} | " + " | ".join(f"{r[k]:.2f}" for k in keys) + f" | {step1:.1f} | {sync:.1f} |")


if __name__ == "__main__":
    main()
