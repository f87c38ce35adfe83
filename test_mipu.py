"""Tests of mipu.py: the math against hand-computed values, the toy end to end, the real
vLLM path on a tiny model, and the command line as a user runs it.

Run: python -m pytest -q test_mipu.py
"""
import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import mipu
from toy import bench, demo
from toy.make_tiny import build_tiny_model, make_arith_rows, write_jsonl

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
    opt_after = json.dumps({k: [v.tolist() for v in s.values()] for k, s in run.opt.state_dict()["state"].items()})
    assert opt_after == opt_before
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
    (dict(temperature=0.0), "--temperature must be > 0"),
    (dict(gpu_memory_utilization=1.5), "gpu-memory-utilization"),
])
def test_bad_config(kw, message):
    with pytest.raises(mipu.MIPUError, match=message):
        mipu.Config(**kw).validate()


# ---- collapse mechanisms (toy flags), the oracle acceptance, --c-se, random-rollback-tis

def test_toy_defaults_unchanged_by_new_flags():
    """Numbers recorded with the code before these flags existed (main at a925e18)."""
    for extra in ({}, dict(toy_logit_fp8="off", toy_fp8_headroom=1.0, c_se=0.0)):
        h = mipu.toy_run(small_cfg(steps=5, method="mipu", **extra), 8.0)
        assert (h[-1]["exact/J_mu"], h[-1]["exact/J_pi"], h[-1]["step2/t_post"]) == (
            0.1429170779442922, 0.1432715917307567, 0.003594560083001852)


@pytest.mark.parametrize("kw", [dict(toy_vocab=3, toy_horizon=6, toy_tolerance=1),
                                dict(toy_vocab=4, toy_horizon=6, toy_tolerance=2, toy_logit_fp8="static")])
def test_toy_exact_J_matches_enumeration(kw):
    import itertools
    cfg = small_cfg(toy_prompts=3, toy_init_prob=0.6, **kw)
    run = mipu.toy_init(cfg, 1.0)
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


def test_toy_exact_J_matches_monte_carlo_long_horizon():
    cfg = small_cfg(toy_vocab=64, toy_horizon=16, toy_tolerance=4, toy_init_prob=0.7, toy_prompts=8)
    run = mipu.toy_init(cfg, 8.0)
    for table, exact in zip(run.tables, run.J):
        prompt, tokens, _ = mipu.toy_sample(table, torch.arange(8).repeat(500), 1, run.gen)
        est = mipu.toy_reward(run.targets, prompt, tokens, 4).mean().item()
        assert abs(est - exact) < 4 * math.sqrt(exact * (1 - exact) / prompt.numel()) and 0.05 < exact < 0.95


def toy_k3(lp_pi: torch.Tensor, lp_mu: torch.Tensor) -> float:
    """Mean over contexts of E_mu[pi/mu - 1 - log pi/mu]."""
    d = lp_pi - lp_mu
    return (lp_mu.exp() * (d.exp() - 1 - d)).sum(-1).mean().item()


def test_toy_logit_fp8_error_grows_with_logit_magnitude():
    for mode in ("dynamic", "static"):
        run = mipu.toy_init(small_cfg(toy_logit_fp8=mode), 1.0)
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


def test_oracle_rule_keeps_J_mu_monotone_and_is_toy_only():
    h = mipu.toy_run(small_cfg(method="step2", accept_rule="oracle", steps=12), 8.0)
    for prev, m in zip(h, h[1:]):
        assert m["step2/accepted"] == float(m["exact/cand_J_mu"] >= prev["exact/J_mu"])
        assert m["exact/J_mu"] >= prev["exact/J_mu"]
    assert 0 < sum(m["step2/accepted"] for m in h[1:]) < 12
    with pytest.raises(mipu.MIPUError, match="accept-rule oracle"):
        small_cfg(method="grpo", accept_rule="oracle")
    for kw in (dict(accept_rule="oracle"), dict(c_se=2.0)):
        with pytest.raises(mipu.MIPUError, match="toy only"):
            mipu.check_llm_flags(small_cfg(method="mipu", **kw), "train")


def test_toy_new_flags_reproduce_bit_for_bit():
    kw = dict(method="step2", accept_rule="oracle", toy_vocab=16, toy_logit_fp8="static", toy_fp8_headroom=1.5)
    a, b = mipu.toy_run(small_cfg(**kw), 1.0), mipu.toy_run(small_cfg(**kw), 1.0)
    assert json.dumps(a) == json.dumps(b)
    assert json.dumps(a) != json.dumps(mipu.toy_run(small_cfg(**kw, seed=1), 1.0))


def test_c_se_rejects_only_when_significantly_below():
    paper = mipu.toy_run(small_cfg(method="mipu", steps=8), 8.0)
    assert any(m["step2/accepted"] == 0.0 for m in paper[1:])
    lenient = mipu.toy_run(small_cfg(method="mipu", steps=8, c_se=1e9), 8.0)
    assert all(m["step2/accepted"] == 1.0 for m in lenient[1:])
    run = mipu.toy_init(small_cfg(), 8.0)
    t, se = mipu.toy_gap_check(run, 8, torch.Generator().manual_seed(0))
    assert 0 < se < 1 and t == mipu.toy_gap_check(run, 8, torch.Generator().manual_seed(0))[0]


def test_random_rollback_tis_uses_the_tis_update():
    tis = mipu.toy_run(small_cfg(method="tis", steps=1), 8.0)
    rr_tis = mipu.toy_run(small_cfg(method="random-rollback-tis", steps=1), 8.0)
    rr = mipu.toy_run(small_cfg(method="random-rollback", steps=1), 8.0)
    assert rr_tis[1]["exact/cand_J_mu"] == tis[1]["exact/cand_J_mu"] != rr[1]["exact/cand_J_mu"]
    h = mipu.toy_run(small_cfg(method="random-rollback-tis", reject_rate=0.5, steps=40), 1.0)
    assert 0.25 < 1 - sum(m["step2/accepted"] for m in h[1:]) / 40 < 0.75



N_PROMPTS, N_SAMPLES, MAX_NEW = 16, 8, 16  # the rollout shape timed in the report
TEMPERATURE = 1.0
# bf16 engine vs fp32 trainer on the tiny model measured max 0.0096 / mean 0.0016 (step 0);
# the bounds leave ~5x headroom for other CPUs (AVX2 vs AVX-512 kernels)
MAX_TOL, MEAN_TOL = 0.05, 0.01


# ---------------------------------------------------------------- LLM path: fixtures (one vLLM engine per session)


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
    return mipu.make_sampler(model_dir, "bfloat16", seed=0, gpu_memory_utilization=0.5,
                          max_model_len=256, rollout_quant="none")


@pytest.fixture(scope="session")
def trainer(model_dir):
    return mipu.load_trainer(model_dir, "float32", "cpu")


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[list[int]]:
    rows = make_arith_rows(N_PROMPTS, seed=0)
    return [mipu.build_prompt_ids(tokenizer, r["prompt"]) for r in rows]


@pytest.fixture()
def restore(llm, trainer):
    """Give the test a snapshot of the step-0 weights; put them back in both engines after."""
    snapshot = [(n, p.detach().clone()) for n, p in trainer.named_parameters()]
    yield snapshot
    with torch.no_grad():
        for (_, p), (_, old) in zip(trainer.named_parameters(), snapshot):
            p.copy_(old)
    mipu.sync_weights(llm, snapshot, "none")


def _mismatch(samples: list[dict], model) -> tuple[float, float]:
    """(max, mean) |sampler logprob - trainer logprob| over all sampled tokens."""
    with torch.no_grad():
        logp, mask = mipu.token_logprobs(model, [s["prompt_ids"] for s in samples],
                                      [s["completion_ids"] for s in samples],
                                      TEMPERATURE, micro_batch=64)  # [B, T]
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


# ---------------------------------------------------------------- data & reward


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


@pytest.mark.parametrize("text, match", [
    ('{"prompt": "a", "answer": "1"}\n{bad json\n', r"b\.jsonl:2: malformed JSON"),
    ('[1, 2]\n', r"b\.jsonl:1: row is a list"),
    ('{"prompt": "a", "ans": "1"}\n', r"b\.jsonl:1: missing key 'answer'; keys present: \['ans', 'prompt'\]"),
    ('{"prompt": "  ", "answer": "1"}\n', r"b\.jsonl:1: prompt key 'prompt' is empty"),
    ('{"prompt": "a", "answer": ""}\n', r"b\.jsonl:1: answer key 'answer' is empty"),
    ('\n\n', r"is empty"),
])
def test_load_rows_errors(tmp_path, text, match):
    src = _write(tmp_path / "b.jsonl", text)
    with pytest.raises(mipu.MIPUError, match=match):
        mipu.load_rows(src, "prompt", "answer")


def test_load_rows_missing_file_and_missing_libs(tmp_path):
    with pytest.raises(mipu.MIPUError, match="data file not found"):
        mipu.load_rows(str(tmp_path / "nope.jsonl"), "prompt", "answer")
    with pytest.raises(mipu.MIPUError, match="unsupported file type '.csv'"):
        mipu.load_rows(_write(tmp_path / "d.csv", "prompt,answer\n"), "prompt", "answer")
    pq = tmp_path / "x.parquet"
    pq.write_bytes(b"PAR1")
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(mipu.MIPUError, match="pandas"):
            mipu.load_rows(str(pq), "prompt", "answer")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(mipu.MIPUError, match="pip install datasets"):
            mipu.load_rows("someorg/somedata:train", "prompt", "answer")


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
])
def test_math_reward(completion, answer, reward):
    assert mipu.math_reward(completion, answer) == reward


def test_math_reward_off_main_thread():
    """math_verify's SIGALRM timeouts fail off the main thread; math_reward must not."""
    out = []
    thread = threading.Thread(target=lambda: out.append(mipu.math_reward("\\boxed{0.5}", "1/2")))
    thread.start()
    thread.join()
    assert out == [1.0]


def test_make_arith_rows():
    rows = make_arith_rows(50, seed=3)
    assert rows == make_arith_rows(50, seed=3)
    for r in rows:
        a, op, b = r["prompt"][:-1].partition("+") if "+" in r["prompt"] else \
            r["prompt"][:-1].partition("-")
        assert str(int(a) + int(b) if op == "+" else int(a) - int(b)) == r["answer"]


def test_tokenizer_and_prompt_ids(tokenizer, model_dir):
    ids = mipu.build_prompt_ids(tokenizer, "12+7=")
    assert len(ids) == 5 and tokenizer.decode(ids) == "12+7="
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert config.eos_token_id == tokenizer.eos_token_id
    tokenizer.chat_template = "{% for m in messages %}q:{{ m['content'] }}{% endfor %}a:"
    try:
        assert tokenizer.decode(mipu.build_prompt_ids(tokenizer, "1+1=")) == "q:1+1=a:"
    finally:
        tokenizer.chat_template = None


def test_fp8_roundtrip_per_row():
    x = torch.randn(64, 128, dtype=torch.bfloat16) * 0.02
    q = mipu.fp8_roundtrip(x, per_row=True)
    assert q.dtype == x.dtype and q.shape == x.shape
    rel = ((q.float() - x.float()).norm() / x.float().norm()).item()
    assert 0 < rel < 0.05  # e4m3 has 3 mantissa bits: ~2-3 % relative error
    rows = torch.tensor([[1000.0, -500.0], [1e-3, -2e-3]])  # per-row scale: the tiny row
    torch.testing.assert_close(mipu.fp8_roundtrip(rows, per_row=True), rows, rtol=0.07, atol=0)  # is not flushed


# ---------------------------------------------------------------- engines (real vLLM)


def test_bad_model_path_and_fp8_on_cpu(tmp_path):
    for bad in (str(tmp_path / "missing"), "not-a-model", "no-such-org/no-such-model"):
        with pytest.raises(mipu.MIPUError, match="unknown model path"):
            mipu.make_sampler(bad, "bfloat16", 0, 0.5, 256, "none")
        with pytest.raises(mipu.MIPUError, match="unknown model path"):
            mipu.load_trainer(bad, "float32", "cpu")
    with pytest.raises(mipu.MIPUError, match="trainer dtype"):
        mipu.load_trainer(str(tmp_path), "fp8", "cpu")
    with pytest.raises(mipu.MIPUError, match="no config.json"):
        mipu.load_trainer(str(tmp_path), "float32", "cpu")
    with pytest.raises(mipu.MIPUError, match="must be one of"):
        mipu.make_sampler(str(tmp_path), "bfloat16", 0, 0.5, 256, "int4")
    if not torch.cuda.is_available():
        with pytest.raises(mipu.MIPUError, match="fp8 needs a GPU.*fp8-sim"):
            mipu.make_sampler(str(tmp_path), "bfloat16", 0, 0.5, 256, "fp8")


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


def test_token_logprobs_padding_and_grad(trainer, prompt_ids):
    prompts = [prompt_ids[0], prompt_ids[1] + [5, 6], prompt_ids[2][:2]]  # ragged prompts
    completions = [[7, 8, 9], [10], [11, 12, 13, 14, 15]]  # ragged completions
    batched, mask = mipu.token_logprobs(trainer, prompts, completions, 0.7, micro_batch=3)
    assert batched.shape == mask.shape == (3, 5)
    assert mask.sum(1).tolist() == [3, 1, 5]
    assert (batched[mask == 0] == 0).all()
    for i in range(3):
        alone, _ = mipu.token_logprobs(trainer, [prompts[i]], [completions[i]], 0.7, 1)
        n = len(completions[i])
        torch.testing.assert_close(batched[i, :n], alone[0, :n], atol=1e-5, rtol=0)
    batched.sum().backward()
    grads = [p.grad for p in trainer.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    trainer.zero_grad(set_to_none=True)


def test_step0_sampler_matches_trainer(llm, trainer, prompt_ids):
    samples = mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0)
    max_d, mean_d = _mismatch(samples, trainer)
    print(f"step-0 bf16 vLLM vs fp32 trainer: max {max_d:.4g} mean {mean_d:.4g}")
    assert max_d < MAX_TOL and mean_d < MEAN_TOL
    assert mipu.check_sync(llm, trainer, prompt_ids[0], samples[0]["completion_ids"], tol=MAX_TOL) < MAX_TOL


def test_sync_takes_effect_and_restores_exactly(llm, trainer, prompt_ids, restore):
    probe_p = prompt_ids[0]
    probe_c = mipu.generate(llm, [probe_p], 1, MAX_NEW, TEMPERATURE, seed=0)[0]["completion_ids"]
    before = mipu.vllm_prompt_logprobs(llm, probe_p + probe_c)
    samples0 = mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0)

    _perturb(trainer, seed=1)
    with pytest.raises(mipu.MIPUError, match="weight sync did not take effect"):
        mipu.check_sync(llm, trainer, probe_p, probe_c, tol=MAX_TOL)
    mipu.sync_weights(llm, list(trainer.named_parameters()), "none")
    mipu.check_sync(llm, trainer, probe_p, probe_c, tol=MAX_TOL)
    samples1 = mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0)
    max_d, mean_d = _mismatch(samples1, trainer)
    assert max_d < MAX_TOL and mean_d < MEAN_TOL
    assert mipu.vllm_prompt_logprobs(llm, probe_p + probe_c) != before

    mipu.sync_weights(llm, restore, "none")  # roll back to the step-0 weights
    assert mipu.vllm_prompt_logprobs(llm, probe_p + probe_c) == before  # bit for bit
    assert mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0) == samples0


def test_fp8_sim_gives_larger_mismatch(llm, trainer, prompt_ids, restore):
    samples = mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0)
    base_max, base_mean = _mismatch(samples, trainer)
    mipu.sync_weights(llm, list(trainer.named_parameters()), "fp8-sim")
    samples = mipu.generate(llm, prompt_ids, N_SAMPLES, MAX_NEW, TEMPERATURE, seed=0)
    fp8_max, fp8_mean = _mismatch(samples, trainer)
    print(f"mismatch none: max {base_max:.4g} mean {base_mean:.4g}; "
          f"fp8-sim: max {fp8_max:.4g} mean {fp8_mean:.4g}")
    assert fp8_mean > 2 * base_mean and fp8_max > base_max  # measured ~6.7x / ~4.7x


def test_checkpoint_tensors_match_trainer(model_dir, trainer):
    """fp8-sim engines are quantized at load by syncing these (HF-named) checkpoint tensors."""
    ckpt = dict(mipu._checkpoint_tensors(model_dir))
    params = dict(trainer.named_parameters())
    assert set(ckpt) - {"lm_head.weight"} == set(params)  # tied lm_head may be saved or not
    assert all(torch.equal(ckpt[n], params[n].detach()) for n in params)


def test_sync_preserves_tied_embeddings(llm, trainer, prompt_ids, restore):
    """Changing only the (tied) embedding must change vLLM's lm_head too."""
    emb = trainer.get_input_embeddings().weight
    with torch.no_grad():
        emb.add_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(2)) * 0.02)
    mipu.sync_weights(llm, list(trainer.named_parameters()), "none")
    probe_c = [5, 6, 7, 8, 9, 10]
    mipu.check_sync(llm, trainer, prompt_ids[0], probe_c, tol=MAX_TOL)


# ---------------------------------------------------------------- the LLM training step

ARITH = HERE / "toy" / "arith_train.jsonl"
ARITH_VAL = HERE / "toy" / "arith_val.jsonl"


def llm_cfg(model_dir, tmp_path, **kw) -> mipu.Config:
    base = dict(model=model_dir, train_data=str(ARITH), val_data=str(ARITH_VAL), prompts_per_step=4,
                num_generations=4, val_prompts=4, mini_batch_size=8, micro_batch_size=8, max_new_tokens=8,
                learning_rate=1e-3, output_dir=str(tmp_path), sync_tol=MAX_TOL)
    return mipu.Config(**{**base, **kw}).validate()


def _probe_logprobs(run):
    return mipu.vllm_prompt_logprobs(run.llm, run.probe[0] + run.probe[1])


def _opt_state(run):
    return {i: {k: v.clone() for k, v in s.items()} for i, s in run.opt.state_dict()["state"].items()}


def test_step1_changes_weights_and_sync_matches(llm, model_dir, tmp_path, restore):
    # the untrained tiny model rarely earns a reward, so every advantage may be 0: AdamW's
    # decoupled weight decay then still moves θ, which is what the sync check needs
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="grpo", weight_decay=0.1), llm=llm)
    before = [p.detach().clone() for p in run.model.parameters()]
    probe_before = _probe_logprobs(run)
    m = mipu.mipu_step(run)
    assert m["step2/accepted"] == 1.0 and m["step1/finite"] == 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, run.model.parameters()))
    assert _probe_logprobs(run) != probe_before                       # vLLM now has θ_{k+1}
    assert mipu.check_sync(run.llm, run.model, *run.probe, tol=MAX_TOL) < MAX_TOL
    for key in ("mismatch/k3", "step1/loss", "step1/clip_frac", "step1/weight_mean", "time/rollout",
                "time/recompute", "time/update", "time/sync", "time/gap_check", "time/rollback"):
        assert key in m


def test_forced_rejection_restores_trainer_and_vllm_exactly(llm, model_dir, tmp_path, restore):
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="mipu", c=1e9, weight_decay=0.1), llm=llm)
    mipu.mipu_step(run)                                                # accepted: fills AdamW state
    run.cfg.c = -1e9                                                   # accept iff T_post >= 1e9: never
    weights = {k: v.clone() for k, v in run.model.state_dict().items()}
    opt_state, probe_before = _opt_state(run), _probe_logprobs(run)
    m = mipu.mipu_step(run)
    assert m["step2/accepted"] == 0.0 and m["step2/rejections"] == 1 and math.isfinite(m["step2/t_post"])
    assert all(torch.equal(weights[k], v) for k, v in run.model.state_dict().items())
    after = _opt_state(run)
    assert all(torch.equal(opt_state[i][k], after[i][k]) for i in opt_state for k in opt_state[i])
    assert _probe_logprobs(run) == probe_before                        # vLLM back to μ_k, bit for bit


def test_target_rule_and_random_rollback_run(llm, model_dir, tmp_path, restore):
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="mipu", accept_rule="target", target_holdout=1),
                             llm=llm)
    m = mipu.mipu_step(run)
    assert math.isfinite(m["step2/g_k"]) and math.isfinite(m["step2/t_post"])
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="random-rollback", reject_rate=0.99), llm=llm)
    assert mipu.mipu_step(run)["step2/accepted"] in (0.0, 1.0)


def test_gap_batch_next_reuses_accepted_batch_once(llm, model_dir, tmp_path, restore):
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="mipu", gap_batch="next", c=1e9, weight_decay=0.1,
                                     val_data=""), llm=llm)
    m0 = mipu.mipu_step(run)                                           # accepted: its Step-2 batch is pending
    assert m0["step2/accepted"] == 1.0 and run.pending is not None
    ro, logp = run.pending
    # sampled by the inference policy it will be trained against: μ_{k+1} = what vLLM holds now
    # (vLLM re-scores the sequence through its prefill path: equal within kernel rounding)
    seq = ro.prompt_ids[0] + ro.completion_ids[0]
    rescored = mipu.vllm_prompt_logprobs(run.llm, seq)[len(ro.prompt_ids[0]):]
    n = len(ro.completion_ids[0])
    assert max(abs(a - b) for a, b in zip(rescored, ro.logp_sampler[0, :n].tolist())) < 0.02
    # and its π log-probs are the trainer's at θ_{k+1}, the θ that step k+1 starts from
    assert torch.equal(logp, mipu.trainer_logp(run, ro))
    m1 = mipu.mipu_step(run)                                           # consumes it: no rollout, no recompute
    assert m1["mismatch/k3"] == pytest.approx(m0["mismatch_post/k3"])
    assert run.pending is not None and run.pending[0] is not ro         # a new batch, never the same one twice
    run.cfg.c = -1e9                                                   # now reject
    m2 = mipu.mipu_step(run)
    assert m2["step2/accepted"] == 0.0 and run.pending is None and run.pending_rows is not None
    rejected_rows = run.pending_rows
    m3 = mipu.mipu_step(run)                                           # same prompts, sampled afresh from μ_k
    assert m3["time/rollout"] > 0 and run.pending_rows is not rejected_rows


def test_gap_batch_next_needs_step2():
    cfg = mipu.Config(method="grpo", gap_batch="next", model="m", train_data="t").validate()
    with pytest.raises(mipu.MIPUError, match="--gap-batch next needs a method with Step 2"):
        mipu.check_llm_flags(cfg, "train")


def test_nonfinite_loss_rejects_candidate(llm, model_dir, tmp_path, restore):
    run = mipu.setup_llm_run(llm_cfg(model_dir, tmp_path, method="tis"), llm=llm)
    weights = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.opt.param_groups[0]["lr"] = float("nan")
    run.cfg.learning_rate = float("nan")                               # NaN update -> NaN weights
    m = mipu.mipu_step(run)
    assert m["step2/accepted"] == 0.0 and m["step1/finite"] == 0.0
    assert all(torch.equal(weights[k], v) for k, v in run.model.state_dict().items())


# ---------------------------------------------------------------- command line

def run_cli(*args, timeout=600):
    """`python mipu.py ARGS`, or `python -m toy.SCRIPT ARGS` when the first arg is "-m", from the repo root."""
    cmd = [sys.executable, *args] if args[0] == "-m" else [sys.executable, str(HERE / "mipu.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE)


def test_cli_toy_one_run():
    p = run_cli("toy", "--toy-preset", "severe", "--method", "mipu", "--steps", "3", "--toy-prompts", "16",
                "--prompts-per-step", "8", "--val-prompts", "8")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("toy run: alpha=8, method mipu")
    assert [x.split()[1] for x in lines[1:]] == ["0", "1", "2"] and all("t_post=" in x for x in lines[1:])


def test_cli_toy_demo_tiny_budget(tmp_path):
    p = run_cli("-m", "toy.demo", "--steps", "3", "--seeds", "2", "--presets", "severe", "--workers", "1",
                "--toy-prompts", "16", "--prompts-per-step", "8", "--val-prompts", "8", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    for name in ("demo_results.md", "demo_results.csv", "demo_curves.png"):
        assert (tmp_path / name).stat().st_size > 0
    table = (tmp_path / "demo_results.md").read_text()
    for label in demo.TOY_DEMO_METHODS:
        assert f"| {label} |" in table
    assert "random-rollback" in table and "sign agreement" in table


def test_cli_collapse_study_tiny_budget(tmp_path):
    from toy import collapse_study
    for extra in (["--configs", "base-a1,static-h1"], ["--rules", "static-h1"]):
        p = run_cli("-m", "toy.collapse_study", "--seeds", "2", "--steps", "3", "--workers", "1",
                    "--out", str(tmp_path), *extra)
        assert p.returncode == 0, p.stderr
    search, rules = (tmp_path / "search.md").read_text(), (tmp_path / "rules_static-h1.md").read_text()
    assert "| static-h1 | FP8 logits, static scale, saturating | 1 |" in search
    assert all(f"| {label} |" in rules for label in collapse_study.RULES)
    n_runs = len((tmp_path / "runs.jsonl").read_text().splitlines())
    run_cli("-m", "toy.collapse_study", "--seeds", "2", "--steps", "3", "--rules", "static-h1", "--out", str(tmp_path))
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == n_runs          # all from the cache
    assert run_cli("-m", "toy.collapse_study", "--configs", "nope").returncode == 2


def test_cli_toy_demo_without_mismatch_has_no_gap_study(tmp_path):
    p = run_cli("-m", "toy.demo", "--steps", "2", "--seeds", "1", "--presets", "none", "--workers", "1",
                "--toy-prompts", "16", "--prompts-per-step", "8", "--val-prompts", "8", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    table = (tmp_path / "demo_results.md").read_text()
    assert "| none (alpha=0, 2 steps) | grpo |" in table and "Gap study" not in table


@pytest.mark.parametrize("args, message", [
    (["toy", "--num-generations", "1"], "error: --num-generations must be >= 2"),
    (["toy", "--method", "ppo"], "invalid choice: 'ppo'"),
    (["toy", "--steps", "many"], "invalid int value: 'many'"),
    (["toy", "--method", "tis", "--accept-rule", "target"], "error: --accept-rule target only applies"),
    (["train", "--method", "mipu", "--accept-rule", "oracle"], "error: --accept-rule oracle and --c-se are toy only"),
    (["-m", "toy.demo", "--presets", "none,bad"], "error: unknown --presets bad"),
    (["-m", "toy.demo", "--num-generations", "1"], "error: --num-generations must be >= 2"),
])
def test_cli_bad_input_one_clear_error(args, message):
    p = run_cli(*args)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr


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
    p = run_cli("train", *common, "--steps", "4", "--resume")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout and "at step 3" in p.stdout
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    p = run_cli("eval", "--model", str(out / "checkpoint-000004"), "--data", f"{ARITH_VAL},{ARITH}",
                "--eval-samples", "2", "--max-new-tokens", "4")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| arith_val |" in p.stdout and "| arith_train |" in p.stdout and "pass@1" in p.stdout


@pytest.mark.parametrize("make_file, extra, message", [
    ('{"prompt": "1+1=", "answer": "2"}\n{oops\n', [], "bad.jsonl:2: malformed JSON"),
    ('{"question": "1+1=", "answer": "2"}\n', [], "bad.jsonl:1: missing key 'prompt'"),
    ('{"prompt": "1+1=", "solution": "2"}\n', [], "bad.jsonl:1: missing key 'answer'"),
    ("", [], "is empty"),
    (None, ["--num-generations", "1"], "error: --num-generations must be >= 2"),
    (None, ["--rollout-quant", "fp8"], "--rollout-quant fp8 needs a GPU"),
    (None, ["--model", "no/such-model"], "unknown model path"),
    (None, ["--method", "mipu", "--val-data", ""], "train needs --val-data"),
    (None, ["--resume", "--output-dir", "/nonexistent/run"], "--resume: no checkpoint"),
])
def test_cli_train_bad_input(tmp_path, model_dir, make_file, extra, message):
    data = str(ARITH)
    if make_file is not None:
        (tmp_path / "bad.jsonl").write_text(make_file)
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
    assert "throughput ratio wrapper/bare" in report


def test_cli_llm_demo_tiny_budget(tmp_path):
    p = run_cli("-m", "toy.llm_demo", "--tiny", str(tmp_path / "tiny"), "--sft-out", str(tmp_path / "sft"),
                "--sft-steps", "3", "--steps", "2", "--eval-every", "1", "--out", str(tmp_path / "out"),
                "--output-dir", str(tmp_path / "runs"))
    assert p.returncode == 0, p.stderr[-3000:]
    table = (tmp_path / "out" / "llm_demo.md").read_text()
    assert "| grpo |" in table and "| mipu |" in table
    assert (tmp_path / "out" / "llm_demo.png").stat().st_size > 0
    steps = [json.loads(x)["step"] for x in (tmp_path / "runs" / "mipu" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
