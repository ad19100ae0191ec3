"""No quantization-made update spikes: on any gradient stream, no element of lpoptim.AdamW's step exceeds twice
the largest step torch.optim.AdamW takes on the same stream, at every step, with every flag.

The streams are ordinary but adversarial: gradients that shrink (after a spike, at the end of warm-up), heavy
tails, outliers, zeros, rows that stop getting gradients, groups spanning many decades, extreme scales. With
the older state codec (k >= 1, smallest magnitude onto E4M3's subnormals) some of these made steps of 10^2 to
10^5 x lr: a v that decoded to 0 beside a live m turned the update into m / eps. Checked for the pure-torch
reference, for the Triton kernel (under the interpreter on the CPU) and on a GPU.
"""
import math

import pytest
import torch

import lpoptim
from lpoptim.kernels import adamw_step as kernel
from lpoptim.optim.reference import load_moment
from lpoptim.optim.state import StateLayout, init_state

SHAPE = (32, 256)
RATIO = 2.0


def _streams():
    gen = torch.Generator().manual_seed(0)

    def n():
        return torch.randn(SHAPE, generator=gen)

    def span(decades):  # |g| log-uniform over `decades` decades inside every group, random signs
        return torch.exp(torch.rand(SHAPE, generator=gen) * decades * math.log(10)) * torch.sign(n())

    g = n()
    yield "the same gradient x6", [g] * 6
    g = n()
    yield "halved each step", [g * 0.5 ** i for i in range(8)]
    g = n()
    yield "divided by 10 each step", [g * 0.1 ** i for i in range(6)]
    s = span(4)
    yield "|g| spans 1e4 in a group, then x0.01", [s] * 5 + [s * 0.01] * 5
    s = span(8)
    yield "|g| spans 1e8 in a group, then x1e-3", [s] * 5 + [s * 1e-3] * 5
    yield "Cauchy", [n() / n() for _ in range(12)]
    yield "0.1% outliers x1e4, then gone", [n() * torch.where(torch.rand(SHAPE, generator=gen) < 1e-3, 1e4, 1.0)
                                            for _ in range(6)] + [n() for _ in range(6)]
    yield "a x1e3 spike, then x1e-3", [n() for _ in range(4)] + [n() * 1e3] + [n() * 1e-3 for _ in range(6)]
    yield "half zeros", [n() * (torch.rand(SHAPE, generator=gen) < 0.5) for _ in range(8)]
    yield "rows go to zero", [n() for _ in range(4)] + [n() * (torch.arange(32)[:, None] < 16) for _ in range(8)]
    g = n()
    yield "growing x1.11 a step", [g * 1.11 ** i for i in range(20)]
    g = n()
    yield "sign flips, halving", [g * (-0.5) ** i for i in range(8)]
    yield "tiny (1e-20)", [n() * 1e-20 for _ in range(5)]
    yield "huge (1e15)", [n() * 1e15 for _ in range(5)]
    yield "warm-up ends: x1 then x0.01", [n() for _ in range(6)] + [n() * 0.01 for _ in range(10)]


STREAMS = dict(_streams())
FLAGS = {
    "default": {},
    "amsgrad": dict(amsgrad=True),
    "maximize": dict(maximize=True),
    "weight decay": dict(weight_decay=0.1),
    "betas 0.9/0.95": dict(betas=(0.9, 0.95)),
    "bf16 + stochastic rounding": dict(bf16_stochastic_round=True),
}


def _torch_steps(grads, flags, device="cpu"):
    """torch.optim.AdamW's largest |step| at each step (an fp32 master for bf16 runs: the semantics lpoptim's
    stochastic rounding keeps)."""
    flags = {k: v for k, v in flags.items() if k != "bf16_stochastic_round"}
    p = torch.nn.Parameter(torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).mul(0.01).to(device))
    opt = torch.optim.AdamW([p], lr=1e-3, **{"weight_decay": 0.0, **flags})
    out = []
    for g in grads:
        before = p.detach().clone()
        p.grad = g.to(device)
        opt.step()
        out.append((p.detach() - before).abs().max().item())
    return out


def _check(grads, flags, lp_step, device="cpu", ratio=RATIO):
    want = _torch_steps(grads, flags, device)
    bf16 = flags.get("bf16_stochastic_round", False)
    p = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).mul(0.01).to(device,
                                                                                    torch.bfloat16 if bf16 else None)
    # one bf16 ulp of the largest parameter: what stochastic rounding may add to a step
    slack = (2.0 ** (math.floor(math.log2(p.abs().max().item())) - 7)) if bf16 else 0.0
    for t, (g, torch_max) in enumerate(zip(grads, want), 1):
        before = p.float().clone()
        lp_step(p, g.to(device, p.dtype))
        got = (p.float() - before).abs().max().item()
        assert math.isfinite(got)
        assert got <= ratio * torch_max + slack, f"step {t}: {got:.3g} against torch's {torch_max:.3g}"


def _optimizer_stepper(flags, **options):
    state = {}

    def step(p, g):
        if "opt" not in state:
            state["param"] = torch.nn.Parameter(p)
            state["opt"] = lpoptim.AdamW([state["param"]], lr=1e-3, min_quant_numel=0, **{"weight_decay": 0.0, **flags},
                                         **options)
        param = state["param"]
        param.grad = g
        state["opt"].step()
        p.copy_(param.detach())
    return step


@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
@pytest.mark.parametrize("stream", STREAMS.keys())
@pytest.mark.parametrize("state_bits", [8, 4])
def test_reference_step_is_bounded_by_torchs(stream, flags, state_bits):
    """4-bit states too, on these streams (measured worst 1.29, 1.86 with bf16 parameters before the bf16 ulp's
    slack; on real gradient streams at most 1.34, docs/optimizer.md)."""
    _check(STREAMS[stream], flags, _optimizer_stepper(flags, fused=False, state_bits=state_bits))


def _kernel_stepper(flags, state_bits=8):
    beta1, beta2 = flags.get("betas", (0.9, 0.999))
    hyper = dict(lr=1e-3, beta1=beta1, beta2=beta2, eps=1e-8, weight_decay=flags.get("weight_decay", 0.0), amsgrad=flags.get("amsgrad", False),
                 maximize=flags.get("maximize", False))
    layout = StateLayout(quantized=True, state_bits=state_bits)
    held = {}

    def step(p, g):
        if "state" not in held:
            held["state"] = init_state(p, layout, hyper["amsgrad"])
        kernel.fused_adamw_step([(p, g.contiguous(), held["state"], layout)],
                                sr_salts=[0] if flags.get("bf16_stochastic_round") else None,
                                **(dict(state_salts=[0]) if state_bits == 4 else {}), **hyper)
    return step


# the interpreter is slow: every stream with the default flags, the hardest streams with the kernel's other paths
HARD = ["divided by 10 each step", "|g| spans 1e8 in a group, then x1e-3", "a x1e3 spike, then x1e-3", "tiny (1e-20)"]
KERNEL_CASES = ([(stream, "default", 8) for stream in STREAMS]
                + [(stream, flags, 8) for stream in HARD for flags in ("amsgrad", "bf16 + stochastic rounding")]
                # 4-bit states: the hard streams, and the one of the reference's worst case (bf16, sign flips)
                + [(stream, "default", 4) for stream in HARD]
                + [("sign flips, halving", flags, 4) for flags in ("amsgrad", "bf16 + stochastic rounding")])


@pytest.mark.parametrize("stream, flags, state_bits", KERNEL_CASES)
def test_kernel_step_is_bounded_by_torchs_interpreter(stream, flags, state_bits, interpreter_friendly_tiles):
    if torch.cuda.is_available():
        pytest.skip("the GPU test below covers the kernel")
    step = _kernel_stepper(FLAGS[flags], state_bits)
    _check(STREAMS[stream], FLAGS[flags], step)


@pytest.mark.gpu
@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
@pytest.mark.parametrize("state_bits", [8, 4])
def test_fused_step_is_bounded_by_torchs_gpu(flags, state_bits):
    for grads in STREAMS.values():
        _check(grads, flags, _optimizer_stepper(flags, fused=True, state_bits=state_bits), device="cuda")


@pytest.mark.parametrize("stream", STREAMS.keys())
def test_no_live_m_beside_a_zero_v(stream):
    """Wherever the decoded m is non-zero, the decoded v is too, unless v is below fp32's smallest normal (there
    torch's own update is eps-bound as well)."""
    p = torch.nn.Parameter(torch.zeros(SHAPE))
    opt = lpoptim.AdamW([p], lr=1e-3, min_quant_numel=0, fused=False)
    layout = StateLayout.for_param(p, opt.param_groups[0])
    exact_v = torch.zeros(SHAPE, dtype=torch.float64)
    for g in STREAMS[stream]:
        p.grad = g.clone()
        opt.step()
        exact_v = exact_v * 0.999 + 0.001 * g.double() ** 2
        m, v = load_moment(opt.state[p], "exp_avg", layout), load_moment(opt.state[p], "exp_avg_sq", layout)
        lost = (m != 0) & (v == 0) & (exact_v >= 2.0 ** -126)
        assert not lost.any(), f"{int(lost.sum())} elements"


def test_the_older_codec_did_blow_up():
    """The property above is not vacuous: the codec it replaced (k >= 1 onto E4M3's smallest subnormal, no bound
    at decode) steps 10^4 x further than torch on one of these streams. Simulated here with the reference's own
    pieces: the older k, written out."""
    from lpoptim.formats import E4M3, round_to_grid
    from lpoptim.quant import from_groups, group_stats, to_groups

    def old_roundtrip(x):
        g = to_groups(x, 128)
        amax, amin = group_stats(g)
        k = (math.log2(448 / 2 ** -9) / (torch.log2(amax) - torch.log2(amin))).clamp(1, 16.9)[..., None]
        q = round_to_grid(448 * (g.abs() / amax[..., None]) ** k, E4M3)
        return from_groups(torch.copysign((q / 448) ** (1 / k) * amax[..., None], g), x.shape)

    m = v = torch.zeros(SHAPE)
    worst = 0.0
    want = _torch_steps(STREAMS["divided by 10 each step"], {})
    for t, (g, torch_max) in enumerate(zip(STREAMS["divided by 10 each step"], want), 1):
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        step = 1e-3 / (1 - 0.9 ** t) * m / ((v / (1 - 0.999 ** t)).sqrt() + 1e-8)
        worst = max(worst, step.abs().max().item() / torch_max)
        m, v = old_roundtrip(m), old_roundtrip(v)
    assert worst > 1e3


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.99), (0.8, 0.64), (0.7, 0.49), (0.0, 0.999), (0.9, 0.5)])
def test_adams_own_bound_holds_for_any_betas(betas):
    """m_n^2 <= K_n v_n on random streams for the K_n the decoder uses (quant.adam_bound_inv), tight within a few
    percent on the stream that attains it, and finite where beta1^2 = beta2 up to rounding ((0.8, 0.64): 1 - 2^-52,
    where (1 - r^n) / (1 - r) in fp32 would be 0 / 0 and the bound would silently switch off)."""
    from lpoptim.quant import adam_bound_inv

    b1, b2 = betas
    gen = torch.Generator().manual_seed(0)
    m = v = torch.zeros(4096, dtype=torch.float64)
    for n in range(1, 60):
        g = torch.randn(4096, generator=gen, dtype=torch.float64) * torch.exp(torch.randn(4096, generator=gen) * 2)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        inv = adam_bound_inv(torch.tensor(float(n)), b1, b2).double()
        assert torch.isfinite(inv) and inv > 0
        assert (m * m * inv <= v * (1 + 1e-5)).all()
    # the stream that attains it: g_i proportional to (b1 / b2)^(n - i), n steps
    n = 30
    g = torch.tensor([(b1 / b2) ** (n - i) if b1 > 0 else float(i == n) for i in range(1, n + 1)], dtype=torch.float64)
    m = (1 - b1) * sum(b1 ** (n - i) * g[i - 1] for i in range(1, n + 1))
    v = (1 - b2) * sum(b2 ** (n - i) * g[i - 1] ** 2 for i in range(1, n + 1))
    assert (m * m * adam_bound_inv(torch.tensor(float(n)), b1, b2).double()).item() == pytest.approx(v.item(), rel=1e-4)
