"""Float16 data-parallel training over several processes with ``jax.distributed``, autocast and jamp.scaler.

    python examples/multiprocess.py                  # launches 2 workers x 2 CPU devices on 127.0.0.1
    python examples/multiprocess.py --coordinator HOST:PORT --num-processes N --process-id I [--cpu-devices K]

Without ``--coordinator`` the script is its own launcher: it picks a free port on 127.0.0.1, starts two
copies of itself as processes 0 and 1 with two CPU devices each and gloo collectives, and stops them all
if one fails or the time runs out. With ``--coordinator`` it is one process of a cluster: start it once
per host with the same coordinator address (a reachable host and free port, by convention process 0's)
and process ids 0..N-1. On GPU or TPU hosts leave out ``--cpu-devices``; JAX then uses the accelerators
and their own collectives.

Parameters are replicated over one mesh axis spanning every device of every process, and each process
feeds its own slice of the global batch. At ``--overflow-step`` only the last process's data overflows
float16. The scaler's check is part of the one jitted program, so its all-reduce covers all processes:
every process skips the same steps and ends with bit-identical parameters and scale, which each process
verifies by gathering every process's fingerprint of its state.
"""

from __future__ import annotations

import argparse
import hashlib
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jamp

FEATURES, HIDDEN, PER_PROCESS = 32, 128, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coordinator", help="HOST:PORT of process 0; omit to launch local workers")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--cpu-devices", type=int, default=0, help="run on K CPU devices per process (gloo)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--overflow-step", type=int, default=10, help="the last process's data overflows float16")
    parser.add_argument("--timeout", type=float, default=120.0, help="launcher: seconds before the workers are killed")
    return parser.parse_args()


# --- launcher ----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(args: argparse.Namespace) -> int:
    """Start the workers on loopback; return 0 when all succeed, else kill the rest and return non-zero."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--coordinator",
                coordinator,
                "--num-processes",
                str(args.num_processes),
                "--process-id",
                str(i),
                "--cpu-devices",
                "2",
                "--steps",
                str(args.steps),
                "--overflow-step",
                str(args.overflow_step),
            ]
        )
        for i in range(args.num_processes)
    ]
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                print("a worker failed or timed out; stopping the others", file=sys.stderr)
                return 1
            time.sleep(0.1)
        return max(p.returncode for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()


# --- worker ------------------------------------------------------------------------------------------------


def configure_and_join(args: argparse.Namespace) -> None:
    """Join the cluster; with ``--cpu-devices`` first make this process a K-device CPU host with gloo."""
    if args.cpu_devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)


def init_params(rng: np.random.Generator) -> dict:
    return {
        "w1": rng.standard_normal((FEATURES, HIDDEN), np.float32) / FEATURES**0.5,
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.standard_normal((HIDDEN, 1), np.float32) / HIDDEN**0.5,
    }


def mlp(params: dict, x: jax.Array) -> jax.Array:
    return (jax.nn.gelu(x @ params["w1"] + params["b1"]) @ params["w2"])[:, 0]


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jamp.autocast(mlp, dtype=jnp.float16)(params, x) - y) ** 2)


def make_step(tx: optax.GradientTransformation):
    @jax.jit
    def step(params, opt_state, x, y):
        def scaled_loss(p):
            loss = loss_fn(p, x, y)
            return jamp.scale(loss, opt_state), loss

        (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)  # scaled grads
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def local_batch(step: int, teacher: dict, overflow: bool) -> tuple[np.ndarray, np.ndarray]:
    """This process's slice of the global batch: its own data, from a seed of (step, process)."""
    rng = np.random.default_rng([step, jax.process_index()])
    x = rng.standard_normal((PER_PROCESS, FEATURES), np.float32)
    if overflow:
        x[0, 0] = 1e5  # inf in float16
    return x, (np.tanh(x @ teacher["w1"]) @ teacher["w2"][:, 0]).astype(np.float32)


def fingerprint(tree) -> np.ndarray:
    """uint32[local devices, 2]: 8 bytes of a SHA-256 over each local device's copy of every (replicated) leaf."""
    copies = [hashlib.sha256() for _ in jax.local_devices()]
    for leaf in jax.tree.leaves(tree):
        for h, shard in zip(copies, leaf.addressable_shards):
            h.update(np.asarray(shard.data).tobytes())
    return np.stack([np.frombuffer(h.digest()[:8], np.uint32) for h in copies])


def train(args: argparse.Namespace) -> None:
    me = f"[process {jax.process_index()}/{jax.process_count()}]"
    mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
    rng = np.random.default_rng(0)  # the same seed everywhere: identical initial parameters
    teacher = init_params(rng)
    params = jax.device_put(init_params(rng), replicated)
    tx = jamp.scaler(optax.adam(3e-3), init_scale=2.0**15, growth_interval=10)
    opt_state = jax.jit(tx.init, out_shardings=replicated)(params)
    step = make_step(tx)
    print(
        f"{me} {jax.local_device_count()} local of {jax.device_count()} devices on {jax.devices()[0].platform}",
        flush=True,
    )

    skipped = []
    for i in range(args.steps):
        overflow = i == args.overflow_step and jax.process_index() == jax.process_count() - 1
        x, y = (jax.make_array_from_process_local_data(sharded, a) for a in local_batch(i, teacher, overflow))
        params, opt_state, loss = step(params, opt_state, x, y)
        if bool(jamp.found_inf(opt_state)):
            skipped.append(i)

    everyone = multihost_utils.process_allgather(fingerprint((params, opt_state)))
    print(
        f"{me} skipped steps: {skipped}\n{me} final loss: {float(loss):.4f}\n"
        f"{me} scale: {float(jamp.get_scale(opt_state)):.0f}\n"
        f"{me} processes agree: {bool(np.all(everyone == everyone[0, 0]))}",
        flush=True,
    )
    jax.distributed.shutdown()


def main() -> None:
    args = parse_args()
    if args.coordinator is None:
        sys.exit(launch_local(args))
    configure_and_join(args)
    train(args)


if __name__ == "__main__":
    main()
