"""Regenerate tests/data/torch_grad_scaler_goldens.json from torch.amp.GradScaler.

NEEDS TORCH; NOT RUN BY THE TEST SUITE (torch is no test dependency, the JSON is committed):

    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch==2.13.0 numpy
    /tmp/torchvenv/bin/python tests/data/make_torch_goldens.py

Every number is recorded as torch computed it on the CPU (torch 2.13.0+cpu). Sections:
  trajectories     GradScaler("cpu", ...) + SGD(lr=1) over random inf/NaN patterns: per step the scaled grads
                   fed in, the scale used, found_inf, the unscaled grads after step(), scale and tracker after.
                   The last one keeps the scale subnormal, with gradients large enough that the scaled ones
                   are normal floats (a subnormal gradient would be flushed by XLA before any unscale).
  update_kernel    torch._amp_update_scale_ on random scales (subnormal to FLT_MAX) and double factors.
  inv_scale        _scale.double().reciprocal().float() for random float32 scales.
  scale_outputs    scaler.scale() result dtypes and values for 0-dim and vector losses.
  scaling_case     test_cuda.py's _run_scaling_case (SGD, growth_interval=1, inf at iteration 2) on CPU:
                   its data, initial weights and the scaling run's final weights and scale (512).
"""

from __future__ import annotations

import json
import math
import pathlib
import struct

import numpy as np
import torch

OUT = pathlib.Path(__file__).with_name("torch_grad_scaler_goldens.json")
rng = np.random.default_rng(20261122)

# name, init_scale, growth_factor, backoff_factor, growth_interval, steps, P(inf/nan per step)
CONFIGS = [
    ("doc_1_10", 16.0, 2.0, 0.5, 3, None, None),
    ("default_interval5", 2.0**16, 2.0, 0.5, 5, 40, 0.2),
    ("nonpow2_1.1_0.3", 3.0, 1.1, 0.3, 2, 40, 0.3),
    ("init_12345.678", 12345.678, 1.7, 0.77, 1, 40, 0.25),
    ("near_one", 7.0, 1.0000001, 0.9999999, 1, 30, 0.5),
    ("overflow_guard", 1e38, 16.0, 0.5, 1, 12, 0.15),
    ("to_subnormal", 1.17e-38, 1.3, 0.3, 4, 30, 0.8),
    ("growth_every_step", 16.0, 2.0, 0.5, 1, 20, 0.1),
]
# Drawn after every other section, so that their random numbers stay as they were.
SUBNORMAL = ("subnormal_scale", 2.0**-127, 1.25, 0.75, 2, 40, 0.3, 2.0**40)
DOC_PATTERN = "FFFFFFIFFFIIFFFFNFF"  # torch_amp_behavior.md section 1.10
SHAPES = {"w": ((2, 3), torch.float32), "b": ((3,), torch.bfloat16), "d": ((2,), torch.float64)}


def f(x) -> float:
    """A float32 value as its shortest decimal that round-trips through float32 (keeps the JSON small)."""
    return float(str(np.float32(float(x))))


def values(t: torch.Tensor) -> list[float]:
    """Exact values; float32/bfloat16 ones written as shortest float32 decimals, float64 in full."""
    flat = t.detach().double().flatten().tolist()
    return flat if t.dtype == torch.float64 else [f(v) for v in flat]


def trajectory(name, init_scale, growth, backoff, interval, steps, p_bad, grad_size=1.0):
    params = {k: torch.zeros(shape, dtype=dt, requires_grad=True) for k, (shape, dt) in SHAPES.items()}
    opt = torch.optim.SGD(list(params.values()), lr=1.0)
    stepped = []
    sgd_step = opt.step
    opt.step = lambda *a, **k: stepped.append(True) or sgd_step(*a, **k)  # GradScaler skips by not calling it
    sc = torch.amp.GradScaler(
        "cpu", init_scale=init_scale, growth_factor=growth, backoff_factor=backoff, growth_interval=interval
    )
    pattern = (
        DOC_PATTERN
        if steps is None
        else "".join(rng.choice(list("IJN"), p=[0.5, 0.2, 0.3]) if rng.random() < p_bad else "F" for _ in range(steps))
    )
    sc.scale(torch.ones(()))  # lazy init of _scale on the CPU
    records = []
    for kind in pattern:
        scale_used = sc.get_scale()
        grads = {}
        for k, (shape, dt) in SHAPES.items():
            g = torch.from_numpy(rng.standard_normal(shape) * grad_size).to(dt) * torch.tensor(
                scale_used, dtype=torch.float64
            ).to(dt)
            grads[k] = g
        if kind != "F":
            k = list(SHAPES)[rng.integers(len(SHAPES))]
            idx = tuple(int(rng.integers(n)) for n in SHAPES[k][0])
            grads[k][idx] = {"I": math.inf, "J": -math.inf, "N": math.nan}[kind]
        for k, p in params.items():
            p.grad = grads[k].clone()
        stepped.clear()
        fed = {k: values(g) for k, g in grads.items()}
        sc.step(opt)
        found = sum(v.item() for v in sc._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
        unscaled = {k: values(p.grad) for k, p in params.items()}
        sc.update()
        opt.zero_grad(set_to_none=True)
        records.append(
            {
                "kind": kind,
                "grads": fed,
                "scale_used": f(scale_used),
                "found_inf": found,
                "stepped": bool(stepped),
                "unscaled": unscaled,
                "scale_after": f(sc.get_scale()),
                "tracker_after": sc._get_growth_tracker(),
            }
        )
    return {
        "name": name,
        "init_scale": init_scale,
        "growth_factor": growth,
        "backoff_factor": backoff,
        "growth_interval": interval,
        "steps": records,
        "state_dict": sc.state_dict(),
    }


def update_kernel(n=250):
    cases = []
    for _ in range(n):
        bits = int(rng.integers(0, 0x7F800000))
        scale = struct.unpack("<f", struct.pack("<I", bits))[0]
        growth = float(np.exp(rng.uniform(0.0, 3.0)))
        backoff = float(np.exp(rng.uniform(-8.0, 0.0)))
        interval = int(rng.integers(1, 4))
        tracker = int(rng.integers(0, 5))
        found = float(rng.random() < 0.4)
        s = torch.tensor(scale, dtype=torch.float32)
        t = torch.tensor(tracker, dtype=torch.int32)
        torch._amp_update_scale_(s, t, torch.tensor(found), growth, backoff, interval)
        cases.append(
            {
                "scale": f(scale),
                "growth_factor": growth,
                "backoff_factor": backoff,
                "growth_interval": interval,
                "tracker": tracker,
                "found_inf": found,
                "new_scale": f(s),
                "new_tracker": int(t),
            }
        )
    return cases


def inv_scale(n=250):
    scales = [65536.0, 3.0, 7.0, 10.0, 1e-3, 12345.678, 1e38, 1e-30]
    # subnormal scales: 1/scale is finite down to just above 2**-128, inf below
    scales += [
        2.0**-127,
        1.5 * 2.0**-127,
        1.1754942e-38,
        5e-39,
        3e-39,
        2.0**-128 * (1 + 2.0**-21),
        2.0**-128,
        1e-39,
        1e-42,
        1e-45,
    ]
    scales += [float(np.float32(np.exp(x))) for x in rng.uniform(-60.0, 60.0, n)]
    return [
        {"scale": f(s), "inv": f(torch.tensor(s, dtype=torch.float32).double().reciprocal().float())} for s in scales
    ]


def scale_outputs():
    sc = torch.amp.GradScaler("cpu", init_scale=65536.0)
    out = []
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for shape, value in (((), 0.375), ((3,), 0.375), ((), 1.0009765625)):
            y = sc.scale(torch.full(shape, value, dtype=dt))
            out.append(
                {
                    "dtype": str(dt).removeprefix("torch."),
                    "shape": list(shape),
                    "value": value,
                    "out_dtype": str(y.dtype).removeprefix("torch."),
                    "out": values(y),
                }
            )
    return out


def scaling_case():
    """test_cuda.py _run_scaling_case, SGD: control vs scaling run, growth_interval=1, inf at iteration 2."""
    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    init = [p.detach().clone() for p in mod.parameters()]
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    opt = torch.optim.SGD(mod.parameters(), lr=1.0)
    sc = torch.amp.GradScaler("cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1)
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(mod(x), y)
        sc.scale(loss).backward()
        if i == 2:
            mod[1].weight.grad.data.fill_(math.inf)
        sc.step(opt)
        sc.update()
    return {
        "init": [values(p) for p in init],
        "data": [[values(x), values(y)] for x, y in data],
        "final": [values(p) for p in mod.parameters()],
        "scale": sc.get_scale(),
    }


def main():
    goldens = {
        "torch_version": torch.__version__,
        "trajectories": [trajectory(*c) for c in CONFIGS],
        "update_kernel": update_kernel(),
        "inv_scale": inv_scale(),
        "scale_outputs": scale_outputs(),
        "scaling_case": scaling_case(),
    }
    goldens["trajectories"].append(trajectory(*SUBNORMAL))
    OUT.write_text(json.dumps(goldens, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
