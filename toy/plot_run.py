"""How did a run go? Its curves from its files alone: `python -m toy.plot_run RUN_DIR` (from the repo root).

Reads RUN_DIR/metrics.jsonl (what `python mipu.py train --output-dir RUN_DIR` appends, one record per
step) and writes RUN_DIR/metrics.png (or --out): rollout reward, J(mu) on each --eval-data set,
mismatch k3 before/after the update, T_post with accepted/rejected steps, the acceptance rate, and
the seconds per phase of a step. Copy metrics.jsonl off a remote GPU machine and plot it here.

Did runs collapse? `python -m toy.plot_run --compare RUN_DIR_OR_JSONL... --out PNG` draws their held-out
pass@1 and the 10-step means of the batch reward, k3, ESS, T_post and acceptance against step in one figure,
and prints a markdown row per run: best and final of pass@1 and batch reward, whether each collapsed
(COLLAPSE_SHARE), and k3, the sequence ESS and the gradient norm over its first and last 10 steps.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

import mipu

PHASES = ("rollout", "recompute", "update", "sync", "gap_check", "rollback")   # mipu.Laps.times()
WINDOW = 10   # steps in the running acceptance rate: long enough to smooth 0/1 decisions, short enough to show trends
# collapsed: the curve's last COLLAPSE_TAIL steps all below COLLAPSE_SHARE x its best (the collapse issue's definition:
# "falls below half of its best and stays there to the end"; two evaluations at --eval-every 10)
COLLAPSE_SHARE, COLLAPSE_TAIL = 0.5, 20


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl (or of a metrics file itself) in step order (a resumed run's repeated
    steps: the last one wins)."""
    path = run_dir if run_dir.suffix == ".jsonl" else run_dir / "metrics.jsonl"
    if not path.is_file():
        raise mipu.MIPUError(f"no metrics.jsonl in {run_dir}")
    by_step = {}
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                m = json.loads(line)
            except json.JSONDecodeError as e:
                raise mipu.MIPUError(f"{path}:{lineno}: malformed JSON ({e.msg})") from e
            if isinstance(m, dict) and isinstance(m.get("step"), int):   # a user's own line is kept by train: skip
                by_step[m["step"]] = m
    if not by_step:
        raise mipu.MIPUError(f"{path} is empty")
    return [by_step[k] for k in sorted(by_step)]


def series(ms: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that have `key`."""
    pts = [(m["step"], m[key]) for m in ms if key in m]
    return (np.array([p[0] for p in pts]), np.array([p[1] for p in pts], dtype=float))


def draw_panels(axes, ms: list[dict]) -> None:
    """The six panels, each titled; a panel whose keys the run lacks says so."""
    panels = {
        "rollout reward (mu_k samples)": [("rollout/reward", "train"), ("step2/val_reward", "Step-2 samples")],
        "J(mu): eval pass@1": [(k, k.split("/")[1]) for k in sorted({k for m in ms for k in m if k[:5] == "eval/"})],
        "mismatch k3 KL(mu||pi)": [("mismatch/k3", "before update"), ("mismatch_post/k3", "after (Step 2)")],
        "T_post (x = rejected)": [("step2/t_post", "T_post")],
    }
    for ax, (title, keys) in zip(axes[:4], panels.items()):
        for key, label in keys:
            x, y = series(ms, key)
            if len(x) and not np.isnan(y).all():
                ax.plot(x, y, label=label, marker="." if len(x) < 50 else None)
        ax.set_title(title)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not in this run", ha="center", va="center", transform=ax.transAxes)
    x, t_post = series(ms, "step2/t_post")
    _, accepted = series(ms, "step2/accepted")
    rejected = accepted == 0
    axes[3].scatter(x[rejected], np.nan_to_num(t_post[rejected]), marker="x", color="red", zorder=3)
    axes[4].plot(x, running_mean(accepted))
    axes[4].set_ylim(-0.05, 1.05)
    axes[4].set_title(f"acceptance rate (last {WINDOW} steps)")
    bottom = np.zeros(len(ms))
    for phase in PHASES:
        y = np.array([m.get(f"time/{phase}", 0.0) for m in ms])
        axes[5].fill_between([m["step"] for m in ms], bottom, bottom + y, label=phase, step="mid")
        bottom += y
    axes[5].set_title("seconds per step, by phase")
    axes[5].legend(fontsize=7)


def plot_run(run_dir: Path, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ms = read_metrics(run_dir)
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    draw_panels(axes.ravel(), ms)
    for ax in axes.ravel():
        ax.set_xlabel("step")
    fig.suptitle(f"{run_dir.name}: {len(ms)} steps")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def running_mean(y: np.ndarray, n: int = WINDOW) -> np.ndarray:
    """Mean of the last n values at each point (fewer at the start); a run without the key: empty."""
    if not len(y):                      # np.convolve refuses an empty array
        return y
    return np.convolve(y, np.ones(n), "full")[:len(y)] / np.minimum(np.arange(1, len(y) + 1), n)


def curves(ms: list[dict]) -> dict:
    """label -> (steps, values): the held-out pass@1 (the first --eval-data set, by name; empty without one) and the
    WINDOW-step mean batch reward."""
    key = min((k for m in ms for k in m if k.startswith("eval/")), default=None)
    x, r = series(ms, "rollout/reward")
    return {"pass@1": series(ms, key) if key else (np.array([]), np.array([])), "reward": (x, running_mean(r))}


def collapsed(x: np.ndarray, y: np.ndarray) -> bool:
    """The last COLLAPSE_TAIL steps' values all below COLLAPSE_SHARE x the best."""
    return bool(len(y)) and bool((y[x > x[-1] - COLLAPSE_TAIL] < COLLAPSE_SHARE * y.max()).all())


def run_summary(name: str, ms: list[dict], run_curves: dict) -> dict:
    """One search-log row: best/final of `curves`' two, collapsed or not, and k3, ESS and the gradient norm over
    the first and last WINDOW steps."""
    row = {"run": name, "steps": len(ms)}
    for label, (x, y) in run_curves.items():
        best = int(np.argmax(y)) if len(y) else None
        row |= {f"best {label}": f"{y[best]:.3f} (step {x[best]})" if len(y) else "-",
                f"final {label}": f"{y[-1]:.3f}" if len(y) else "-",
                f"collapsed ({label})": "yes" if collapsed(x, y) else "no"}
    for key, label in (("mismatch/k3", "k3"), ("mismatch/seq_ess", "ESS"), ("step1/grad_norm", "grad norm")):
        y = series(ms, key)[1]
        row[f"{label} start / end"] = f"{np.nanmean(y[:WINDOW]):.3g} / {np.nanmean(y[-WINDOW:]):.3g}" if len(y) else "-"
    return row


def plot_compare(paths: list[Path], out: Path) -> list[dict]:
    """The runs against step in one PNG: held-out pass@1, and the WINDOW-step means of the batch reward, k3, the
    sequence ESS and T_post (x: a rejected candidate, at its own T_post); their summary rows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    axes = axes.ravel()
    rows = []
    for path in paths:
        ms = read_metrics(path)
        name = path.parent.name if path.name == "metrics.jsonl" else path.stem if path.suffix == ".jsonl" else path.name
        run_curves = curves(ms)
        rows.append(run_summary(name, ms, run_curves))
        means = [(x, running_mean(y)) for x, y in (series(ms, k) for k in ("mismatch/k3", "mismatch/seq_ess",
                                                                           "step2/t_post", "step2/accepted"))]
        for ax, (x, y) in zip(axes, [*run_curves.values(), *means]):
            if len(x) and not np.isnan(y).all():
                ax.plot(x, y, marker="." if len(x) < 50 else None, label=name)
        x, t_post = series(ms, "step2/t_post")
        rejected = series(ms, "step2/accepted")[1] == 0
        if rejected.any():
            axes[4].scatter(x[rejected], np.nan_to_num(t_post[rejected]), marker="x", s=12,
                            color=axes[4].lines[-1].get_color())
    titles = ("held-out pass@1 (--eval-data)", "batch reward", "k3 KL(mu||pi) before the update", "sequence ESS",
              "T_post (Step 2; x = rejected)", "acceptance rate")
    for ax, title in zip(axes, titles):
        ax.set_title(title if ax is axes[0] else f"{title}, {WINDOW}-step mean")
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    axes[4].axhline(0, color="gray", lw=0.5)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return rows


def plot_command(args: argparse.Namespace) -> None:
    if args.compare and args.run_dir:
        raise mipu.MIPUError("give RUN_DIR or --compare RUN_DIR..., not both")
    if args.compare:
        rows = plot_compare(args.compare, args.out or Path("compare.png"))
        print(mipu.markdown_table(rows))
        print(f"wrote {args.out or 'compare.png'}")
        return
    if args.run_dir is None:
        raise mipu.MIPUError("give RUN_DIR, or --compare RUN_DIR...")
    print(f"wrote {plot_run(args.run_dir, args.out or args.run_dir / 'metrics.png')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, nargs="?", help="a --output-dir of `python mipu.py train`")
    parser.add_argument("--compare", type=Path, nargs="+", metavar="RUN", help="runs (output dirs or their "
                        "metrics .jsonl files) drawn together, with a summary row each")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: RUN_DIR/metrics.png; "
                        "compare.png)")
    args = parser.parse_args()
    return mipu.report_errors(plot_command, args)


if __name__ == "__main__":
    sys.exit(main())
