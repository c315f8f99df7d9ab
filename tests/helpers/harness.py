"""Run a function on several processes joined by a gloo process group, with a hard timeout."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 300
# Seconds any collective of a test may wait for the other ranks before it raises (the process groups' timeout, and
# VLMCP_TIMEOUT for the CP groups of launched scripts): a hang becomes an error naming the collective well before
# the run's own wall-clock bound, which only stops a run that neither finishes nor fails.
HANG_TIMEOUT = 120
STACK_DUMP_SIGNAL = signal.SIGUSR1  # each rank dumps every thread's stack on it (faulthandler)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = Path(__file__).resolve().parents[2]


def _launcher(kind: str, procs: int) -> list[str]:
    """The command prefix that runs a module on `procs` local processes with the launcher `kind`."""
    python = [sys.executable, "-m"]
    if kind == "python":
        return python
    if kind == "torchrun":
        return [*python, "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port", str(free_port()),
                "-m"]
    if kind == "accelerate":
        return [*python, "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(procs), "--num_machines",
                "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
                "-m"]
    if kind in ("accelerate_fsdp2", "accelerate_config"):  # accelerate launch with a config file
        config = ROOT / ("examples/accelerate_fsdp2.yaml" if kind == "accelerate_fsdp2" else
                         "tests/helpers/accelerate_ddp.yaml")
        return [*python, "accelerate.commands.launch", "--config_file", str(config), "--num_processes", str(procs),
                "--main_process_port", str(free_port()), "-m"]
    if kind == "deepspeed":
        return [*python, "deepspeed.launcher.runner", "--num_gpus", str(procs), "--master_port", str(free_port()),
                "--module"]
    raise ValueError(kind)


def launch(script: str | Path, args=(), *, procs: int = 1, launcher: str = "torchrun", env: dict | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `script ARGS` on `procs` processes under `launcher` (python, torchrun, accelerate, accelerate_fsdp2,
    accelerate_config: DDP from tests/helpers/accelerate_ddp.yaml, deepspeed) from the repository root, through
    tests/helpers/run_script.py (no interpreter finalization at exit); bounded in time."""
    cmd = [*_launcher(launcher, procs), "tests.helpers.run_script", str(script), *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "VLMCP_TIMEOUT": str(HANG_TIMEOUT), **(env or {})}
    # A session of its own: on timeout the launcher *and* its ranks are killed, so no orphaned rank keeps
    # its port and a CPU busy for the tests that follow.
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=ROOT,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _dump_stacks_then_kill(lambda sig: os.killpg(proc.pid, sig))
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _dump_stacks_then_kill(send) -> None:
    """Ask every process to print its threads' stacks (to its stderr, which the test captures), give them a moment,
    then kill them: a hung run shows where each rank waits."""
    import time

    for sig in (STACK_DUMP_SIGNAL, signal.SIGKILL):
        try:
            send(sig)
        except ProcessLookupError:  # it ended meanwhile
            return
        time.sleep(3 if sig == STACK_DUMP_SIGNAL else 0)


def dump_stacks_on_signal() -> None:
    """In a rank: print every thread's stack to stderr on STACK_DUMP_SIGNAL."""
    import faulthandler

    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)


# Imported once by the fork server that starts every spawned rank: each rank forks from a process that already
# holds torch and the modelling code, instead of importing them again (seconds per rank on two cores). The
# package itself is not preloaded: each rank imports it fresh, with its own environment.
PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.qwen3_vl.modeling_qwen3_vl",
           "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "transformers.models.qwen3_5.modeling_qwen3_5",
           "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"]


def _forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(fn, rank, world_size, port, results, args, env, timeout):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    import datetime

    import torch
    import torch.distributed as dist

    from tests.helpers import wrapped_check

    wrapped_check.install()  # every torch.distributed call of the package goes through its wrapper
    torch.set_num_threads(1)
    dump_stacks_on_signal()
    ok = False
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=min(timeout, HANG_TIMEOUT)))
        result = fn(rank, world_size, *args)
        if (bypassed := wrapped_check.failure()) is not None:
            raise AssertionError(bypassed)
        results.put((rank, "ok", result))
        ok = True
    except BaseException:  # noqa: BLE001 - report anything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            if ok:
                dist.barrier()  # success only: a failed peer would never join
            dist.destroy_process_group()
        # Skip interpreter finalization: a gloo worker thread that drops the last reference to a tensor
        # while the interpreter shuts down aborts the process (CPython < 3.14). Flush the results first.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if ok else 1)


def run_distributed(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, env: dict | None = None):
    """`fn(rank, world_size, *args)` on `world_size` spawned processes; returns the results in rank order.

    Any rank's exception fails the call with that rank's traceback. A collective that waits longer than
    `HANG_TIMEOUT` raises in its rank; if the ranks do not all finish within `timeout` seconds, every process prints
    its stacks and is killed, and the call fails.
    """
    ctx = _forkserver()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, results, args, env or {}, timeout),
                    daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out, errors = {}, []
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for p in procs:
                    if p.is_alive():
                        _dump_stacks_then_kill(lambda sig, pid=p.pid: os.kill(pid, sig))
                raise TimeoutError(f"{fn.__name__} on {world_size} processes did not finish within {timeout}s "
                                   "(each rank's stacks are printed above, in the captured stderr)")
            try:
                rank, status, value = results.get(timeout=min(remaining, 5))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and results.empty():
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    raise RuntimeError(f"rank(s) {dead} died without reporting") from None
                continue
            if status == "ok":
                out[rank] = value
            else:
                errors.append((rank, value))
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank, tb = errors[0]
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    return [out[r] for r in range(world_size)]
