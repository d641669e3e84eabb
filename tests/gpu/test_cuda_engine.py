"""The engine's CUDA path: same answers as the CPU. Skipped where no GPU is present (run by
benchmarks/gpu.sh on a GPU host); the CPU fallback of every step runs in the rest of the suite."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models.predictor import Predictor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def pair(tiny_model: Path) -> tuple[Predictor, Predictor]:
    return Predictor.from_dir(tiny_model, device="cpu"), Predictor.from_dir(
        tiny_model, device="cuda"
    )


def _pixels(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("n", [1, 7, 64])
def test_cuda_run_and_decision_match_cpu(pair: tuple[Predictor, Predictor], n: int) -> None:
    cpu, gpu = pair
    x = _pixels(n)
    for members in ("p", "q"):
        opts = cpu.options(vgmu_on=members, top_k=5)
        want = cpu.score_columns(cpu.run([x]), opts).data
        got = gpu.score_columns(gpu.run([x[: n // 2], x[n // 2 :]]), opts).data
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_cuda_graphs_bucketed_match_eager(tiny_model: Path) -> None:
    eager = Predictor.from_dir(tiny_model, device="cuda")
    compiled = Predictor.from_dir(tiny_model, device="cuda")
    assert compiled.compile(warm_up=(8, 64))
    for n in (5, 8, 33):
        x = _pixels(n)
        opts = eager.options(top_k=3)
        np.testing.assert_allclose(
            compiled.score_columns(compiled.run([x]), opts).data,
            eager.score_columns(eager.run([x]), opts).data,
            rtol=1e-4,
            atol=1e-5,
        )


def test_compiled_in_one_thread_runs_in_another(tiny_model: Path) -> None:
    """The engine loads (compiles, captures) on a loader thread and computes on its compute
    thread: the captured graphs must serve there with the same answers."""
    from concurrent.futures import ThreadPoolExecutor

    from models.predictor import bucket_sizes

    eager = Predictor.from_dir(tiny_model, device="cuda")
    with ThreadPoolExecutor(1) as loader:
        compiled = loader.submit(lambda: Predictor.from_dir(tiny_model, device="cuda")).result()
        assert loader.submit(compiled.compile, bucket_sizes(32)).result()
    with ThreadPoolExecutor(1) as compute:
        for n in (1, 3, 32, 17, 64):
            x = _pixels(n)
            opts = eager.options(top_k=3, abstain_k=0.5 + n)

            def serve(x: torch.Tensor = x, opts=opts):  # noqa: ANN001, ANN202
                return compiled.score_columns(compiled.run([x]), opts)

            got = compute.submit(serve).result()
            want = eager.score_columns(eager.run([x]), opts)
            np.testing.assert_allclose(got.data, want.data, rtol=1e-4, atol=1e-5)


def test_vge_serve_on_cuda_answers_like_the_library(
    tmp_path: Path, tiny_model: Path, pngs: list[bytes], library
) -> None:  # noqa: ANN001
    """The whole process tree on the GPU (compile: auto, i.e. on): same answers as the CPU library."""
    from tests.service.conftest import approx_result, start_server

    srv = start_server(tmp_path, tiny_model, device="cuda", max_batch_size=16, workers=2)
    try:
        with srv.client() as c:
            assert c.get("/v1/models").json()["models"][0]["device"].startswith("cuda")
            files = [("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(pngs[:9])]
            r = c.post("/v1/predict", files=files, params={"top_k": 3})
            assert r.status_code == 200, r.text
            for got, png in zip(r.json()["results"], pngs[:9], strict=True):
                approx_result(got, library(png, top_k=3))
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("members", ["p", "q"])
def test_every_documented_pair_works_on_cuda(
    pair: tuple[Predictor, Predictor], members: str
) -> None:
    """``score(forward(x))`` (host tensors into the CUDA decision; it raised ``Pointer argument
    cannot be accessed from Triton (cpu tensor?)`` before issue 26), ``score_columns(forward(x))``
    and ``score_columns(run(parts))`` give the CPU predictor's answers."""
    cpu, gpu = pair
    pixels = _pixels(9)
    x = torch.stack([cpu.prepare(img) for img in pixels])
    out = gpu.forward(x)
    assert out.p.device.type == "cpu"  # forward's documented contract: host tensors
    want = cpu.score(cpu.forward(x), vgmu_on=members, top_k=3)
    got = gpu.score(out, vgmu_on=members, top_k=3)
    assert [r["prediction"] for r in got] == [r["prediction"] for r in want]
    assert [r["abstain"] for r in got] == [r["abstain"] for r in want]
    np.testing.assert_allclose(
        [r["vgmu"] for r in got], [r["vgmu"] for r in want], rtol=1e-4, atol=1e-5
    )
    opts = cpu.options(vgmu_on=members, top_k=3)
    want_cols = cpu.score_columns(cpu.run([pixels]), opts).data
    for columns in (gpu.score_columns(out, opts), gpu.score_columns(gpu.run([pixels]), opts)):
        np.testing.assert_allclose(columns.data, want_cols, rtol=1e-4, atol=1e-5)
