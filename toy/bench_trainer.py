"""How fast is the trainer at a Qwen3 shape? `python -m toy.bench_trainer --shape qwen3-1.7b` (repo root).

Builds a Qwen3 model from its architecture config alone (random init: no download, no vLLM; it needs
only torch and transformers) and times the trainer's part of one MIPU step at a given micro-batch and
response length: recompute (no-grad log-probs of π_k), one Step-1 update (forward, backward, AdamW),
snapshot (snapshot_state) and rollback (restore_state, checked bit for bit). Prints seconds, tokens/s,
achieved TFLOP/s and peak memory per phase (on a GPU: torch's allocated and reserved peaks) next to
toy.memory_plan's estimates. fp32 matmuls run in train's precision (mipu.matmul_precision: TF32 for bf16-mixed on
a GPU).

`--plan-gpu-gib 80` only prints the memory plan for a GPU of that size (no model is built) and the
estimated trainer seconds of a step of `--responses` responses at `--assume-tflops`.

`--logprob-memory` instead measures the log-prob head alone, naive full-vocabulary log_softmax against
mipu.SelectiveLogprobs, values + backward, each in a fresh process (peak memory and seconds).
"""
import argparse
import datetime
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

import mipu
from toy import memory_plan

# Architecture shapes: Qwen/Qwen3-1.7B and Qwen/Qwen3-4B config.json on the Hugging Face Hub (public values;
# both tie lm_head to the embeddings); "tiny" is a CPU-sized model with the real 151,936-token vocabulary.
SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=151936, tie_word_embeddings=True),
}
PHASES = ("recompute", "update", "snapshot", "rollback")


def qwen3_config(shape: str):
    from transformers import Qwen3Config
    return Qwen3Config(**SHAPES[shape], max_position_embeddings=40960)   # 40960: Qwen3's own context length


def build_model(shape: str, cfg: mipu.Config):
    """A randomly initialised Qwen3 of `shape`, in cfg's precision, on cfg.device, checkpointing per cfg."""
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if cfg.train_dtype == "bfloat16" else torch.float32
    with torch.device(cfg.device):                         # initialise in place: no host copy of a 4B model
        model = AutoModelForCausalLM.from_config(qwen3_config(shape), dtype=dtype, attn_implementation="sdpa")
    if cfg.grad_checkpointing == "on":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.eval()


def step_flops(c, micro: int, prompt_len: int, response_len: int, checkpointing: bool) -> tuple[float, float]:
    """(recompute, update) FLOPs: 2 per weight per token, lm_head on response tokens only, causal attention
    2·s²·heads·head_dim per layer; backward = 2 forwards, +1 forward of the decoder (not the head: checkpointing
    recomputes the layers) with checkpointing, +1 head (SelectiveLogprobs' backward recomputes its logits)."""
    H, L, hd = c.hidden_size, c.num_hidden_layers, c.head_dim
    s = prompt_len + response_len
    per_layer = 2 * H * hd * (c.num_attention_heads + c.num_key_value_heads) + 3 * H * c.intermediate_size
    head = 2 * c.vocab_size * H * micro * response_len
    fwd = 2 * L * per_layer * micro * s + head + 2 * L * micro * s * s * c.num_attention_heads * hd
    return fwd, 3 * fwd + (fwd - head if checkpointing else 0) + head


def sync_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_gib(device: str) -> tuple[float, float | None]:
    """Peak memory since the last reset: (allocated, reserved) of torch's CUDA allocator on a GPU (reserved: what it
    took from the GPU, fragmentation included); (the process's peak RSS, None) on the CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, None    # KiB on Linux


def one_update(model, opt, batch: tuple, cfg: mipu.Config) -> None:
    """One Step-1 optimizer step on the micro-batch (as mipu.step1_update does for one micro-batch)."""
    prompts, completions, logp_old, adv = batch
    model.train()
    with mipu.train_autocast(cfg):
        logp, mask = mipu.token_logprobs(model, prompts, completions, 1.0, len(prompts), cfg.logprob_chunk)
    loss, _ = mipu.policy_loss(logp.float(), logp_old, logp_old, adv, mask, "tis")
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


def recompute(model, prompts, completions, cfg: mipu.Config) -> torch.Tensor:
    with torch.no_grad(), mipu.train_autocast(cfg):
        return mipu.token_logprobs(model, prompts, completions, 1.0, len(prompts), cfg.logprob_chunk)[0].float()


def timed(fn, device: str, *args) -> tuple[float, tuple, object]:
    """(seconds, peak GiB during the call as peak_gib's (allocated, reserved), result)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync_device(device)
    t0 = time.perf_counter()
    out = fn(*args)
    sync_device(device)
    return time.perf_counter() - t0, peak_gib(device), out


def bench(args: argparse.Namespace) -> str:
    """Build, warm up (one update fills AdamW's state, one snapshot allocates its buffers), then time each phase."""
    cfg = mipu.TrainConfig(device=args.device, train_dtype=args.train_dtype, grad_checkpointing=args.grad_checkpointing,
                      micro_batch_size=args.micro_batch, max_new_tokens=args.response_len,
                      max_model_len=args.prompt_len + args.response_len, logprob_chunk=args.logprob_chunk,
                      method="mipu", vllm_sleep="on" if args.device == "cuda" else "off",
                      gpu_memory_utilization=args.gpu_memory_utilization)
    torch.set_float32_matmul_precision(mipu.matmul_precision(cfg))   # as train: TF32 only for bf16-mixed on a GPU
    torch.manual_seed(args.seed)
    model = build_model(args.shape, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cfg.device == "cuda")
    V = SHAPES[args.shape]["vocab_size"]
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(V, (args.micro_batch, args.prompt_len), generator=gen).tolist()
    completions = torch.randint(V, (args.micro_batch, args.response_len), generator=gen).tolist()
    logp_old = recompute(model, prompts, completions, cfg)
    batch = (prompts, completions, logp_old, torch.randn(args.micro_batch, generator=gen).to(cfg.device))
    one_update(model, opt, batch, cfg)                                           # warm-up, not timed
    snapshot = mipu.snapshot_state(model, opt)
    times = {"recompute": timed(recompute, cfg.device, model, prompts, completions, cfg)}
    times["snapshot"] = timed(mipu.snapshot_state, cfg.device, model, opt, snapshot)
    snapshot = times["snapshot"][2]
    times["update"] = timed(one_update, cfg.device, model, opt, batch, cfg)
    times["rollback"] = timed(mipu.restore_state, cfg.device, model, opt, snapshot)
    exact = all(torch.equal(t.cpu(), snapshot[0][k]) for k, t in mipu.state_tensors(model, opt).items())
    return report(args, cfg, times, exact)


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def report(args, cfg: mipu.Config, times: dict, exact: bool) -> str:
    c = qwen3_config(args.shape)
    flops = dict(zip(("recompute", "update"), step_flops(c, args.micro_batch, args.prompt_len, args.response_len,
                                                       cfg.grad_checkpointing == "on")))
    tokens = args.micro_batch * (args.prompt_len + args.response_len)
    rows = [{"phase": p, "seconds": f"{times[p][0]:.3f}",
             "tokens/s": f"{tokens / times[p][0]:.0f}" if p in flops else "",
             "TFLOP/s": f"{flops[p] / times[p][0] / 1e12:.3g}" if p in flops else "",
             **({"peak GiB (allocated)": f"{times[p][1][0]:.2f}", "peak GiB (reserved)": f"{times[p][1][1]:.2f}"}
                if cfg.device == "cuda" else {"peak GiB (process RSS)": f"{times[p][1][0]:.2f}"})}
            for p in PHASES]
    gpu = torch.cuda.get_device_properties(0).total_memory if cfg.device == "cuda" else 0.0
    plan = memory_plan.memory_plan(c, cfg, gpu)
    return "\n".join([
        f"`python -m toy.bench_trainer --shape {args.shape} --micro-batch {args.micro_batch} --prompt-len "
        f"{args.prompt_len} --response-len {args.response_len}` on {device_name(cfg.device)}, "
        f"{datetime.date.today()}: train dtype {cfg.train_dtype}, checkpointing {cfg.grad_checkpointing}, "
        f"log-prob chunk {cfg.logprob_chunk}, matmul precision {torch.get_float32_matmul_precision()}; rollback bit "
        f"for bit: {'yes' if exact else 'NO'}", "",
        mipu.markdown_table(rows), "",
        "memory plan (estimated, GiB; vLLM's share counted at --gpu-memory-utilization "
        f"{cfg.gpu_memory_utilization} of this device): " + ", ".join(f"{k} {v:.2f}" for k, v in plan.items())])


def plan_only(args) -> str:
    """The memory plan and estimated trainer seconds per step on a GPU of args.plan_gpu_gib (nothing is run)."""
    cfg = mipu.TrainConfig(device="cuda", train_dtype=args.train_dtype, grad_checkpointing=args.grad_checkpointing,
                      micro_batch_size=args.micro_batch, max_new_tokens=args.response_len, method="mipu",
                      max_model_len=args.prompt_len + args.response_len, logprob_chunk=args.logprob_chunk,
                      gpu_memory_utilization=args.gpu_memory_utilization, rollout_quant=args.rollout_quant)
    # no check_flags: planning for a GPU needs none
    c = qwen3_config(args.shape)
    plan = memory_plan.memory_plan(c, cfg, args.plan_gpu_gib * 2**30)
    share, sequences = memory_plan.vllm_share(c, cfg, args.plan_gpu_gib * 2**30)
    fwd, upd = step_flops(c, 1, args.prompt_len, args.response_len, cfg.grad_checkpointing == "on")
    sec = {k: v * args.responses / (args.assume_tflops * 1e12) for k, v in (("recompute", fwd), ("update", upd))}
    return (f"{args.shape} on a {args.plan_gpu_gib:g} GiB GPU, micro-batch {args.micro_batch} x ({args.prompt_len} + "
            f"{args.response_len}) tokens, {cfg.train_dtype}, checkpointing {cfg.grad_checkpointing}, vLLM share "
            f"{share:.2f} ({cfg.gpu_memory_utilization}; its KV cache holds ~{sequences} sequences of "
            f"{cfg.max_model_len} tokens, rollout weights {cfg.rollout_quant}), vLLM asleep in Step 1: "
            f"{cfg.vllm_sleep}. Memory plan (estimated, GiB): "
            + ", ".join(f"{k} {v:.2f}" for k, v in plan.items()) + f". Trainer seconds per step of {args.responses} "
            f"responses at an assumed {args.assume_tflops:g} TFLOP/s (estimated): recompute {sec['recompute']:.0f}, "
            f"update {sec['update']:.0f}")


def logprob_memory_child(kind: str, n_tokens: int, hidden: int, vocab: int) -> None:
    """In a fresh process: peak memory growth and seconds of log-probs + backward for n_tokens positions."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n_tokens, hidden, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(vocab, (n_tokens,), generator=gen)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if kind == "naive":     # the whole-logits way: [N, V] fp32 logits, log_softmax, gather
        lp = torch.log_softmax((h @ w.T).float(), -1).gather(1, targets[:, None])[:, 0]
    else:
        lp = mipu.SelectiveLogprobs.apply(h, w, targets, 1.0, mipu.Config.logprob_chunk)
    lp.sum().backward()
    seconds = time.perf_counter() - t0
    print(f"{(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**10:.1f} {seconds:.3f}")


def logprob_memory(args) -> str:
    """Naive vs chunked log-prob head, each in a fresh process (CPU peak RSS is per process and never resets)."""
    n = args.micro_batch * args.response_len
    res = {}
    for kind in ("naive", "chunked"):
        p = subprocess.run([sys.executable, "-m", "toy.bench_trainer", "--logprob-child", kind, "--micro-batch",
                            str(args.micro_batch), "--response-len", str(args.response_len), "--hidden",
                            str(args.hidden)], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parent.parent)
        res[kind] = [float(x) for x in p.stdout.split()[-2:]]
    return (f"`python -m toy.bench_trainer --logprob-memory --micro-batch {args.micro_batch} --response-len "
            f"{args.response_len} --hidden {args.hidden}` ({n} positions, vocabulary 151,936, {device_name('cpu')}, "
            f"{datetime.date.today()}): log-probs + backward peak memory growth naive {res['naive'][0]:.0f} MiB, "
            f"chunked {res['chunked'][0]:.0f} MiB (ratio {res['chunked'][0] / res['naive'][0]:.3f}); seconds naive "
            f"{res['naive'][1]:.3f}, chunked {res['chunked'][1]:.3f} (speed ratio "
            f"{res['naive'][1] / res['chunked'][1]:.2f})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="tiny")
    p.add_argument("--micro-batch", type=int, default=4, help="responses per forward/backward")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per response")
    p.add_argument("--response-len", type=int, default=4096, help="response tokens (the paper's setting: 4096)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--train-dtype", default="auto", help="as mipu.py's --train-dtype")
    p.add_argument("--grad-checkpointing", default="auto", help="as mipu.py's --grad-checkpointing")
    p.add_argument("--logprob-chunk", type=int, default=mipu.Config.logprob_chunk)
    p.add_argument("--gpu-memory-utilization", default="auto", type=memory_plan.share,
                   help="vLLM's share in the plan: auto (toy.memory_plan's) or a fraction")
    p.add_argument("--rollout-quant", default="fp8", help="--plan-gpu-gib: as mipu.py's (vLLM's weights)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="also write the report to this file")
    p.add_argument("--logprob-memory", action="store_true", help="naive vs chunked log-prob head only")
    p.add_argument("--hidden", type=int, default=128, help="--logprob-memory: hidden size of the head")
    p.add_argument("--plan-gpu-gib", type=float, default=0.0, help="only print the plan for a GPU of this size")
    p.add_argument("--responses", type=int, default=256, help="--plan-gpu-gib: responses per step (32 x 8)")
    p.add_argument("--assume-tflops", type=float, default=400.0,
                   help="--plan-gpu-gib: achieved TFLOP/s assumed for the estimate (~40%% of H100's bf16 dense peak)")
    p.add_argument("--logprob-child", choices=("naive", "chunked"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.logprob_child:
        logprob_memory_child(args.logprob_child, args.micro_batch * args.response_len, args.hidden,
                             SHAPES["tiny"]["vocab_size"])
        return 0
    return mipu.report_errors(run, args)


def run(args: argparse.Namespace) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise mipu.MIPUError("--device cuda but no GPU is visible")
    if args.plan_gpu_gib:
        text = plan_only(args)
    else:
        text = logprob_memory(args) if args.logprob_memory else bench(args)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
