"""Triton's own tooling against a live server, unchanged: perf_analyzer (the binary in the
``tritonclient`` wheel) over HTTP and gRPC with the inputs it generates from the metadata and the
model configuration, and ``tritonclient``'s model configuration, repository index and statistics
calls over both protocols (issue 27).

One server for the module, two front ends sharing both ports (so the statistics must be the whole
server's, not one front end's). perf_analyzer runs in ``count_windows`` mode with small counts
and a stability criterion it always meets: the test asserts that it completes without errors,
never how fast (no timed assertions).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

tritonclient_http = pytest.importorskip("tritonclient.http")
import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.service.conftest import Server, free_port, start_server  # noqa: E402

MAX_IMAGES = 16


def _perf_analyzer() -> tuple[Path, dict[str, str]]:
    """perf_analyzer from the tritonclient wheel (installed next to this Python), and an
    environment whose LD_LIBRARY_PATH holds libcudart.so.12 from the nvidia-cuda-runtime-cu12
    wheel (perf_analyzer links it even on a CPU-only host; libb64 comes from Debian's
    libb64-0d, scripts/install-system-deps.sh)."""
    exe = Path(sys.executable).with_name("perf_analyzer")
    if not exe.exists():
        pytest.fail("perf_analyzer is not installed: pip install -e '.[test]' (tritonclient[all])")
    import nvidia.cuda_runtime

    lib = Path(next(iter(nvidia.cuda_runtime.__path__))) / "lib"
    if not (lib / "libcudart.so.12").exists():
        pytest.fail(f"no libcudart.so.12 in {lib}: pip install nvidia-cuda-runtime-cu12")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p
    )
    return exe, env


@pytest.fixture(scope="module")
def triton_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[tuple[Server, int]]:
    """A server with HTTP and gRPC, two front ends; ``models_root`` holds two loadable models,
    one of them exposed in the repository index (``VGE_REPOSITORY_INDEX_MODELS``)."""
    from tests.service.conftest import copy_model

    work = tmp_path_factory.mktemp("triton")
    copy_model(tiny_model, work / "models" / "tiny-next", "2.0.0")
    copy_model(tiny_model, work / "models" / "job-0123456789ab", "3.0.0")  # not exposed
    port = free_port()
    srv = start_server(
        work, tiny_model, workers=2, grpc_port=port, max_images=MAX_IMAGES,
        max_batch_size=8, max_queue_delay_ms=3, repository_index_models="tiny-next,absent",
    )  # fmt: skip
    yield srv, port
    assert srv.stop() == 0, srv.log()


def _run_perf_analyzer(url: str, protocol: str, *extra: str) -> str:
    exe, env = _perf_analyzer()
    cmd = [
        str(exe), "-m", "tiny", "-u", url, "-i", protocol,
        "--measurement-mode", "count_windows", "--measurement-request-count", "20",
        "-s", "1000", "-r", "3", *extra,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "Throughput:" in out and "error" not in out.lower(), out[-4000:]
    assert "missing statistics" not in out, out[-4000:]  # v2_core.SERVER_EXTENSIONS
    return out


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_runs_to_completion(triton_server: tuple[Server, int], protocol: str) -> None:
    """``perf_analyzer -m tiny -i http|grpc`` with its generated inputs, then with
    ``--shape images:1,28,28`` and a batch of 4 at concurrency 2: no errors, every request
    answered (it stopped at once with "failed to get model config: Not Found" before)."""
    srv, grpc_port = triton_server
    url = srv.url.removeprefix("http://") if protocol == "http" else f"127.0.0.1:{grpc_port}"
    before = _stats_http(srv)
    out = _run_perf_analyzer(url, protocol)
    _run_perf_analyzer(url, protocol, "--shape", "images:1,28,28", "-b", "4",
                       "--concurrency-range", "2")  # fmt: skip
    m = re.search(r"Request count: (\d+)", out)
    assert m and int(m.group(1)) > 0, out
    after = _stats_http(srv)
    # the server counted them (perf_analyzer's own requests, over both front ends)
    assert (
        after["inference_stats"]["success"]["count"]
        > before["inference_stats"]["success"]["count"] + int(m.group(1)) - 1
    )
    assert "Traceback" not in srv.log(), srv.log()


def _stats_http(srv: Server) -> dict[str, object]:
    client = tritonclient_http.InferenceServerClient(url=srv.url.removeprefix("http://"))
    try:
        stats = client.get_inference_statistics("tiny")["model_stats"]
    finally:
        client.close()
    assert len(stats) == 1 and stats[0]["name"] == "tiny"
    return stats[0]


def _infer_http(srv: Server, n: int) -> None:
    client = tritonclient_http.InferenceServerClient(url=srv.url.removeprefix("http://"))
    inp = tritonclient_http.InferInput("images", [n, 1, 28, 28], "UINT8")
    inp.set_data_from_numpy(np.zeros((n, 1, 28, 28), np.uint8))
    client.infer("tiny", [inp])
    client.close()


def test_model_config_over_http_and_grpc(triton_server: tuple[Server, int]) -> None:
    """Triton's configuration schema: max_batch_size (images per request), the images input
    (UINT8, NCHW, dims without the batch dim), outputs, the batcher, the normalisation."""
    srv, grpc_port = triton_server
    http = tritonclient_http.InferenceServerClient(url=srv.url.removeprefix("http://"))
    config = http.get_model_config("tiny")
    assert config["name"] == "tiny" and config["max_batch_size"] == MAX_IMAGES
    assert config["input"] == [{"name": "images", "data_type": "TYPE_UINT8",
                                "format": "FORMAT_NCHW", "dims": [1, 28, 28],
                                "optional": False}]  # fmt: skip
    outputs = {o["name"]: o for o in config["output"]}
    assert outputs["probabilities"]["dims"] == [10]
    assert outputs["abstain"]["data_type"] == "TYPE_BOOL" and outputs["vgmu"]["dims"] == [1]
    assert config["dynamic_batching"] == {
        "preferred_batch_size": [8], "max_queue_delay_microseconds": 3000,
    }  # fmt: skip
    params = {k: v["string_value"] for k, v in config["parameters"].items()}
    mean, std = (httpx.get(srv.url + "/v1/models", timeout=10).json()["models"][0][k]
                 for k in ("input_mean", "input_std"))  # fmt: skip
    assert params["input_mean"] == str(mean) and params["input_std"] == str(std)
    version = http.get_model_metadata("tiny")["versions"][0]
    assert http.get_model_config("tiny", version)["name"] == "tiny"
    with pytest.raises(InferenceServerException, match="no version"):
        http.get_model_config("tiny", "9.9.9")
    with pytest.raises(InferenceServerException, match="unknown model"):
        http.get_model_config("nope")
    http.close()

    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    g = grpc.get_model_config("tiny", as_json=True)["config"]
    assert g["name"] == "tiny" and int(g["max_batch_size"]) == MAX_IMAGES
    assert g["input"][0]["format"] == "FORMAT_NCHW"
    assert [int(d) for d in g["input"][0]["dims"]] == [1, 28, 28]
    assert g["dynamic_batching"]["max_queue_delay_microseconds"] in (3000, "3000")
    assert g["parameters"]["input_mean"]["string_value"] == str(mean)
    with pytest.raises(InferenceServerException, match="no version") as err:
        grpc.get_model_config("tiny", "9.9.9")
    assert err.value.status() == "StatusCode.NOT_FOUND"
    grpc.close()


def test_repository_index_and_load_refusal(triton_server: tuple[Server, int]) -> None:
    """The served model READY, the loadable one under models_root UNAVAILABLE with how to serve
    it; load/unload a 400 / FAILED_PRECONDITION naming /v1/models/promote, not a 404 or
    UNIMPLEMENTED with a traceback."""
    srv, grpc_port = triton_server
    http = tritonclient_http.InferenceServerClient(url=srv.url.removeprefix("http://"))
    index = {m["name"]: m for m in http.get_model_repository_index()}
    assert index["tiny"]["state"] == "READY"
    assert index["tiny-next"]["state"] == "UNAVAILABLE" and index["tiny-next"]["version"] == "2.0.0"
    assert "/v1/models/promote" in index["tiny-next"]["reason"]
    # what the operator exposes: the served model, the shipped ones and tiny-next; not the
    # other directory under models_root, nor a listed name that is not there
    from models.zoo import zoo_models

    assert set(index) == {"tiny", "tiny-next", *zoo_models()}
    # cards are read again only when they change (mtime): a new version shows
    card = next(Path(srv.log_path.parent / "models" / "tiny-next").glob("*.json"))
    data = json.loads(card.read_text())
    card.write_text(json.dumps({**data, "version": "2.0.1"}))
    index = {m["name"]: m for m in http.get_model_repository_index()}
    assert index["tiny-next"]["version"] == "2.0.1"
    card.write_text(json.dumps(data))
    r = httpx.post(srv.url + "/v2/repository/index", json={"ready": True}, timeout=10)
    assert [m["name"] for m in r.json()] == ["tiny"]
    for action in ("load", "unload"):
        r = httpx.post(f"{srv.url}/v2/repository/models/tiny-next/{action}", timeout=10)
        assert r.status_code == 400 and "/v1/models/promote" in r.json()["error"], r.text
    with pytest.raises(InferenceServerException, match="/v1/models/promote"):
        http.load_model("tiny-next")
    http.close()

    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    g = {m["name"]: m for m in grpc.get_model_repository_index(as_json=True)["models"]}
    assert g["tiny"]["state"] == "READY" and g["tiny-next"]["state"] == "UNAVAILABLE"
    for call in (grpc.load_model, grpc.unload_model):
        with pytest.raises(InferenceServerException, match="/v1/models/promote") as err:
            call("tiny-next")
        assert err.value.status() == "StatusCode.FAILED_PRECONDITION"
    # an RPC this server does not offer: UNIMPLEMENTED with a message, no traceback in the log
    with pytest.raises(InferenceServerException, match="not supported by vge-serve") as err:
        grpc.get_system_shared_memory_status()
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    grpc.close()
    assert "Traceback" not in srv.log() and "NotImplementedError" not in srv.log(), srv.log()


def test_inference_statistics_over_http_and_grpc(triton_server: tuple[Server, int]) -> None:
    """Statistics in Triton's shape, the whole server's (two front ends): a request of 5 images
    adds 5 inferences, one request to success/queue/compute_infer and at least one execution;
    both protocols report the same counts."""
    srv, grpc_port = triton_server
    before = _stats_http(srv)
    _infer_http(srv, 5)
    after = _stats_http(srv)
    assert after["inference_count"] == before["inference_count"] + 5
    assert after["execution_count"] >= before["execution_count"] + 1
    for key in ("success", "queue", "compute_infer"):
        assert after["inference_stats"][key]["count"] == before["inference_stats"][key]["count"] + 1
        assert after["inference_stats"][key]["ns"] > before["inference_stats"][key]["ns"]
    s = after["inference_stats"]
    assert s["success"]["ns"] == s["queue"]["ns"] + s["compute_infer"]["ns"]
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    g = grpc.get_inference_statistics("tiny", as_json=True)["model_stats"][0]
    assert int(g["inference_count"]) == after["inference_count"]
    assert int(g["inference_stats"]["success"]["count"]) == s["success"]["count"]
    everything = grpc.get_inference_statistics(as_json=True)["model_stats"]  # no name: all models
    assert [m["name"] for m in everything] == ["tiny"]
    with pytest.raises(InferenceServerException, match="unknown model") as err:
        grpc.get_inference_statistics("nope")
    assert err.value.status() == "StatusCode.NOT_FOUND"
    grpc.close()
    r = httpx.get(srv.url + "/v2/models/tiny/versions/9.9.9/stats", timeout=10)
    assert r.status_code == 404 and "no version" in r.json()["error"]
