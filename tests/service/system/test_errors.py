"""Every client mistake is a 4xx JSON error naming the problem; auth on management endpoints."""

from __future__ import annotations

import base64

import pytest
import torch

from tests.service.conftest import API_KEY, Server


def _error(r, status: int, *words: str) -> None:  # noqa: ANN001
    assert r.status_code == status, r.text
    body = r.json()
    assert isinstance(body["error"], str) and body["error"]
    for w in words:
        assert w in body["error"], body["error"]


def test_client_mistakes(server: Server, pngs: list[bytes]) -> None:
    png = pngs[0]
    big = png + b"\0" * 30_000  # over max_image_bytes=20000
    with server.client() as c:
        _error(c.post("/v1/predict", files=[("images", ("x.txt", b"hello, not an image"))]),
               400, "image 0", "decoded")  # fmt: skip
        _error(c.post("/v1/predict", files=[("images", ("t.png", png[: len(png) // 2]))]),
               400, "image 0")  # fmt: skip
        _error(c.post("/v1/predict", json={"images": ["%%%"]}), 400, "base64")
        _error(c.post("/v1/predict", json={"images": []}), 422, "at least 1 item")
        # a file under another name would be scored without a word: refused, naming the field
        _error(c.post("/v1/predict", files=[("image", ("a.png", png))]), 422, "unknown file field")
        # an option given twice must agree (the same value twice is fine)
        _error(c.post("/v1/predict", params={"top_k": 2}, data={"top_k": "3"},
                      files=[("images", ("a.png", png))]), 422, "top_k is given twice")  # fmt: skip
        ok = c.post("/v1/predict", params={"abstain_k": "0.50"}, data={"abstain_k": "0.5"},
                    files=[("images", ("a.png", png))])  # fmt: skip
        assert ok.status_code == 200 and ok.json()["results"][0]["abstain_k"] == 0.5, ok.text
        empty = b'--b\r\nContent-Disposition: form-data; name="top_k"\r\n\r\n2\r\n--b--\r\n'
        _error(c.post("/v1/predict", content=empty,
                      headers={"content-type": "multipart/form-data; boundary=b"}),
               400, "no images")  # fmt: skip
        _error(c.post("/v1/predict", content=b"{not json", headers={"content-type": "application/json"}),
               400, "JSON")  # fmt: skip
        _error(c.post("/v1/predict", content=b"x", headers={"content-type": "text/plain"}),
               400, "content type")  # fmt: skip
        _error(c.post("/v1/predict", files=[("images", ("big.png", big))]), 413, "limit")
        too_many = [("images", (f"{i}.png", png)) for i in range(17)]  # max_images=16
        _error(c.post("/v1/predict", files=too_many), 413, "too many images")
        huge = b"\0" * 500_000  # over max_payload_bytes=400000
        for path, template in [("/v1/predict", "/v1/predict"),
                               ("/v2/models/tiny/infer", "/v2/models/{name}/infer"),
                               # stats serves GET: a POST there is routed to the template
                               ("/v1/reviews/stats", "/v1/reviews/{review_id}"),
                               ("/v1/nowhere", "unmatched")]:  # fmt: skip
            counted = {"endpoint": template, "method": "POST", "status": "413"}
            before = server.metric("vge_request_duration_seconds_count", **counted)
            # (with the key: a keyed route answers a request without one 401 before its size)
            r = c.post(path, content=huge, headers={"content-type": "application/json",
                                                    "authorization": f"Bearer {API_KEY}"})  # fmt: skip
            _error(r, 413, "exceeds")  # by its Content-Length, before any route saw it ...
            # ... and still counted under its route's template (dashboards by endpoint)
            assert server.metric("vge_request_duration_seconds_count", **counted) == before + 1
        b64 = base64.b64encode(png).decode()
        ok = c.post(
            "/v1/predict", params={"abstain_k": 1}, json={"images": [b64], "abstain_k": None}
        )
        assert ok.status_code == 200 and ok.json()["results"][0]["abstain_k"] == 1.0  # null: unset
        _error(c.post("/v1/predict", json={"images": [b64], "abstain_k": 2e9}), 422, "abstain_k")
        _error(c.post("/v1/predict", params={"abstain_k": -0.5}, files=[("images", ("a.png", png))]),
               422, "abstain_k")  # fmt: skip
        _error(
            c.post("/v1/predict", params={"vgmu_on": "z"}, json={"images": [b64]}), 422, "vgmu_on"
        )
        _error(c.post("/v1/predict", params={"top_k": 0}, json={"images": [b64]}), 422, "top_k")
        # a repeated parameter is ambiguous (the last one used to win silently)
        _error(c.post("/v1/predict?top_k=1&top_k=3", json={"images": [b64]}), 422,
               "top_k is given 2 times in the query")  # fmt: skip
        _error(c.post("/v1/predict", params={"abstain_k": "nan"}, json={"images": [b64]}), 422,
               "abstain_k: Input should be a finite number")  # fmt: skip
        long_name = "x" * 10_000  # an unknown parameter's name is not echoed whole
        r = c.post("/v1/predict", params={long_name: "1"}, json={"images": [b64]})
        _error(r, 422, "Extra inputs are not permitted")
        assert len(r.json()["error"]) < 200, len(r.json()["error"])
        # an images part without filename or type (curl -F 'images=<file.png') is an image
        r = c.post("/v1/predict", files=[("images", (None, pngs[0]))])
        assert r.status_code == 200, r.text
        _error(c.post("/v1/score", json={"probs": [[[0.5, 0.7], [0.5, 0.5]]]}), 422, "sum")
        _error(c.post("/v1/score", json={"probs": [[[0.5, 0.5]]]}), 422, "at least 2 items")
        _error(c.post("/v1/score", json={"probs": [[[0.5, 0.5], [0.5, 0.5]]], "vgmu_on": "q"}),
               422, "gate_k")  # fmt: skip
        _error(c.post("/v1/score", json={"probs": [[[0.6, 0.4], [0.7, 0.3]]], "gate_k": 0}),
               422, "gate_k: Input should be greater than or equal to 0.001")  # fmt: skip
        _error(c.post("/v1/score", json={"probs": [[[0.6, 0.4], [0.7, 0.3]]], "gate_k": 1e5}),
               422, "gate_k: Input should be less than or equal to 10000")  # fmt: skip
        deep = b"[" * 100_000 + b"]" * 100_000  # used to be a 500 (RecursionError)
        for path in ("/v1/predict", "/v1/score", "/v2/models/tiny/infer"):
            r = c.post(path, content=deep, headers={"content-type": "application/json"})
            assert r.status_code in (400, 413, 422), (path, r.status_code, r.text)
        _error(c.post("/v1/score", json={"probs": [[[0.5, 0.5]], [[1.0]]]}), 422, "probs")
        # JSON strings and booleans are not probabilities (were read as 0.5 and 1.0)
        _error(c.post("/v1/score", json={"probs": [[["0.5", 0.5], [0.5, 0.5]]]}), 422,
               "probs.0.0.0: Input should be a valid number")  # fmt: skip
        _error(c.post("/v1/score", json={"probs": [[[True, 0.0], [0.5, 0.5]]]}), 422,
               "Input should be a valid number")  # fmt: skip
        _error(c.post("/v1/score", json=[1, 2]), 422, "request: Input should be")
        _error(c.post("/v1/score", content=b"{"), 400, "request body is not valid JSON")
        # over its own cap (parsing JSON holds the front end): refused before parsing
        big = b'{"probs": [' + b",".join([b"[[0.5, 0.5], [0.5, 0.5]]"] * 10_000) + b"]}"
        _error(c.post("/v1/score", content=big), 413, "VGE_MAX_SCORE_BYTES")
        _error(
            c.post("/v1/score", json={"probs": [[[0.5, 0.5]]], "abstain_k": -1}), 422, "abstain_k"
        )
        _error(c.get("/v1/models/nope"), 404, "nope")
        _error(c.get("/v2/models/nope"), 404, "nope")
        _error(c.get("/no/such/route"), 404)
    assert server.metric("vge_rejections_total", reason="payload_too_large") >= 3
    assert server.metric("vge_rejections_total", reason="bad_input") >= 5


def test_decompression_bomb_refused_before_decoding(server: Server) -> None:
    import struct
    import zlib

    w = h = 4000  # 16 Mpx > max_image_pixels (512*512); tiny on the wire
    raw = zlib.compress(b"".join(b"\0" + b"\0" * w for _ in range(h)), 9)

    def chunk(t: bytes, d: bytes) -> bytes:
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
           + chunk(b"IDAT", raw) + chunk(b"IEND", b""))  # fmt: skip
    assert len(png) < 20_000
    with server.client() as c:
        _error(c.post("/v1/predict", files=[("images", ("bomb.png", png))]), 413, "pixels")


@pytest.mark.parametrize("path", ["/v1/models/reload", "/v1/training-jobs"])
def test_auth(server: Server, path: str) -> None:
    with server.client() as c:
        r = c.post(path, json={})
        _error(r, 401, "missing API key")
        assert r.headers["www-authenticate"] == "Bearer"
        _error(
            c.post(path, json={}, headers={"Authorization": "Bearer wrong-key-123"}), 403, "wrong"
        )
        _error(c.post(path, json={}, headers={"X-API-Key": API_KEY + "x"}), 403, "wrong")
        _error(c.get("/v1/training-jobs", headers={"Authorization": "Basic " + API_KEY}), 401)
        ok = c.get("/v1/training-jobs", headers={"X-API-Key": API_KEY})
        assert ok.status_code == 200 and "jobs" in ok.json()
        ok = c.get("/v1/training-jobs", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200
        both = {"Authorization": f"Bearer {API_KEY}", "X-API-Key": API_KEY}
        assert c.get("/v1/training-jobs", headers=both).status_code == 200  # the same key twice
        for wrong in ({**both, "X-API-Key": "other"}, {**both, "Authorization": "Bearer other"}):
            # two different keys: refused whichever is right (one used to win silently)
            _error(c.get("/v1/training-jobs", headers=wrong), 401, "two different keys")
    assert API_KEY not in server.log()
    assert server.metric("vge_rejections_total", reason="unauthorized") >= 3


def test_admin_errors(server: Server) -> None:
    h = {"X-API-Key": API_KEY}
    with server.client(headers=h) as c:
        _error(c.post("/v1/models/promote", json={"model": "../etc"}), 422, "should match pattern")
        _error(c.post("/v1/models/promote", json={"model": "missing"}), 404, "missing")
        _error(c.post("/v1/models/promote", json={}), 422, "exactly one")
        # reload reloads the served directory: a body asking for another was answered 200
        _error(c.post("/v1/models/reload", json={"model_dir": "/etc"}), 422, "takes no body")
        _error(c.get("/v1/training-jobs/job-nope"), 404, "job-nope")
        _error(c.post("/v1/training-jobs", json={"epochs": 0}), 422, "epochs")
        _error(c.post("/v1/training-jobs", json={"backbone": "nope"}), 422, "backbone")
        # what only building the model tells: refused at submission, not failed in the job
        _error(c.post("/v1/training-jobs", json={"backbone_kwargs": {"foo": 1}}), 422,
               "backbone_kwargs do not fit lenet5: lenet5() got an unexpected keyword argument "
               "'foo'")  # fmt: skip
        _error(c.post("/v1/training-jobs", json={"vgn": True, "k": [1.0, 2.0]}), 422,
               "one value per class (10)")  # fmt: skip
        _error(c.post("/v1/training-jobs", json={"dataset": "imagefolder:../../etc"}), 422,
               "outside the data root")  # fmt: skip
        # a name the file system refuses (it raised OSError: a 500), a seed no generator takes
        # (it was accepted, and the job failed at its first generator)
        _error(c.post("/v1/training-jobs", json={"dataset": "imagefolder:" + "a" * 5000}), 422,
               "cannot be read")  # fmt: skip
        _error(c.post("/v1/training-jobs", json={"seed": 2**64}), 422, "seed")
        _error(c.post("/v1/training-jobs", json={"seed": -1}), 422, "seed")
        _error(c.post("/v1/training-jobs", json={"data_root": "/"}), 422, "data_root")
        # a model /v2/models/{name} could not address
        _error(c.post("/v1/training-jobs", json={"name": "/tmp/evil"}), 422, "name")
        if not torch.cuda.is_available():  # a device the server does not have: refused at once
            _error(
                c.post("/v1/training-jobs", json={"device": "cuda:7"}), 422, "not on this machine"
            )


def test_chunked_body_over_limit_is_413(server: Server) -> None:
    def chunks():  # no Content-Length: the limit is enforced while streaming
        for _ in range(50):
            yield b"\0" * 10_000

    with server.client() as c:
        for path in ("/v1/predict", "/v1/score"):  # a direct route, and one FastAPI parses
            before = server.metric("vge_rejections_total", reason="payload_too_large")
            r = c.post(path, content=chunks(), headers={"content-type": "application/json"})
            _error(r, 413, "limit")
            assert r.json()["code"] == "payload_too_large"
            # counted once, by the middleware that answered (not again by the route's handler)
            assert server.metric("vge_rejections_total", reason="payload_too_large") == before + 1
        assert c.get("/healthz").status_code == 200


def test_method_not_allowed_names_every_method_of_the_path(server: Server) -> None:
    """RFC 9110: a 405 lists the methods the path serves, all routes at that path together
    (FastAPI 0.16x includes routers lazily; the list once came back empty)."""
    with server.client() as c:
        for method, path, allow in [
            ("GET", "/v1/predict", "POST"),  # a scoring route (served past FastAPI's router)
            ("PUT", "/v2/models/tiny/infer", "POST"),
            ("DELETE", "/v1/reviews/abc", "GET, POST"),  # two routes, one path
            ("POST", "/v1/models", "GET"),
            ("HEAD", "/v1/models", "GET"),  # FastAPI's routes serve no HEAD: not advertised
            ("POST", "/healthz", "GET, HEAD"),  # the probes' paths serve HEAD as well
            ("OPTIONS", "/v1/models/promote", "POST"),  # not /v1/models/{name}: concrete wins
            ("POST", "/metrics", "GET"),  # undocumented: the router's own list
        ]:
            r = c.request(method, path)
            assert r.status_code == 405, (method, path, r.status_code)
            if method != "HEAD":  # no body in an answer to HEAD
                assert r.json()["code"] == "method_not_allowed"
            assert r.headers["allow"] == allow, (method, path, r.headers["allow"])


def test_a_client_gone_mid_body_is_no_server_error(server: Server) -> None:
    """A client that closes its connection before its body is complete gets no answer (nobody
    reads it); the request is recorded as 499, not as a logged 500."""
    import socket
    import time

    host, port = server.url.removeprefix("http://").split(":")
    paths = ("/v1/predict", "/v2/models/tiny/infer")
    for path in paths:
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      "Content-Length: 1000\r\n\r\n{\"images\": [".encode())  # fmt: skip
            time.sleep(0.2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        counts = [
            server.metric("vge_request_duration_seconds_count", endpoint=p, status="499")
            for p in ("/v1/predict", "/v2/models/{name}/infer")
        ]
        if all(counts):
            break
        time.sleep(0.1)
    assert all(counts), counts
    assert "ClientDisconnect" not in server.log()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", "malformed HTTP request"),
        (b"GET /healthz HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n", "malformed HTTP request"),
    ],
)
def test_bytes_that_are_not_http_get_a_json_400(server: Server, raw: bytes, reason: str) -> None:
    """uvicorn answers what it cannot parse itself, before any route; it is still the service's
    JSON error, naming the parser's reason, and the connection closes."""
    import json
    import socket

    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):  # until the server closes
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().lower().split("\r\n")
    assert lines[0].startswith("http/1.1 400 "), answer
    assert "content-type: application/json" in lines and "connection: close" in lines
    error = json.loads(body)
    assert error["code"] == "bad_request" and error["error"].startswith(reason), error
    assert len(error["error"]) > len(reason) + 2  # the parser's reason follows


def test_an_over_cap_body_still_uploading_gets_its_413(server: Server) -> None:
    """The 413 goes out before the body is in (by Content-Length, or once a chunked body passes
    the cap). httpx's AsyncClient is still writing then; closing with its body unread reset the
    connection and the client saw ReadError instead of the 413 (service.frontend.http_protocol)."""
    import asyncio

    import httpx

    size = 8 << 20  # 20x the session server's 400 KB cap: far more than the socket buffers hold

    async def chunks():  # noqa: ANN202
        for _ in range(size // 65536):
            yield b"\0" * 65536

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            headers = {"content-type": "application/json"}
            return [
                await c.post("/v1/predict", content=b"\0" * size, headers=headers),
                await c.post("/v1/predict", content=chunks(), headers=headers),
            ]

    by_length, chunked = asyncio.run(main())
    _error(by_length, 413, f"{size} bytes exceeds the limit of 400000")
    _error(chunked, 413, "exceeds the limit of 400000")


def test_after_an_early_413_the_connection_lingers_then_closes(server: Server) -> None:
    """Answer, then FIN, while the rest of the body is still read and dropped: the client reads
    the whole 413 and end of stream, and can keep writing without a reset."""
    import json
    import socket

    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100000000\r\n\r\n" + b"\0" * 65536)  # fmt: skip
        answer = b""
        while chunk := sock.recv(65536):  # the answer, then the server's FIN
            answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower()
        assert json.loads(body)["code"] == "payload_too_large"
        for _ in range(64):  # 4 MiB more of the body: still read (and dropped), never reset
            sock.sendall(b"\0" * 65536)
