"""The engine alone: its CPU per request, without HTTP.

    python -m benchmarks.engine [--model lenet5-lle-vgn-mnist] [--device cpu] [--clients 4]
                                [--conc 64] [--seconds 4] [--rounds 3]

Starts the real engine process as ``vge serve`` does (spawned, its own Unix socket, one
shared-memory arena per client) and connects ``--clients`` :class:`~service.frontend.engine_client.EngineClient`
instances, the front ends' own code, from this process. They keep ``--conc`` single-image requests
in flight (a real MNIST digit's pixels written into the arena, as a front end's decoder does), and
the benchmark reads the engine's threads' CPU time from ``/proc`` over each round: µs of CPU per
request of the engine's event loop (its main thread: frames in, queueing, answers out) and of its
other threads (the compute thread: gathering, forward, scoring, slicing answers).

On a GPU host the engine's Python is what limits single-image serving (docs/benchmarks.md,
"Reading the GPU host numbers"): this measures it on any machine, with no HTTP stack or load
client sharing the engine's core budget in the numbers. The mean batch (the engine's own
``vge_batch_size`` histogram) is printed beside it, since per-batch work is spread over the batch.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def process_thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds used so far by each thread of ``pid`` (``/proc``)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # exited meanwhile
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _batch_sums(metrics_dir: Path) -> tuple[float, float]:
    """The engine's ``vge_batch_size`` histogram: (sum of images, number of batches)."""
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, str(metrics_dir))
    total = count = 0.0
    for family in registry.collect():
        if family.name == "vge_batch_size":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count


async def _drive(args: argparse.Namespace, socket_path: str, arenas: list[str], size: int,
                 engine_pid: int, metrics_dir: Path) -> list[dict[str, float]]:  # fmt: skip
    from service.common.shm import Arena
    from service.frontend.engine_client import EngineClient

    image = np.load(REPO / "models" / "data" / "mnist-8k.npz")["images"][-1]  # (28, 28) uint8
    clients = [EngineClient(socket_path, Arena(path, size)) for path in arenas]
    for client in clients:
        client.start()
    for client in clients:
        if not await client.wait_ready(120.0):
            raise SystemExit("benchmarks.engine: the engine did not become ready")
    model = clients[0].current_model()
    options = model.options(abstain_k=None, vgmu_on=None, top_k=1, default_abstain_k=None)
    pixels = np.broadcast_to(image, (1, *model.input_shape))
    done = 0
    stop = False

    async def worker(client: EngineClient) -> None:
        nonlocal done
        while not stop:
            region = client.allocate("uint8", (1, *model.input_shape))
            np.copyto(region.array, pixels)
            await client.infer(model, region, options, 10.0)
            done += 1

    tasks = [asyncio.create_task(worker(clients[i % len(clients)])) for i in range(args.conc)]
    await asyncio.sleep(args.warmup)
    rounds = []
    for _ in range(args.rounds):
        cpu0, own0, n0, t0 = process_thread_cpu(engine_pid), _own_cpu(), done, time.perf_counter()
        images0, batches0 = _batch_sums(metrics_dir)
        await asyncio.sleep(args.seconds)
        cpu1, own1, n1, t1 = process_thread_cpu(engine_pid), _own_cpu(), done, time.perf_counter()
        images1, batches1 = _batch_sums(metrics_dir)
        n = max(n1 - n0, 1)
        loop = cpu1.get(engine_pid, 0.0) - cpu0.get(engine_pid, 0.0)
        other = sum(cpu1.values()) - sum(cpu0.values()) - loop
        rounds.append({
            "req/s": n / (t1 - t0),
            "batch": (images1 - images0) / max(batches1 - batches0, 1),
            "loop": loop / n * 1e6,
            "other": other / n * 1e6,
            "client": (own1 - own0) / n * 1e6,
        })  # fmt: skip
    stop = True
    await asyncio.gather(*tasks, return_exceptions=True)
    for client in clients:
        await client.close()
    return rounds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="lenet5-lle-vgn-mnist", help="zoo name or directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, default=4, help="front ends simulated")
    parser.add_argument("--conc", type=int, default=64, help="requests in flight")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before the first round")
    parser.add_argument("--max-batch-size", type=int, default=0, help="0: the server's default")
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= args.conc:
        parser.error("--clients must be between 1 and --conc")
    return args


def measure(args: argparse.Namespace) -> list[dict[str, float]]:
    """Start an engine, drive it, stop it; one dict per round (see :func:`main`'s columns)."""

    workdir = Path(tempfile.mkdtemp(prefix="vge-bench-engine-"))
    metrics_dir = workdir / "metrics"
    metrics_dir.mkdir()
    # As the supervisor does, before prometheus-client is imported anywhere (restored after: the
    # directory goes with the run).
    previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    from benchmarks.peers import model_dir
    from service.common.settings import Settings
    from service.common.shm import create_arena_file
    from service.engine.engine import engine_main

    settings = Settings(
        model_dir=model_dir(args.model),
        device=args.device,
        max_batch_size=args.max_batch_size,
        jobs_db_url=f"sqlite:///{workdir / 'jobs.sqlite3'}",
        models_root=workdir / "models",
        jobs_dir=workdir / "jobs",
        data_root=workdir / "data",
    )
    size = settings.shm_mb_per_worker * 1024 * 1024
    arenas = []
    for i in range(args.clients):
        create_arena_file(workdir / f"{i}.arena", size)
        arenas.append(str(workdir / f"{i}.arena"))
    socket_path = str(workdir / "engine.sock")
    spawn = mp.get_context("spawn")
    ready = spawn.Event()
    engine = spawn.Process(target=engine_main, args=(settings, socket_path, ready))
    engine.start()
    try:
        if not ready.wait(180):
            raise SystemExit("benchmarks.engine: the engine did not start")
        try:
            import uvloop

            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        except ImportError:
            runner = asyncio.Runner()
        with runner:
            rounds = runner.run(
                _drive(args, socket_path, arenas, size, engine.pid, metrics_dir)  # type: ignore[arg-type]
            )
    finally:
        engine.terminate()
        engine.join(30)
        shutil.rmtree(workdir, ignore_errors=True)
        if previous is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous
    return rounds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rounds = measure(args)

    def cell(key: str, fmt: str = ",.0f") -> str:
        values = [r[key] for r in rounds]
        return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"

    print(f"engine alone: {args.model} on {args.device}, {args.clients} clients, "
          f"{args.conc} single-image requests in flight, {args.rounds} rounds of {args.seconds:g} s")  # fmt: skip
    print(
        "| req/s | mean batch | engine loop µs/req | engine other threads µs/req | client µs/req |"
    )
    print("|---:|---:|---:|---:|---:|")
    print(f"| {cell('req/s')} | {cell('batch', '.1f')} | {cell('loop', '.1f')} | "
          f"{cell('other', '.1f')} | {cell('client', '.1f')} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
