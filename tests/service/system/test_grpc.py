"""The KServe V2 gRPC service, with the stock ``tritonclient.grpc`` client, against a live server
with two front ends sharing the gRPC port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.service.conftest import Server, free_port, start_server

#: The reviewer key of :func:`grpc_server` (its review queue is on: ``review=always`` needs a key).
REVIEWER_KEY = "grpc-reviewer-key"


@pytest.fixture(scope="module")
def grpc_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[tuple[Server, int]]:
    port = free_port()
    srv = start_server(
        tmp_path_factory.mktemp("grpc"), tiny_model, workers=2, grpc_port=port,
        review_queue="on", reviewer_key=REVIEWER_KEY,
    )  # fmt: skip
    yield srv, port
    assert srv.stop() == 0, srv.log()


def test_grpc_infer_equals_http_v2(grpc_server: tuple[Server, int], mnist) -> None:
    srv, port = grpc_server
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
    meta = client.get_model_metadata("tiny")
    # images alone: a request carries exactly one input, and stock tools send every listed one
    assert meta.name == "tiny" and [i.name for i in meta.inputs] == ["images"]
    assert list(meta.inputs[0].shape) == [-1, 1, 28, 28]
    assert client.is_model_ready("tiny", meta.versions[0])
    for call in (client.is_model_ready, client.get_model_metadata):  # a version not served
        with pytest.raises(InferenceServerException, match="no version"):
            call("tiny", "9.9.9")
    images = mnist[0][-5:][:, None].copy()  # (5, 1, 28, 28) uint8
    inp = grpcclient.InferInput("images", list(images.shape), "UINT8")
    inp.set_data_from_numpy(images)
    outs = [
        grpcclient.InferRequestedOutput(n)
        for n in ("probabilities", "prediction", "vgmu", "abstain")
    ]
    # an integer abstain_k: tritonclient 2.41's gRPC client (pinned for its perf_analyzer) sends
    # bool, int and str parameters only; floats are covered over HTTP (test_v2.py)
    result = client.infer("tiny", [inp], outputs=outs, parameters={"abstain_k": 2})
    body = {
        "inputs": [{"name": "images", "shape": list(images.shape), "datatype": "UINT8",
                    "data": images.reshape(-1).tolist()}],
        "parameters": {"abstain_k": 2},
    }  # fmt: skip
    want = {o["name"]: o["data"] for o in httpx.post(
        f"{srv.url}/v2/models/tiny/infer", json=body, timeout=30).json()["outputs"]}  # fmt: skip
    assert result.as_numpy("prediction").tolist() == want["prediction"]
    assert result.as_numpy("abstain").tolist() == want["abstain"]
    np.testing.assert_allclose(result.as_numpy("probabilities").reshape(-1), want["probabilities"],
                               rtol=1e-5)  # fmt: skip
    np.testing.assert_allclose(result.as_numpy("vgmu"), want["vgmu"], rtol=1e-5)
    for bad in ({"abstain_k": True}, {"timeout_s": "soon"}, {"vgmu_on": "x"}):  # as REST checks
        with pytest.raises(InferenceServerException, match=next(iter(bad))):
            client.infer("tiny", [inp], outputs=outs, parameters=bad)
    client.close()


def test_grpc_errors_are_statuses(grpc_server: tuple[Server, int]) -> None:
    _, port = grpc_server
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    bad = grpcclient.InferInput("images", [1, 1, 28, 28], "INT32")
    bad.set_data_from_numpy(np.zeros((1, 1, 28, 28), np.int32))
    with pytest.raises(InferenceServerException, match="datatype") as err:
        client.infer("tiny", [bad])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    ok = grpcclient.InferInput("images", [1, 1, 28, 28], "UINT8")
    ok.set_data_from_numpy(np.zeros((1, 1, 28, 28), np.uint8))
    with pytest.raises(InferenceServerException, match="unknown model") as err:
        client.infer("nope", [ok])
    assert err.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="requested more than once") as err:
        client.infer("tiny", [ok], outputs=[grpcclient.InferRequestedOutput("vgmu")] * 2)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    client.close()
    # a second raw_input_contents entry for the one input (it was ignored)
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="tiny")
    spec = request.inputs.add()
    spec.name, spec.datatype = "images", "UINT8"
    spec.shape.extend([1, 1, 28, 28])
    request.raw_input_contents.extend([bytes(784), bytes(784)])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as rpc:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents holds 2 entries for 1 input" in rpc.value.details()
    # binary_data_output as the string "false" (tritonclient refuses to send it; a raw client
    # can): refused as over HTTP, where "false" would have switched binary output on
    del request.raw_input_contents[1:]
    request.parameters["binary_data_output"].string_param = "false"
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as rpc:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "binary_data_output must be true or false" in rpc.value.details()


def test_grpc_review_always_needs_a_key_as_over_http(grpc_server: tuple[Server, int]) -> None:
    """``review=always`` without a key is UNAUTHENTICATED over gRPC where HTTP answers 401, and
    with a wrong key PERMISSION_DENIED where HTTP answers 403 (the error table's rows, not
    INTERNAL); with the key it is served."""
    srv, port = grpc_server
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    images = np.zeros((1, 1, 28, 28), np.uint8)
    inp = grpcclient.InferInput("images", list(images.shape), "UINT8")
    inp.set_data_from_numpy(images)
    body = {
        "inputs": [{"name": "images", "shape": [1, 1, 28, 28], "datatype": "UINT8",
                    "data": images.reshape(-1).tolist()}],
        "parameters": {"review": "always"},
    }  # fmt: skip
    for headers, http_status, grpc_status in (
        ({}, 401, "StatusCode.UNAUTHENTICATED"),
        ({"authorization": "Bearer wrong"}, 403, "StatusCode.PERMISSION_DENIED"),
    ):
        with pytest.raises(InferenceServerException, match="review=always needs") as err:
            client.infer("tiny", [inp], parameters={"review": "always"}, headers=headers)
        assert err.value.status() == grpc_status
        http = httpx.post(f"{srv.url}/v2/models/tiny/infer", json=body, headers=headers, timeout=30)
        assert http.status_code == http_status, http.text
        assert http.json()["code"] == ("unauthorized" if http_status == 401 else "forbidden")
    result = client.infer(
        "tiny", [inp], parameters={"review": "always"},
        headers={"authorization": f"Bearer {REVIEWER_KEY}"},
    )  # fmt: skip
    assert result.get_response().parameters["review_status"].string_param
    client.close()


def test_grpc_nhwc_images_and_unnormalised_fp32(grpc_server: tuple[Server, int], mnist) -> None:
    """The input rules of V2 HTTP over gRPC too: NHWC pixels answered like NCHW, FP32 pixels
    scaled to [0, 1] without the normalisation INVALID_ARGUMENT with the mean and std, and
    Triton's ``triton_enable_empty_final_response`` (perf_analyzer sends it) accepted."""
    _, port = grpc_server
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    images = mnist[0][-3:]

    def predict(arr: np.ndarray, **params: object) -> list[int]:
        inp = grpcclient.InferInput("images", list(arr.shape), "UINT8")
        inp.set_data_from_numpy(np.ascontiguousarray(arr))
        return client.infer("tiny", [inp], parameters=params).as_numpy("prediction").tolist()

    want = predict(images[:, None])
    assert predict(images[:, :, :, None], triton_enable_empty_final_response=False) == want
    scaled = (images[:, None] / 255.0).astype(np.float32)
    inp = grpcclient.InferInput("input", list(scaled.shape), "FP32")
    inp.set_data_from_numpy(scaled)
    with pytest.raises(InferenceServerException, match="looks like pixels scaled to") as err:
        client.infer("tiny", [inp])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "std" in str(err.value)
    client.close()


def test_grpc_prepare_parameter(grpc_server: tuple[Server, int]) -> None:
    """Over gRPC the same: a blank UINT8 page abstains by default, a bad prepare is
    INVALID_ARGUMENT."""
    from tritonclient.utils import InferenceServerException

    _, port = grpc_server
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    inp = grpcclient.InferInput("images", [1, 1, 28, 28], "UINT8")
    inp.set_data_from_numpy(np.full((1, 1, 28, 28), 240, np.uint8))
    out = client.infer("tiny", [inp], outputs=[grpcclient.InferRequestedOutput("abstain")])
    assert bool(out.as_numpy("abstain")[0]) is True
    with pytest.raises(InferenceServerException, match="prepare"):
        client.infer("tiny", [inp], parameters={"prepare": "resize"})
    client.close()
