"""Tests of mipu.py: the math against hand-computed values, the toy end to end, the real
vLLM path on a tiny model, and the command line as a user runs it.

Run: python -m pytest -q test_mipu.py
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mipu

HERE = Path(__file__).resolve().parent
L = math.log


# ---------------------------------------------------------------- MIPU math

def test_group_advantages_hand_values():
    adv = mipu.group_advantages(torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 1]), 4)
    std = math.sqrt(0.25 * 0.75)                       # population std of (1, 0, 0, 0)
    expected = [0.75 / std] + [-0.25 / std] * 3 + [0.0] * 4 + [-1, 1, -1, 1]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-5)
    assert torch.allclose(adv.reshape(-1, 4).sum(1), torch.zeros(3), atol=1e-6)


def test_group_advantages_bad_group_size():
    with pytest.raises(mipu.MIPUError, match="groups of 4"):
        mipu.group_advantages(torch.ones(6), 4)


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


def test_unknown_loss_method():
    with pytest.raises(mipu.MIPUError, match="unknown policy-loss method"):
        mipu.policy_loss(*[torch.zeros(1, 1)] * 3, torch.ones(1), torch.ones(1, 1), "ppo")


def test_gap_proxy_hand_value():
    logp_new = torch.tensor([[0.2, 0.4], [-0.1, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    t = mipu.gap_proxy(logp_new, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), mask)
    assert t.item() == pytest.approx(-(math.exp(0.3) - math.exp(-0.1)) / 2, abs=1e-6)


def test_accept_rules():
    assert mipu.accept_candidate("paper", -0.05, float("nan"), 0.1)
    assert not mipu.accept_candidate("paper", -0.2, float("nan"), 0.1)
    assert mipu.accept_candidate("target", -0.2, 0.15, 0.1)       # -0.05 >= -0.1
    assert not mipu.accept_candidate("target", -0.2, 0.05, 0.1)


def test_mismatch_metrics_hand_values():
    lp_train = torch.log(torch.tensor([[0.5, 0.2]]))
    lp_sampler = torch.log(torch.tensor([[0.25, 0.2]]))
    m = mipu.mismatch_metrics(lp_train, lp_sampler, torch.ones(1, 2))
    assert m["k1"] == pytest.approx(-L(2) / 2, abs=1e-6)
    assert m["k3"] == pytest.approx((2 - 1 - L(2)) / 2, abs=1e-6)
    assert m["abs_dlogp_max"] == pytest.approx(L(2), abs=1e-6)
    assert m["abs_dp_max"] == pytest.approx(0.25, abs=1e-6)
    assert m["frac_outside_0.5_2"] == 0.0                        # ratio exactly 2 is inside
    two = mipu.mismatch_metrics(torch.zeros(2, 1), torch.tensor([[0.0], [-L(3)]]), torch.ones(2, 1))
    assert two["seq_ess"] == pytest.approx((1 + 3) ** 2 / (2 * (1 + 9)), abs=1e-6)
    assert two["frac_outside_0.5_2"] == 0.5


def test_fp8_roundtrip_is_coarse_but_close():
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    for per_row in (False, True):
        q = mipu.fp8_roundtrip(w, per_row)
        rel = ((q - w).abs() / w.abs().clamp(min=1e-3)).median().item()
        assert 0 < rel < 0.07                                  # e4m3: 3 mantissa bits


# ---------------------------------------------------------------- toy simulator

def small_cfg(**kw) -> mipu.Config:
    base = dict(steps=4, prompts_per_step=8, val_prompts=8, mini_batch_size=32, toy_prompts=16)
    return mipu.Config(**{**base, **kw}).validate()


def test_zero_mismatch_engines_identical():
    cfg = small_cfg()
    run = mipu.toy_init(cfg, 0.0)
    lp_pi, lp_mu = run.tables
    assert torch.equal(lp_pi, lp_mu) and run.J[0] == run.J[1]
    run8 = mipu.toy_init(cfg, 8.0)
    assert not torch.equal(*run8.tables)


def test_zero_mismatch_grpo_equals_tis_and_gap_is_zero():
    h_grpo = mipu.toy_run(small_cfg(steps=3, method="grpo"), 0.0)
    h_tis = mipu.toy_run(small_cfg(steps=3, method="tis"), 0.0)
    key = ["step1/loss", "exact/J_pi", "exact/J_mu", "rollout/reward"]
    assert [[m.get(k) for k in key] for m in h_grpo] == [[m.get(k) for k in key] for m in h_tis]
    h_mipu = mipu.toy_run(small_cfg(steps=3, method="mipu"), 0.0)
    assert all(m["step2/t_post"] == 0.0 and m["step2/accepted"] == 1.0 for m in h_mipu[1:])


def test_same_gradients_at_zero_mismatch():
    run = mipu.toy_init(small_cfg(), 0.0)
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


def test_exact_J_matches_monte_carlo():
    run = mipu.toy_init(small_cfg(), 8.0)
    for table, exact in zip(run.tables, run.J):
        assert exact == pytest.approx(mipu.toy_exact_J(table, run.targets, 2).mean(), abs=1e-12)
        n = 400
        prompt, tokens, _ = mipu.toy_sample(table, torch.arange(16).repeat(n), 1, run.gen)
        est = mipu.toy_reward(run.targets, prompt, tokens, 2).mean().item()
        se = math.sqrt(exact * (1 - exact) / prompt.numel())
        assert abs(est - exact) < 4 * se, (est, exact, se)


def test_rejection_restores_theta_and_optimizer_bit_for_bit():
    run = mipu.toy_init(small_cfg(method="mipu", c=1e9), 1.0)   # accept iff T_post >= -1e9: always
    mipu.toy_step(run, 0)                                  # an accepted step fills Adam's state
    run.cfg.c = -1e9                                       # accept iff T_post >= 1e9: never
    before = [p.detach().clone() for p in run.policy.parameters()]
    opt_before = json.dumps({k: [v.tolist() for v in s.values()] for k, s in run.opt.state_dict()["state"].items()})
    assert opt_before != "{}"
    J_before = run.J
    m = mipu.toy_step(run, 1)
    assert m["step2/accepted"] == 0.0 and m["step2/rejections"] == 1
    assert m["exact/cand_J_pi"] != J_before[0]             # the candidate did move
    assert all(torch.equal(a, b) for a, b in zip(before, run.policy.parameters()))
    assert json.dumps({k: [v.tolist() for v in s.values()] for k, s in run.opt.state_dict()["state"].items()}) == opt_before
    assert run.J == J_before


def test_seed_reproduces_run_bit_for_bit():
    cfg = small_cfg(method="mipu", accept_rule="target")
    a, b = mipu.toy_run(cfg, 8.0), mipu.toy_run(cfg, 8.0)
    assert json.dumps(a) == json.dumps(b)
    c = mipu.toy_run(small_cfg(method="mipu", accept_rule="target", seed=1), 8.0)
    assert json.dumps(a) != json.dumps(c)


def test_random_rollback_rate():
    h = mipu.toy_run(small_cfg(method="random-rollback", reject_rate=0.5, steps=40), 1.0)
    rate = 1 - sum(m["step2/accepted"] for m in h[1:]) / 40
    assert 0.25 < rate < 0.75


@pytest.mark.parametrize("kw, message", [
    (dict(num_generations=1), "num-generations"),
    (dict(method="grpo", accept_rule="target"), "accept-rule target"),
    (dict(method="tis", reject_rate=0.3), "reject-rate"),
    (dict(w_max=0.5), "w-max"),
])
def test_bad_config(kw, message):
    with pytest.raises(mipu.MIPUError, match=message):
        mipu.Config(**kw).validate()


# ---------------------------------------------------------------- command line

def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, str(HERE / "mipu.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=HERE)


def test_cli_toy_tiny_budget(tmp_path):
    p = run_cli("toy", "--steps", "3", "--toy-seeds", "2", "--toy-preset", "severe", "--toy-workers", "1",
                "--toy-prompts", "16", "--prompts-per-step", "8", "--val-prompts", "8", "--toy-out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    for name in ("demo_results.md", "demo_results.csv", "demo_curves.png"):
        assert (tmp_path / name).stat().st_size > 0
    table = (tmp_path / "demo_results.md").read_text()
    for label in mipu.TOY_DEMO_METHODS:
        assert f"| {label} |" in table
    assert "random-rollback" in table and "sign agreement" in table


@pytest.mark.parametrize("args, message", [
    (["toy", "--num-generations", "1"], "error: --num-generations must be >= 2"),
    (["toy", "--method", "ppo"], "invalid choice: 'ppo'"),
    (["toy", "--steps", "many"], "invalid int value: 'many'"),
    (["toy", "--method", "tis", "--accept-rule", "target"], "error: --accept-rule target only applies"),
])
def test_cli_bad_input_one_clear_error(args, message):
    p = run_cli(*args)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr
