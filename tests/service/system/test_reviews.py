"""The human review queue over HTTP, against an in-process server and real ``vge serve`` trees.

Auth, queueing policies, duplicates, a full queue, bad labels, stats, export, metrics, restart
persistence with retention, and two replicas sharing one real PostgreSQL queue.
"""

from __future__ import annotations

import hashlib
import io
import json
import signal
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import API_KEY, Server, free_port, start_in_process, start_server
from tests.service.inprocess import InProcessServer

REVIEWER_KEY = "reviewer-key-0123"
R = {"Authorization": f"Bearer {REVIEWER_KEY}"}
A = {"Authorization": f"Bearer {API_KEY}"}
ALICE = {"Authorization": "Bearer alice-key-0123"}  # VGE_REVIEWER_KEYS: personal keys
GRPC_PORT = free_port()


def files(pngs: list[bytes]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("images", (f"{i}.png", p, "image/png")) for i, p in enumerate(pngs)]


def predict(
    srv: Server | InProcessServer,
    pngs: list[bytes],
    headers: dict[str, str] | None = None,
    **params: object,
) -> list[dict]:
    """Predictions; ``review=always`` needs a key (the reviewer key unless ``headers`` say)."""
    if headers is None:
        headers = R if params.get("review") == "always" else {}
    r = httpx.post(srv.url + "/v1/predict", params=params, files=files(pngs), timeout=30,
                   headers=headers)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["results"]


@pytest.fixture(scope="module")
def review_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[InProcessServer]:
    """In process (the queue's rules, not processes; a queue shared by several front ends and
    replicas: test_two_replicas_share_one_postgres_queue, on trees)."""
    work = tmp_path_factory.mktemp("reviews")
    srv = start_in_process(
        work, tiny_model, review_queue="on", reviewer_key=REVIEWER_KEY, api_key=API_KEY,
        review_max_items=6, reviewer_keys="alice:alice-key-0123,bob:bob-key-45678",
        grpc_port=GRPC_PORT, review_max_claims=2,
    )  # fmt: skip
    yield srv
    srv.stop()


def test_review_api_needs_a_key(review_server: InProcessServer, pngs: list[bytes]) -> None:
    url = review_server.url + "/v1/reviews"
    assert httpx.get(url).status_code == 401
    wrong = httpx.get(url, headers={"Authorization": "Bearer not-the-key"})
    assert wrong.status_code == 403 and "wrong reviewer key" in wrong.json()["error"]
    assert httpx.get(url, headers=R).status_code == 200
    assert httpx.get(url, headers=A).status_code == 200  # the admin key works too
    page = httpx.get(review_server.url + "/review")
    assert page.status_code == 200 and "Reviewer key" in page.text


def test_queue_label_stats_export(review_server: InProcessServer, pngs: list[bytes]) -> None:
    srv = review_server
    # never: nothing queued, no review fields in the answer
    (never,) = predict(srv, pngs[:1], review="never", abstain_k=100)
    assert never["abstain"] and "review_id" not in never
    # auto (the default): only abstaining answers are queued
    accepted = predict(srv, pngs[:2], abstain_k=0)
    assert all(not r["abstain"] and "review_id" not in r for r in accepted)
    queued = predict(srv, pngs[:3], headers=R, abstain_k=100)  # a keyed client sees its ids
    assert [r["review_status"] for r in queued] == ["queued"] * 3
    # the same image again: the same pending item
    again = predict(srv, pngs[:1], review="always", abstain_k=0)
    assert again[0]["review_status"] == "already_queued"
    assert again[0]["review_id"] == queued[0]["review_id"]
    # full at 6 pending items: refused, the prediction still answered
    more = predict(srv, pngs[3:8], review="always")
    assert [r["review_status"] for r in more] == ["queued"] * 3 + ["queue_full"] * 2
    assert more[-1]["review_id"] is None and "label" in more[-1]

    c = httpx.Client(base_url=srv.url, headers=R, timeout=30)
    listing = c.get("/v1/reviews", params={"limit": 4}).json()
    assert len(listing["reviews"]) == 4 and listing["next_cursor"]
    rest = c.get("/v1/reviews", params={"cursor": listing["next_cursor"]}).json()
    ids = [x["id"] for x in listing["reviews"] + rest["reviews"]]
    assert len(ids) == 6 and ids[0] == queued[0]["review_id"] and rest["next_cursor"] is None
    by_vgmu = c.get("/v1/reviews", params={"order": "vgmu"}).json()["reviews"]
    vgmus = [x["answer"]["vgmu"] for x in by_vgmu]
    assert vgmus == sorted(vgmus, reverse=True)  # VGMU: higher = less sure; most uncertain first

    first = c.get(f"/v1/reviews/{ids[0]}").json()
    answer = first["answer"]
    assert first["state"] == "pending" and answer["model"] == "tiny"
    for key in ("model_version", "prediction", "label", "probabilities", "vgmu", "snr", "tu",
                "au", "eu", "abstain_k"):  # fmt: skip
        assert key in answer, key
    image = c.get(f"/v1/reviews/{ids[0]}/image")
    assert image.content == pngs[0] and image.headers["content-type"] == "image/png"

    bad = c.post(f"/v1/reviews/{ids[0]}", json={"label": "cat", "reviewer": "ann"})
    assert bad.status_code == 422 and "'cat' is not a class" in bad.json()["error"]
    assert c.post("/v1/reviews/nope", json={"label": "3", "reviewer": "ann"}).status_code == 404
    predicted = answer["label"]
    other = "1" if predicted != "1" else "2"
    ok = c.post(f"/v1/reviews/{ids[0]}", json={"label": predicted, "reviewer": "ann"})
    assert ok.status_code == 200 and ok.json()["state"] == "reviewed"
    # A mistaken label is corrected: an integer names the class, the earlier label is kept.
    fixed = c.post(f"/v1/reviews/{ids[0]}", json={"label": int(other), "reviewer": "ben"})
    assert fixed.status_code == 200, fixed.text
    assert (fixed.json()["label"], fixed.json()["relabelled"]) == (other, True)
    assert [(h["label"], h["reviewer"]) for h in fixed.json()["history"]] == [(predicted, "ann")]
    back = c.post(f"/v1/reviews/{ids[0]}", json={"label": predicted, "reviewer": "ann"})
    assert len(back.json()["history"]) == 2 and back.json()["label"] == predicted
    assert c.post(f"/v1/reviews/{ids[0]}", json={"label": 99}).status_code == 422
    c.post(f"/v1/reviews/{ids[1]}", json={"label": other, "reviewer": "ben"}).raise_for_status()
    c.post(f"/v1/reviews/{ids[2]}/skip", json={"reviewer": "ben"}).raise_for_status()

    stats = c.get("/v1/reviews/stats").json()
    assert stats["counts"] == {"pending": 3, "reviewed": 2, "skipped": 1}
    label_1 = c.get(f"/v1/reviews/{ids[1]}").json()["answer"]["label"]
    assert stats["agreement"] == pytest.approx((1 + (label_1 == other)) / 2)
    assert stats["median_time_to_review_s"] >= 0

    with tarfile.open(fileobj=io.BytesIO(c.get("/v1/reviews/export").content)) as tar:
        names = sorted(tar.getnames())
        assert len(names) == 2 and f"{predicted}/{first['sha256']}.png" in names
        member = tar.extractfile(f"{predicted}/{first['sha256']}.png")
        assert member is not None and member.read() == pngs[0]

    assert srv.metric("vge_reviews_total", outcome="skipped") == 1
    agree = srv.metric("vge_reviews_total", outcome="agree")
    assert agree + srv.metric("vge_reviews_total", outcome="disagree") == 2
    assert srv.metric("vge_review_latency_seconds_count") == 3
    assert srv.metric("vge_review_enqueue_total", status="queue_full") == 2
    deadline = time.monotonic() + 10
    while srv.metric("vge_review_queue_depth", model="tiny") != 3:
        assert time.monotonic() < deadline, "queue depth gauge never showed 3 pending"
        time.sleep(0.3)


def test_not_a_digit_through_the_api(review_server: InProcessServer, pngs: list[bytes]) -> None:
    """``"not_a_digit": true`` (no label) marks an image none of the model's classes: no class,
    counted apart from disagreements in the stats and the metrics, exported under
    ``outliers/``; asking for both, neither or a non-boolean is a 422 naming the problem."""
    srv = review_server
    c = httpx.Client(base_url=srv.url, headers=R, timeout=30)
    (queued,) = predict(srv, pngs[60:61], review="always")
    rid = queued["review_id"]
    before = c.get("/v1/reviews/stats").json()
    for body, words in (
        ({"label": "3", "not_a_digit": True}, "not both"),
        ({"reviewer": "ann"}, "give a label"),
        ({"label": None}, "give a label"),
        ({"not_a_digit": False}, "give a label"),
        ({"not_a_digit": "yes"}, "not_a_digit"),
    ):
        r = c.post(f"/v1/reviews/{rid}", json=body)
        assert r.status_code == 422 and words in r.json()["error"], (body, r.text)
    assert c.get(f"/v1/reviews/{rid}").json()["state"] == "pending"

    r = c.post(f"/v1/reviews/{rid}", json={"not_a_digit": True, "reviewer": "ann"})
    assert r.status_code == 200, r.text
    item = r.json()
    assert (item["state"], item["label"], item["not_a_digit"]) == ("reviewed", None, True)

    stats = c.get("/v1/reviews/stats").json()
    assert stats["counts"]["reviewed"] == before["counts"]["reviewed"] + 1
    assert stats["labelled"] == before["labelled"]  # not a disagreement, not an agreement
    assert stats["agreement"] == before["agreement"]
    assert stats["not_a_digit"]["count"] == before["not_a_digit"]["count"] + 1
    assert stats["not_a_digit"]["by_prediction"][queued["label"]] >= 1
    assert srv.metric("vge_reviews_total", outcome="not_a_digit") == 1

    with tarfile.open(fileobj=io.BytesIO(c.get("/v1/reviews/export").content)) as tar:
        member = tar.extractfile(f"outliers/{item['sha256']}.png")
        assert member is not None and member.read() == pngs[60]


def test_claim_and_skip_need_no_body_and_keys_name_reviewers(
    review_server: InProcessServer, pngs: list[bytes]
) -> None:
    srv = review_server
    queued = predict(srv, pngs[40:42], review="always")
    assert [r["review_status"] for r in queued] == ["queued"] * 2
    # A personal key names its reviewer: no body needed, and a name in the body cannot change it.
    claim = httpx.post(srv.url + "/v1/reviews/claim", headers=ALICE)
    assert claim.status_code == 200, claim.text
    item = claim.json()["review"]
    assert item["claimed_by"] == "alice" and claim.json()["reviewer"] == "alice"
    done = httpx.post(f"{srv.url}/v1/reviews/{item['id']}", headers=ALICE,
                      json={"label": item["classes"][0], "reviewer": "mallory"})  # fmt: skip
    assert (done.json()["reviewer"], done.json()["reviewer_via"]) == ("alice", "key")
    # The shared key: the name the client gives (or "reviewer"), recorded as claimed.
    held = httpx.post(srv.url + "/v1/reviews/claim", headers=R).json()["review"]
    assert held["claimed_by"] == "reviewer"
    skipped = httpx.post(f"{srv.url}/v1/reviews/{held['id']}/skip", headers=R)
    assert skipped.status_code == 200, skipped.text
    assert (skipped.json()["reviewer"], skipped.json()["reviewer_via"]) == (
        "reviewer", "shared_key",
    )  # fmt: skip


def test_the_shared_key_cannot_act_as_a_personal_key_nor_hold_the_queue(
    review_server: InProcessServer, pngs: list[bytes]
) -> None:
    """With the shared key a client names itself, but not as a reviewer who has a personal key
    (claim, label, skip: 403); and all its names together hold at most VGE_REVIEW_MAX_CLAIMS
    (2 here) items, so made-up names cannot hold every pending item."""
    srv = review_server
    c = httpx.Client(base_url=srv.url, headers=R, timeout=30)
    while (item := c.post("/v1/reviews/claim").json()["review"]) is not None:  # make room
        c.post(f"/v1/reviews/{item['id']}/skip").raise_for_status()
    queued = predict(srv, pngs[50:53], review="always")
    assert [r["review_status"] for r in queued] == ["queued"] * 3
    item_id = queued[0]["review_id"]
    for path, body in (("/v1/reviews/claim", {"reviewer": "alice"}),
                       (f"/v1/reviews/{item_id}", {"label": "3", "reviewer": "alice"}),
                       (f"/v1/reviews/{item_id}/skip", {"reviewer": "bob"})):  # fmt: skip
        r = c.post(path, json=body)
        assert r.status_code == 403 and "has a personal key" in r.json()["error"], (path, r.text)
    assert c.get(f"/v1/reviews/{item_id}").json()["state"] == "pending"

    first = c.post("/v1/reviews/claim", json={"reviewer": "made-up-1"})
    second = c.post("/v1/reviews/claim", json={"reviewer": "made-up-2"})
    assert first.status_code == 200 and second.status_code == 200, second.text
    third = c.post("/v1/reviews/claim", json={"reviewer": "made-up-3"})
    assert third.status_code == 409, third.text
    assert "VGE_REVIEW_MAX_CLAIMS=2" in third.json()["error"]
    again = c.post("/v1/reviews/claim", json={"reviewer": "made-up-1"})  # a reloaded page
    assert again.json()["review"]["id"] == first.json()["review"]["id"]
    alice = httpx.post(srv.url + "/v1/reviews/claim", headers=ALICE, timeout=30)
    assert alice.status_code == 200 and alice.json()["review"]["claimed_by"] == "alice"
    for who, held in (("made-up-1", first), ("made-up-2", second)):
        c.post(f"/v1/reviews/{held.json()['review']['id']}/skip",
               json={"reviewer": who}).raise_for_status()  # fmt: skip
    httpx.post(f"{srv.url}/v1/reviews/{alice.json()['review']['id']}/skip", headers=ALICE,
               timeout=30).raise_for_status()  # fmt: skip


def test_anonymous_clients_cannot_force_or_probe_the_queue(
    review_server: InProcessServer, pngs: list[bytes]
) -> None:
    srv = review_server
    url = srv.url + "/v1/predict"
    anonymous = httpx.post(url, params={"review": "always"}, files=files(pngs[50:51]))
    assert anonymous.status_code == 401 and "review=always" in anonymous.json()["error"]
    wrong = httpx.post(url, params={"review": "always"}, files=files(pngs[50:51]),
                       headers={"Authorization": "Bearer not-a-key-at-all"})  # fmt: skip
    assert wrong.status_code == 403
    # An image pending for a keyed client: an anonymous abstention gets no id and no hint.
    (keyed,) = predict(srv, pngs[51:52], review="always")
    assert keyed["review_status"] in ("queued", "queue_full")
    (anon,) = predict(srv, pngs[51:52], headers={}, abstain_k=100)  # auto: it abstains
    assert anon["review_id"] is None and anon["review_status"] in ("queued", "queue_full")
    (again,) = predict(srv, pngs[51:52], headers=A, abstain_k=100)
    if keyed["review_status"] == "queued":
        assert (again["review_status"], again["review_id"]) == (
            "already_queued",
            keyed["review_id"],
        )


def test_v2_http_and_grpc_answers_are_queued(
    review_server: InProcessServer, pngs: list[bytes]
) -> None:
    import numpy as np
    import torch
    import tritonclient.grpc as grpcclient
    from torchvision.io import decode_png

    srv = review_server
    c = httpx.Client(base_url=srv.url, headers=R, timeout=30)
    while (item := c.post("/v1/reviews/claim").json()["review"]) is not None:  # make room
        c.post(f"/v1/reviews/{item['id']}/skip").raise_for_status()
    pixels = np.stack([decode_png(torch.frombuffer(bytearray(p), dtype=torch.uint8)).numpy()
                       for p in pngs[60:64]])  # fmt: skip
    url = "/v2/models/tiny/infer"

    def tensor(arr: np.ndarray, **params: object) -> dict[str, object]:
        return {"inputs": [{"name": "images", "datatype": "UINT8", "shape": list(arr.shape),
                            "data": arr.reshape(-1).tolist()}], "parameters": params}  # fmt: skip

    # JSON, review=always (keyed): queued, stored as PNGs of the pixels sent
    r = c.post(url, json=tensor(pixels[:2], review="always"))
    assert r.status_code == 200, r.text
    said = r.json()["parameters"]
    ids = said["review_id"].split(",")
    assert said["review_status"] == "queued,queued" and all(ids)
    image = c.get(f"/v1/reviews/{ids[1]}/image")
    assert image.headers["content-type"] == "image/png"
    stored = decode_png(torch.frombuffer(bytearray(image.content), dtype=torch.uint8)).numpy()
    assert np.array_equal(stored, pixels[1])
    # an unknown parameter (here a typo) is a 400 naming it; always needs a key
    typo = httpx.post(srv.url + url, json=tensor(pixels[:1], reveiw="always"))
    assert typo.status_code == 400 and "'reveiw'" in typo.json()["error"]
    anon = httpx.post(srv.url + url, json=tensor(pixels[:1], review="always"))
    assert anon.status_code == 401
    # the binary tensor extension, review=auto: what abstains is queued
    head = json.dumps({"inputs": [{"name": "images", "datatype": "UINT8", "shape": [1, 1, 28, 28],
                                   "parameters": {"binary_data_size": 784}}],
                       "parameters": {"abstain_k": 100}}).encode()  # fmt: skip
    r = c.post(url, content=head + pixels[2].tobytes(),
               headers={"Inference-Header-Content-Length": str(len(head))})  # fmt: skip
    assert r.status_code == 200 and r.json()["parameters"]["review_status"] == "queued", r.text
    # FP32 prepared input is not an image a person can label: not queued, and said so
    fp32 = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1, 28, 28],
                        "data": [0.0] * 784}], "parameters": {"review": "always"}}  # fmt: skip
    assert c.post(url, json=fp32).json()["parameters"]["review_status"] == "unsupported_input"
    # gRPC: the same parameter, the same queue
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}")
    G = {"authorization": R["Authorization"]}  # gRPC metadata keys are lower case
    inp = grpcclient.InferInput("images", [1, 1, 28, 28], "UINT8")
    inp.set_data_from_numpy(pixels[3:4])
    with pytest.raises(grpcclient.InferenceServerException, match="unknown request parameter"):
        client.infer("tiny", [inp], parameters={"priority_": 1}, headers=G)
    result = client.infer("tiny", [inp], parameters={"review": "always"}, headers=G)
    params = result.get_response().parameters
    assert params["review_status"].string_param == "queued"
    grpc_id = params["review_id"].string_param
    assert c.get(f"/v1/reviews/{grpc_id}").json()["answer"]["model"] == "tiny"
    pending = {x["id"] for x in c.get("/v1/reviews").json()["reviews"]}
    assert pending >= {*ids, grpc_id} and len(pending) == 4
    client.close()  # not left to the GC: tritonclient's __del__ raises in a later test's pass


def test_v2_channels_last_pixels_are_queued_as_sent(
    review_server: InProcessServer, pngs: list[bytes]
) -> None:
    """V2 UINT8 pixels in [B, H, W, C] (NHWC, as numpy stacks images) are answered and queued:
    the stored PNG is the image sent, channels first, an alpha channel kept (it was read as C = H
    and the answer lost to a 500; gRPC shares the path, pipeline.infer). Sent over HTTP here."""
    import numpy as np
    import torch
    from torchvision.io import ImageReadMode, decode_png

    srv = review_server
    c = httpx.Client(base_url=srv.url, headers=R, timeout=30)
    while (item := c.post("/v1/reviews/claim").json()["review"]) is not None:  # make room
        c.post(f"/v1/reviews/{item['id']}/skip").raise_for_status()
    gray = decode_png(torch.frombuffer(bytearray(pngs[5]), dtype=torch.uint8)).numpy()
    rgb = np.concatenate([gray, gray // 2, 255 - gray])  # (3, 28, 28): three different planes
    rgba = np.concatenate([rgb, np.where(gray > 0, 255, 0).astype(np.uint8)])  # ink opaque
    for chw in (rgb, gray, rgba):
        nhwc = chw.transpose(1, 2, 0)[None]  # (1, 28, 28, C)
        body = {"inputs": [{"name": "images", "datatype": "UINT8", "shape": list(nhwc.shape),
                            "data": nhwc.reshape(-1).tolist()}],
                "parameters": {"review": "always"}}  # fmt: skip
        r = c.post("/v2/models/tiny/infer", json=body)
        assert r.status_code == 200, r.text
        said = r.json()["parameters"]
        assert said["review_status"] == "queued", said
        image = c.get(f"/v1/reviews/{said['review_id']}/image")
        stored = decode_png(torch.frombuffer(bytearray(image.content), dtype=torch.uint8),
                            ImageReadMode.UNCHANGED)  # fmt: skip
        assert np.array_equal(stored.numpy(), chw)
        item = c.post("/v1/reviews/claim").json()["review"]
        c.post(f"/v1/reviews/{item['id']}/skip").raise_for_status()


def test_review_off_refuses_review_requests(server: Server, pngs: list[bytes]) -> None:
    r = httpx.post(server.url + "/v1/predict?review=always", files=files(pngs[:1]))
    assert r.status_code == 422 and "VGE_REVIEW_QUEUE=on" in r.json()["error"]
    (plain,) = predict(server, pngs[:1])
    assert "review_id" not in plain
    off = httpx.get(server.url + "/v1/reviews", headers={"Authorization": f"Bearer {API_KEY}"})
    assert off.status_code == 404 and "review queue is off" in off.json()["error"]


def test_queue_survives_restart_and_retention_runs(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, pngs: list[bytes]
) -> None:
    work = tmp_path_factory.mktemp("review-restart")
    srv = start_server(work, tiny_model, review_queue="on", workers=1)
    try:
        # No key configured at all: the review API is disabled, the queue still fills.
        denied = httpx.get(srv.url + "/v1/reviews", headers=R)
        assert denied.status_code == 403 and "disabled" in denied.json()["error"]
        keyless = httpx.get(srv.url + "/v1/reviews")  # no key could do: 403, not a 401 asking
        assert keyless.status_code == 403 and "disabled" in keyless.json()["error"]
        admin = httpx.post(srv.url + "/v1/models/reload")  # no VGE_API_KEY either
        assert admin.status_code == 403 and "disabled" in admin.json()["error"], admin.text
        # No key: review=always is refused, auto queues what abstains (ids not shown).
        refused = httpx.post(srv.url + "/v1/predict?review=always", files=files(pngs[10:11]))
        assert refused.status_code == 403 and "review=always" in refused.json()["error"]
        queued = predict(srv, pngs[10:13], abstain_k=100)
        assert [(r["review_status"], r["review_id"]) for r in queued] == [("queued", None)] * 3
        srv.stop()
        srv = start_server(work, tiny_model, review_queue="on", reviewer_key=REVIEWER_KEY)
        c = httpx.Client(base_url=srv.url, headers=R, timeout=30)
        pending = c.get("/v1/reviews").json()["reviews"]
        assert [x["sha256"] for x in pending] == [
            hashlib.sha256(p).hexdigest() for p in pngs[10:13]
        ]
        ids = [x["id"] for x in pending]
        c.post(f"/v1/reviews/{ids[0]}", json={"label": "3", "reviewer": "ann"}).raise_for_status()
        srv.stop(signal.SIGKILL)  # even killed: the label was committed
        time.sleep(1.0)
        # Retention of ~0.4 s: the reviewed item (and its image) goes at start-up, pending stay.
        srv = start_server(
            work, tiny_model, review_queue="on", reviewer_key=REVIEWER_KEY,
            review_retention_days=0.4 / 86400,
        )  # fmt: skip
        c = httpx.Client(base_url=srv.url, headers=R, timeout=30)
        deadline = time.monotonic() + 15
        while c.get(f"/v1/reviews/{ids[0]}").status_code != 404:
            assert time.monotonic() < deadline, "retention never deleted the reviewed item"
            time.sleep(0.3)
        assert [x["id"] for x in c.get("/v1/reviews").json()["reviews"]] == ids[1:]
        assert c.get(f"/v1/reviews/{ids[1]}/image").content == pngs[11]
        blobs = [p.name for p in (work / "reviews" / "blobs").rglob("*") if p.is_file()]
        assert len(blobs) == 2
    finally:
        srv.stop()


def test_two_replicas_share_one_postgres_queue(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, pngs: list[bytes], pg_database
) -> None:
    url = pg_database()
    work = tmp_path_factory.mktemp("replicas")
    common = {"review_queue": "on", "reviewer_key": REVIEWER_KEY, "db_url": url, "workers": 1}
    a = start_server(work / "a", tiny_model, replica_name="a", review_dir=work / "shared", **common)
    b = start_server(work / "b", tiny_model, replica_name="b", review_dir=work / "shared", **common)
    try:
        predict(a, pngs[:12], review="always")
        predict(b, pngs[12:24], review="always")
        dup = predict(b, pngs[:1], review="always")  # queued on a: the same pending item
        assert dup[0]["review_status"] == "already_queued"
        stats = httpx.get(a.url + "/v1/reviews/stats", headers=R).json()
        assert stats["counts"]["pending"] == 24

        # One claim on each replica: two different items, each held by its reviewer.
        held = [
            httpx.post(srv.url + "/v1/reviews/claim", json={"reviewer": who}, headers=R).json()
            for srv, who in ((a, "ann"), (b, "bob"))
        ]
        assert held[0]["review"]["id"] != held[1]["review"]["id"]
        assert held[1]["review"]["claimed_by"] == "bob" and held[1]["pending"] == 24
        taken = httpx.post(
            f"{b.url}/v1/reviews/{held[0]['review']['id']}", headers=R,
            json={"label": "3", "reviewer": "bob"},
        )  # fmt: skip
        assert taken.status_code == 409 and "claimed by 'ann'" in taken.json()["error"]
        for srv, who, h in ((a, "ann", held[0]), (b, "bob", held[1])):
            httpx.post(f"{srv.url}/v1/reviews/{h['review']['id']}/skip", headers=R,
                       json={"reviewer": who}).raise_for_status()  # fmt: skip

        handed: list[tuple[str, str]] = []
        lock = threading.Lock()

        errors: list[str] = []

        def reviewer(name: str, srv: Server) -> None:
            with httpx.Client(base_url=srv.url, headers=R, timeout=30) as c:
                while True:
                    r = c.post("/v1/reviews/claim", json={"reviewer": name})
                    if r.status_code != 200:
                        errors.append(f"{name}: claim {r.status_code} {r.text}")
                        return
                    item = r.json()["review"]
                    if item is None:
                        return
                    with lock:
                        handed.append((item["id"], name))
                    r = c.post(f"/v1/reviews/{item['id']}", json={"label": "3", "reviewer": name})
                    if r.status_code != 200:
                        errors.append(f"{name}: label {r.status_code} {r.text}")

        threads = [
            threading.Thread(target=reviewer, args=(f"r{i}", (a, b)[i % 2])) for i in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        ids = [i for i, _ in handed]
        assert len(ids) == 22 and len(set(ids)) == 22, "an item was handed to two reviewers"
        stats = httpx.get(b.url + "/v1/reviews/stats", headers=R).json()
        assert stats["counts"] == {"pending": 0, "reviewed": 22, "skipped": 2}
    finally:
        a.stop()
        b.stop()


def test_review_requests_refused_or_counted_as_they_should_be(
    tmp_path: Path, tiny_model: Path, pngs: list[bytes]
) -> None:
    """Found by review (2026-11-29): a NUL in any string (PostgreSQL's text cannot hold it: the
    store answered 503 and went down for everyone) is a 422 naming the field on every backend; a
    claim for the model "" counted the pending items of a model named "" while handing out any
    model's (empty is every model, as in the list, stats and export); an item skipped and then
    labelled observed its wait twice; the export of an unavailable store answered 200 with an
    empty tar."""
    srv = start_in_process(tmp_path / "srv", tiny_model, review_queue="on",
                           reviewer_key=REVIEWER_KEY, api_key=API_KEY)  # fmt: skip
    try:
        queued = predict(srv, pngs[:2], review="always")
        assert [r["review_status"] for r in queued] == ["queued"] * 2
        for method, path, kwargs in (
            ("GET", "/v1/reviews/a%00b", {}),
            ("GET", "/v1/reviews/a%00b/image", {}),
            ("GET", "/v1/reviews/stats?model=a%00", {}),
            ("GET", "/v1/reviews?model=a%00", {}),
            ("POST", "/v1/reviews/claim", {"json": {"reviewer": "a\x00b"}}),
            ("POST", "/v1/reviews/claim", {"json": {"model": "m\x00"}}),
            ("POST", f"/v1/reviews/{queued[0]['review_id']}", {"json": {"label": "3\x00"}}),
            ("POST", f"/v1/reviews/{queued[0]['review_id']}/skip",
             {"json": {"reviewer": "x\x00"}}),
        ):  # fmt: skip
            r = httpx.request(method, srv.url + path, headers=R, timeout=10, **kwargs)
            assert r.status_code == 422 and "NUL" in r.text, (path, r.status_code, r.text)
        claim = httpx.post(srv.url + "/v1/reviews/claim", headers=R, json={"model": ""})
        assert claim.status_code == 200, claim.text
        item = claim.json()["review"]
        assert item is not None and claim.json()["pending"] == 2  # every model's, as handed out

        waits = srv.metric("vge_review_latency_seconds_count")
        skipped = httpx.post(f"{srv.url}/v1/reviews/{item['id']}/skip", headers=R)
        assert skipped.status_code == 200, skipped.text
        label = item["answer"]["label"]
        done = httpx.post(f"{srv.url}/v1/reviews/{item['id']}", headers=R, json={"label": label})
        assert done.status_code == 200 and done.json()["state"] == "reviewed", done.text
        assert srv.metric("vge_reviews_total", outcome="skipped") == 1
        assert srv.metric("vge_reviews_total", outcome="agree") == 1  # both decisions counted
        assert srv.metric("vge_review_latency_seconds_count") == waits + 1  # its wait once

        (tmp_path / "srv" / "reviews" / "reviews.sqlite3").unlink()
        export = httpx.get(srv.url + "/v1/reviews/export", headers=R, timeout=10)
        assert export.status_code == 503, (export.status_code, export.headers, export.content[:80])
        assert export.json()["code"] == "review_store_unavailable", export.text
        assert "Retry-After" in export.headers
    finally:
        srv.stop()
