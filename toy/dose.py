"""SmolLM2 under a dose of FP8 error (RESULTS "SmolLM2 under a dose of FP8 error"): `--fp8-sim-dose α` pushes
θ + α(fp8(θ) − θ) to vLLM, so the engines' mismatch grows with α. Two commands, each run one at a time:

    python -m toy.dose calibrate --alphas 0,1,2,3,4,6   # μ's pass@1 at θ_0 and k3 / ESS against α
    python -m toy.dose run --alpha 1 --method step2 --seed 21 -- --c 1e9   # one search run
    python -m toy.dose mechanism toy/results/dose/step2_*.jsonl             # does T̂_post foretell the reward?

calibrate: for each α, `mipu.py eval` (all 256 sums_val problems × 4 samples at θ_0) and a 4-step grpo run (its
k3 and sequence ESS averaged over the 4 steps); a row per α to toy/results/dose/calibration.md as each lands, then
toy/results/dose_calibration.png. run: `mipu.py train` with the collapse search's flags (the answer-only suffix, 24
tokens, 8 × 8, held-out eval every 10 steps) and two optimizer steps a batch (mini-batch 32); its metrics copied to
toy/results/dose/NAME.jsonl every 30 s; stopped (Ctrl-C: at the next step) once the held-out curve is `collapsed`
(toy.plot_run's rule: its last 20 steps below half its best, i.e. at the second low evaluation in a row).
Any other `mipu.py train` flag passes through after `--`. `--method step2 -- --c 1e9` is grpo's update with Step 2
measured and every candidate kept: grpo's run, with T̂_post logged at each step (the mechanism), at Step 2's cost.
mechanism: a row per run: T̂_post's mean over three stretches of steps, and its correlation with the batch reward's
change after the step (the mean of the next LAG batches' minus the last LAG's, these included), a 95 % interval
(Fisher's z; at lag 10 neighbouring changes share batches, so that interval is too narrow).
"""
import argparse
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

import mipu
from toy.plot_run import collapsed, curves, read_metrics, series

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "dose"
DATA = HERE / "data"
# The collapse search's task (RESULTS "SmolLM2: looking for the paper's collapse"), fp8-sim at a dose
COMMON = ["--model", str(HERE / "models" / "smollm2-135m-instruct"), "--answer-format", "last-number",
          "--prompt-suffix", " Answer with the number only.", "--max-new-tokens", "24", "--vllm-compile", "off",
          "--rollout-quant", "fp8-sim"]
TRAIN = ["--train-data", str(DATA / "sums_train.jsonl"), "--val-data", str(DATA / "sums_val.jsonl"),
         "--prompts-per-step", "8", "--val-prompts", "8", "--learning-rate", "3e-5", "--mini-batch-size", "32"]
CALIBRATION_SEED = 20   # the 4-step runs; no other table uses it (eval samples with its own fixed seed)


def mipu_cli(*args: str) -> list[str]:
    return [sys.executable, str(HERE.parent / "mipu.py"), *args]


def watch(cmd: list[str], run_dir: Path, copy_to: Path, stop_on_collapse: bool, poll: float = 30) -> int:
    """Run `cmd` (a train), copying run_dir/metrics.jsonl to copy_to every `poll` s and at the end; Ctrl-C it (it
    stops at its next step, checkpointed) once its held-out curve is collapsed, if asked. Its exit code."""
    print(" ".join(cmd), flush=True)
    proc, stopped = subprocess.Popen(cmd), False
    try:
        while True:
            try:
                rc = proc.wait(timeout=poll)
            except subprocess.TimeoutExpired:
                rc = None
            if (run_dir / "metrics.jsonl").is_file():
                shutil.copyfile(run_dir / "metrics.jsonl", copy_to)
                try:
                    x, y = curves(read_metrics(copy_to))["pass@1"]
                except mipu.MIPUError:          # empty, or a line half written: the next poll reads it whole
                    x, y = [], []
                if stop_on_collapse and not stopped and len(y) > 2 and collapsed(x, y):
                    print(f"collapsed by step {x[-1]}: stopping", flush=True)
                    proc.send_signal(signal.SIGINT)
                    stopped = True
            if rc is not None:
                return rc
    finally:                                    # this script stopped (Ctrl-C, an error): not the run unwatched
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait()


def calibrate(args) -> None:
    """Each α of --alphas: eval's pass@1 at θ_0 and a 4-step run's mean k3 and ESS, a row of calibration.md each."""
    OUT.mkdir(parents=True, exist_ok=True)
    table = OUT / "calibration.md"      # a row per α as it lands; a later call adds its α's rows
    if not table.exists():
        table.write_text("| α | pass@1 at θ_0 (256 × 4) | k3 (4 steps) | seq ESS (4 steps) |\n|---|---|---|---|\n")
    for alpha in filter(None, args.alphas.split(",")):      # --alphas "": the figure again, from the table
        dose = ["--fp8-sim-dose", alpha]
        ev = subprocess.run(mipu_cli("eval", *COMMON, *dose, "--eval-data", str(DATA / "sums_val.jsonl"),
                                     "--eval-samples", "4"),
                            capture_output=True, text=True)
        if ev.returncode:
            raise mipu.MIPUError(f"eval at α {alpha} failed: {ev.stderr.strip().splitlines()[-1:]}")
        pass1 = float([line for line in ev.stdout.splitlines() if line.startswith("| sums_val")][0].split("|")[-2])
        run_dir = Path(args.runs) / f"calib_a{alpha}"
        copy = OUT / f"calib_a{alpha}.jsonl"
        if watch(mipu_cli("train", *COMMON, *TRAIN, *dose, "--method", "grpo", "--steps", "4", "--seed",
                          str(CALIBRATION_SEED), "--save-every", "4", "--output-dir", str(run_dir), "--overwrite"),
                 run_dir, copy, stop_on_collapse=False):
            raise mipu.MIPUError(f"the calibration run at α {alpha} failed")
        ms = read_metrics(copy)
        k3, ess = (float(np.mean(series(ms, k)[1])) for k in ("mismatch/k3", "mismatch/seq_ess"))
        with table.open("a") as f:
            f.write(f"| {alpha} | {pass1:.3f} | {k3:.4f} | {ess:.3f} |\n")
    rows = sorted(tuple(map(float, line.split("|")[1:5])) for line in table.read_text().splitlines()[2:])
    plot_calibration(rows, HERE / "results" / "dose_calibration.png")


def plot_calibration(rows: list[tuple], out: Path) -> None:
    """pass@1, k3 (log scale) and the sequence ESS against α, with α_hi's rule's lines; rows: (α, pass@1, k3,
    ESS)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    a, pass1, k3, ess = map(np.array, zip(*rows))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, y, title in zip(axes, (pass1, k3, ess), ("μ's pass@1 at θ_0", "k3 KL(μ‖π), 4 steps",
                                                     "sequence ESS, 4 steps")):
        ax.plot(a, y, marker="o")
        ax.set_title(title)
        ax.set_xlabel("dose α (fp8-sim's error × α)")
    axes[0].axhline(pass1[a == 0].mean() / 2, ls="--", color="gray", label="half of α = 0's (α_hi's rule)")
    axes[2].axhline(0.1, ls="--", color="gray", label="0.1 (α_hi's rule)")
    for ax in axes[[0, 2]]:
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


def run(args, extra: list[str]) -> None:
    """One search run, watched (see the module docstring); an error if it exits with other than 0."""
    OUT.mkdir(parents=True, exist_ok=True)
    name = args.name or f"{args.method}_a{args.alpha}_s{args.seed}"
    run_dir = Path(args.runs) / name
    rc = watch(mipu_cli("train", *COMMON, *TRAIN, "--fp8-sim-dose", args.alpha, "--method", args.method,
                        "--seed", str(args.seed), "--steps", str(args.steps), "--eval-every", "10",
                        "--eval-data", str(DATA / "sums_val.jsonl"), "--eval-samples", "1", "--save-every", "10",
                        "--output-dir", str(run_dir), *extra), run_dir, OUT / f"{name}.jsonl", stop_on_collapse=True)
    if rc:
        raise mipu.MIPUError(f"the run {name} exited with code {rc}")


STRETCHES, LAGS = ((0, 10), (10, 50), (50, None)), (1, 10)    # the start, the climb, the rest; a step and a stretch


def mechanism(paths: list[Path]) -> list[dict]:
    """A row per Step-2 run (see the module docstring)."""
    rows = []
    for path in paths:
        ms = read_metrics(path)
        t, reward = series(ms, "step2/t_post")[1], series(ms, "rollout/reward")[1]
        if not len(t) == len(reward) == len(ms) or np.isnan(t).any():
            raise mipu.MIPUError(f"{path}: a step without T_post (not a Step-2 run?)")
        row = {"run": path.stem}
        for a, b in STRETCHES:
            x = t[a:b]
            se = x.std(ddof=1) / np.sqrt(len(x))
            row[f"T̂_post, steps {a}-{(b or len(t)) - 1}"] = f"{x.mean():+.4f} ± {se:.4f}"
        for lag in LAGS:
            k = np.arange(lag - 1, len(t) - lag)
            change = [reward[i + 1:i + 1 + lag].mean() - reward[i + 1 - lag:i + 1].mean() for i in k]
            r, half = np.corrcoef(t[k], change)[0, 1], 1.96 / np.sqrt(len(k) - 3)     # Fisher's z interval
            lo, hi = np.tanh(np.arctanh(r) - half), np.tanh(np.arctanh(r) + half)
            row[f"r(T̂_post, Δreward), lag {lag}"] = f"{r:+.2f} [{lo:+.2f}, {hi:+.2f}]"
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("calibrate", allow_abbrev=False)   # `--alpha` would abbreviate `--alphas`
    c.add_argument("--alphas", default="0,1,2,3,4,6", help="comma-separated doses (the issue's; \"\": redraw the "
                                                          "figure only)")
    r = sub.add_parser("run", allow_abbrev=False)
    r.add_argument("--alpha", required=True, help="the dose, --fp8-sim-dose")
    r.add_argument("--method", default="grpo", help="train's --method (step2 with -- --c 1e9: grpo, T_post logged)")
    r.add_argument("--seed", type=int, required=True, help="train's --seed (fresh seeds: 21 and up)")
    r.add_argument("--steps", type=int, default=100, help="at most (the issue's 100)")
    r.add_argument("--name", default="", help="results name (default METHOD_aALPHA_sSEED)")
    m = sub.add_parser("mechanism", allow_abbrev=False)
    m.add_argument("files", type=Path, nargs="+", help="Step-2 runs' metrics (toy/results/dose/*.jsonl)")
    for q in (c, r):
        q.add_argument("--runs", default="runs/dose", help="the train runs' output dirs go under this")
    args, extra = p.parse_known_args()
    if args.command != "run" and extra:             # only `run` passes flags on to train
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "calibrate":
        return mipu.report_errors(calibrate, args)
    if args.command == "mechanism":
        return mipu.report_errors(lambda: print(mipu.markdown_table(mechanism(args.files))))
    return mipu.report_errors(run, args, [x for x in extra if x != "--"])


if __name__ == "__main__":
    sys.exit(main())
