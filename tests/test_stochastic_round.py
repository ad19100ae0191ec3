"""Stochastic rounding of bf16 parameters: the hash, the rounding's statistics, the kernel against the reference,
and what it is for (bf16 master weights that keep updates below half an ulp)."""
import pytest
import torch

import lpoptim
from lpoptim.kernels import adamw_step as kernel
from lpoptim.optim.reference import reference_adamw_step
from lpoptim.optim.state import StateLayout, init_state
from lpoptim.optim.stochastic_round import MASK32, hash32, round_bf16_stochastic, sr_key, uniform_noise


def _lowbias32(x: int) -> int:  # the published function, on Python ints
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_matches_python_ints_without_overflow():
    xs = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF]
    got = hash32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [_lowbias32(x) for x in xs]
    # a bijection: distinct inputs, distinct outputs
    assert hash32(torch.arange(1 << 16, dtype=torch.int64)).unique().numel() == 1 << 16


def test_rounding_picks_a_neighbour_and_is_unbiased():
    x = torch.tensor([1.0 + 2**-10, -3.0 - 2**-9, 1e-30, 2.5, 0.0, -0.0, 1 + 255 * 2**-16], dtype=torch.float32)
    lo = x.to(torch.bfloat16)  # one neighbour (round to nearest); the other is one bf16 ulp away
    draws = torch.stack([round_bf16_stochastic(x, sr_key(torch.tensor(float(s)), 7)).float() for s in range(4000)])
    ulp = (lo.float().abs() * 2**-7).clamp_min(1e-45)
    assert ((draws - x).abs() < ulp * 1.0001).all()  # always one of the two neighbours
    assert torch.equal(draws[:, 3], torch.full((4000,), 2.5))  # on the grid: never moves
    assert torch.equal(draws[:, 4], torch.zeros(4000)) and torch.signbit(draws[:, 5]).all()
    mean = draws.double().mean(0)
    err = (mean - x.double()).abs() / ulp.double()
    assert (err < 0.03).all(), err  # 4000 draws: the std of the mean is <= 0.5/sqrt(4000) = 0.008 ulp


def test_non_finite_values_round_to_nearest():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38], dtype=torch.float32)
    y = round_bf16_stochastic(x, torch.tensor(123, dtype=torch.int64))
    assert y[0] == float("inf") and y[1] == -float("inf") and torch.isnan(y[2])


def _sr_run(dtype_steps=3):
    layout = StateLayout(quantized=True)
    gen = torch.Generator().manual_seed(0)
    shapes = [(48, 256), (5, 200), (16, 128)]
    params = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
    ref, nearest = [p.clone() for p in params], [p.clone() for p in params]
    states = [init_state(p, layout, False) for p in params]
    ref_s = [init_state(p, layout, False) for p in params]
    near_s = [init_state(p, layout, False) for p in params]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False)
    for _ in range(dtype_steps):
        grads = [torch.randn(p.shape, generator=gen).bfloat16() for p in params]
        kernel.fused_adamw_step([(p, g, s, layout) for p, g, s in zip(params, grads, states)],
                                sr_salts=[3, 4, 5], **hyper)
        for i, (p, g, s) in enumerate(zip(ref, grads, ref_s)):
            reference_adamw_step(p, g, s, layout, sr_salt=3 + i, **hyper)
        for p, g, s in zip(nearest, grads, near_s):
            reference_adamw_step(p, g, s, layout, **hyper)
    return params, ref, nearest


def test_kernel_rounds_as_the_reference_interpreter(interpreter_friendly_tiles):
    params, ref, nearest = _sr_run()
    for p, r, n in zip(params, ref, nearest):
        assert (p != n).float().mean() > 0.2  # stochastic rounding did happen
        # same random bits; the kernel's fp32 update differs from the reference's by an ulp at most, which
        # moves the rounding only where it falls within that ulp of the random threshold
        assert (p != r).float().mean() < 1e-3


def test_offset_draws_the_whole_tensors_bits():
    """round_bf16_stochastic with ``offset`` (a shard's first element in its tensor): the two halves of a tensor,
    each with its offset, round exactly as the whole; without it they would share their bits."""
    x = torch.randn(64, 96, dtype=torch.float64).float() * 3
    key = sr_key(torch.tensor(5.0), 2)
    whole = round_bf16_stochastic(x, key)
    halves = torch.cat([round_bf16_stochastic(x[:32], key, 0), round_bf16_stochastic(x[32:], key, 32 * 96)])
    assert torch.equal(halves, whole)
    local = torch.cat([round_bf16_stochastic(x[:32], key), round_bf16_stochastic(x[32:], key)])
    assert not torch.equal(local, whole)  # by local index the second half draws the first half's bits


@pytest.mark.parametrize("state_bits", [8, 4])
def test_shards_step_as_the_whole_tensor_interpreter(interpreter_friendly_tiles, state_bits):
    """The fused step (interpreter) and the reference on the two row-halves of a bf16 tensor, each given its
    element offset (as lpoptim.AdamW passes an FSDP2 shard's), equal one step of the whole tensor bit for bit:
    the parameter's stochastic rounding and 4-bit v's draw by the global index."""
    layout = StateLayout(quantized=True, state_bits=state_bits)
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(16, 256, generator=gen).bfloat16()
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False)
    salts = dict(sr_salts=[9], **(dict(state_salts=[9]) if state_bits == 4 else {}))
    for run in ("kernel", "reference"):
        w = whole.clone()
        shards = [w[:8].clone(), w[8:].clone()]
        s_whole = init_state(w, layout, False)
        s_shards = [init_state(p, layout, False) for p in shards]
        for _ in range(3):
            g = torch.randn(w.shape, generator=gen).bfloat16()
            if run == "kernel":
                kernel.fused_adamw_step([(w, g, s_whole, layout)], **salts, **hyper)
                for i, (p, s) in enumerate(zip(shards, s_shards)):
                    kernel.fused_adamw_step([(p, g[8 * i:8 * i + 8].contiguous(), s, layout)], **salts,
                                            offsets=[8 * 256 * i], **hyper)
            else:
                reference_adamw_step(w, g, s_whole, layout, sr_salt=9, state_salt=9, **hyper)
                for i, (p, s) in enumerate(zip(shards, s_shards)):
                    reference_adamw_step(p, g[8 * i:8 * i + 8].contiguous(), s, layout, sr_salt=9, state_salt=9,
                                         offset=8 * 256 * i, **hyper)
        assert torch.equal(torch.cat(shards), w), run
        assert not torch.equal(shards[0], shards[1])


def _optimizer_run(stochastic: bool, dtype=torch.bfloat16, steps=200):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.ones(64, 128, dtype=dtype))
    opt = lpoptim.AdamW([w], lr=1e-4, weight_decay=0.0, bf16_stochastic_round=stochastic, fused=False)
    for _ in range(steps):
        w.grad = torch.ones_like(w)  # Adam's update is ~lr every step: 1e-4, far below bf16's half ulp at 1.0
        opt.step()
    return w.detach().float()


def test_bf16_master_weights_keep_tiny_updates():
    exact = 1.0 - 200 * 1e-4  # Adam with a constant gradient moves by lr per step
    assert torch.equal(_optimizer_run(False), torch.ones(64, 128))  # round to nearest: every update is lost
    sr = _optimizer_run(True)
    assert abs(sr.mean().item() - exact) < 2e-4  # stochastic rounding: right on average
    assert (sr != sr[0, 0]).any()  # and elements go their own ways
    assert torch.equal(_optimizer_run(True, torch.float32), _optimizer_run(False, torch.float32))  # fp32: no effect


def test_stochastic_rounding_is_deterministic_and_resumes_exactly():
    def make():
        torch.manual_seed(1)
        model = torch.nn.Linear(128, 64).bfloat16()
        return model, lpoptim.AdamW(model.parameters(), lr=1e-3, bf16_stochastic_round=True, min_quant_numel=1024)

    def steps(model, opt, n, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(n):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            opt.step()

    a, opt_a = make()
    steps(a, opt_a, 4, 0)
    steps(a, opt_a, 3, 1)
    b, opt_b = make()  # a replica (as in data parallelism): same inputs, same bits
    steps(b, opt_b, 4, 0)
    sd = opt_b.state_dict()
    c, opt_c = make()
    c.load_state_dict(b.state_dict())
    opt_c.load_state_dict(sd)
    steps(c, opt_c, 3, 1)
    steps(b, opt_b, 3, 1)
    for x, y, z in zip(a.parameters(), b.parameters(), c.parameters()):
        assert torch.equal(x, y) and torch.equal(x, z)


@pytest.mark.gpu
def test_kernel_rounds_as_the_reference_gpu():
    layout = StateLayout(quantized=True)
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(256, 1024, generator=gen).bfloat16().cuda()
    r = p.clone()
    s, rs = init_state(p, layout, False), init_state(r, layout, False)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False)
    for _ in range(3):
        g = torch.randn(p.shape, generator=gen).bfloat16().cuda()
        kernel.fused_adamw_step([(p, g, s, layout)], sr_salts=[9], **hyper)
        reference_adamw_step(r, g, rs, layout, sr_salt=9, **hyper)
    assert (p != r).float().mean() < 1e-3


def test_small_gpt_with_bf16_master_weights_matches_fp32_training():
    from lpoptim.train.loop import RunConfig, train

    fp32 = train(RunConfig(optimizer="torch", steps=150))
    bf16 = train(RunConfig(optimizer="lpoptim", master="bf16", steps=150))
    assert bf16["label"].endswith("bf16 params (SR)")
    assert abs(bf16["val"] / fp32["val"] - 1) < 0.01, (bf16["val"], fp32["val"])


def test_v_noise_is_the_top_half_of_the_parameters_rounding_hash():
    """4-bit states take v's uniforms from the top 16 bits of the hash whose low 16 round the bf16 parameter
    (one hash per element in the kernel): they are uniform, and uncorrelated with the low half they share it with."""
    key = sr_key(torch.tensor(7.0), 3)
    u = uniform_noise((1 << 20,), key, offset=5)
    assert u.min() >= 0 and u.max() < 1 and torch.equal(u * 2 ** 16, (u * 2 ** 16).round())
    idx = (torch.arange(1 << 20, dtype=torch.int64) + 5) & MASK32
    h = hash32(idx ^ key)
    assert torch.equal(u, (h >> 16).float() * 2.0 ** -16)
    low = (h & 0xFFFF).float() * 2.0 ** -16
    assert abs(u.mean().item() - 0.5) < 2e-3 and abs(low.mean().item() - 0.5) < 2e-3
    corr = torch.corrcoef(torch.stack([u, low]))[0, 1].item()
    assert abs(corr) < 5e-3  # 2^20 samples: independent halves give |r| ~ 1e-3
    # and bucket by bucket (8 x 8 joint histogram of the two halves' top 3 bits: ~0.8% noise a bucket) uniform
    joint = torch.bincount(((h >> 29) * 8 + ((h >> 13) & 7)).long(), minlength=64).float()
    assert (joint / joint.mean() - 1).abs().max() < 0.05
