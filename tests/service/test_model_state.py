"""The served model is durable state, and promote is gated (issue 24, items 1 and 3).

Real ``vge serve`` processes on loopback, sharing a work directory (and so the jobs database that
holds the model history) across restarts:

* promote → ``kill -9`` of the engine → the supervisor's new engine serves the promoted model;
  promote → full restart → promoted; rollback → restart → rolled back;
* ``--model-dir`` given on the command line wins at that start, but not at the engine's restarts;
* the promote gate refuses a worse candidate with 409 and the comparison, ``force`` serves it;
* a recorded model that is deleted or whose weights were replaced is not restored: the start model
  serves, and the log (ERROR), ``vge_model_restore_failed`` and ``/v1/models`` say so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from models.zoo import zoo_model_dir
from tests.service.conftest import (
    API_KEY,
    Server,
    copy_model,
    kill_engine,
    start_server,
)

A = {"Authorization": f"Bearer {API_KEY}"}


def _served(srv: Server) -> dict[str, Any]:
    return httpx.get(srv.url + "/v1/models", timeout=10).json()["models"][0]


def _history(srv: Server) -> list[dict[str, Any]]:
    return httpx.get(srv.url + "/v1/models/history", headers=A, timeout=10).json()["history"]


def _post(srv: Server, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=A, timeout=120)


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """``tiny-v1`` (1.0.0) and ``tiny-v2`` (2.0.0): the same weights, so the gate passes."""
    root = tmp_path_factory.mktemp("state-models")
    copy_model(tiny_model, root / "tiny-v1", "1.0.0")
    copy_model(tiny_model, root / "tiny-v2", "2.0.0")
    return root


def test_served_model_survives_kill_and_restart_and_model_dir_flag_wins_once(
    tmp_path_factory: pytest.TempPathFactory, models_root: Path
) -> None:
    """promote → kill -9 engine → promoted; → full restart → promoted; rollback → restart →
    rolled back; --model-dir wins over the history at its start, not at the engine's restarts;
    a changed VGE_MODEL_DIR wins (a new deployment).
    One work directory throughout: each server start costs seconds."""
    work = tmp_path_factory.mktemp("state-restore")
    cfg = {"api_key": API_KEY, "workers": 1, "models_root": models_root, "drain_s": 0}
    srv = start_server(work, models_root / "tiny-v1", **cfg)
    try:
        first = _served(srv)
        assert (first["version"], first["served_because"]) == ("1.0.0", "start")
        assert first["restore_failed"] is None and first["served_since"].endswith("+00:00")
        assert srv.metric("vge_model_restore_failed") == 0

        r = _post(srv, "/v1/models/promote", {"model": "tiny-v2"})
        assert r.status_code == 200, r.text
        assert r.json()["gate"]["verdict"] == "passed"  # the same weights: no worse
        promoted = _served(srv)
        assert (promoted["version"], promoted["served_because"]) == ("2.0.0", "promote")
        entry = _history(srv)[0]
        assert entry["action"] == "promote" and entry["id"] == promoted["history_id"]
        assert len(entry["weights_sha256"]) == 64 and entry["comparison"]["verdict"] == "passed"

        # kill -9 of the engine: the supervisor's new engine restores the promoted model
        restored = kill_engine(srv)
        assert restored["version"] == "2.0.0"
        assert restored["restored_from"]["action"] == "promote"
        assert restored["served_since"] == promoted["served_since"]  # chosen then, not now
        assert restored["history_id"] == entry["id"] and len(_history(srv)) == 2  # no new entry
    finally:
        assert srv.stop() == 0

    # a full stop and start (VGE_MODEL_DIR still names tiny-v1): the promoted model
    srv = start_server(work, models_root / "tiny-v1", **cfg)
    try:
        again = _served(srv)
        assert (again["version"], again["served_because"]) == ("2.0.0", "restored")
        r = _post(srv, "/v1/models/rollback")  # not gated: the escape hatch
        assert r.status_code == 200 and r.json()["model"]["version"] == "1.0.0", r.text
        assert r.json()["model"]["served_because"] == "rollback"
    finally:
        assert srv.stop() == 0

    # rolled back, restarted: rolled back
    srv = start_server(work, models_root / "tiny-v1", **cfg)
    try:
        back = _served(srv)
        assert (back["version"], back["served_because"]) == ("1.0.0", "restored")
        assert back["restored_from"]["action"] == "rollback"
        assert [h["action"] for h in _history(srv)] == ["rollback", "promote", "start"]
        assert _post(srv, "/v1/models/promote", {"model": "tiny-v2"}).status_code == 200
    finally:
        assert srv.stop() == 0

    # the history says tiny-v2; --model-dir tiny-v1 on the command line wins, and says so
    srv = start_server(work, None, args=["--model-dir", str(models_root / "tiny-v1")], **cfg)
    try:
        served = _served(srv)
        assert (served["version"], served["served_because"]) == ("1.0.0", "start")
        assert "given explicitly (--model-dir" in srv.log() and "2.0.0" in srv.log()
        assert _history(srv)[0]["note"] == "model_dir given explicitly"
        # ... at this start only: a promote after it survives the engine's restart
        assert _post(srv, "/v1/models/promote", {"model": "tiny-v2"}).status_code == 200
        assert kill_engine(srv)["version"] == "2.0.0"
    finally:
        assert srv.stop() == 0

    # a VGE_MODEL_DIR other than the last start's is a new deployment (a rolling restart onto a
    # new directory): served and recorded as a start, not replaced by the history's promote
    srv = start_server(work, models_root / "tiny-v2", **cfg)
    try:
        served = _served(srv)
        assert (served["version"], served["served_because"]) == ("2.0.0", "start")
        assert _history(srv)[0]["note"] == "VGE_MODEL_DIR changed"
        assert "changed since the last start" in srv.log()
    finally:
        assert srv.stop() == 0


def test_the_gate_refuses_a_worse_model_and_a_lost_model_is_reported(
    tmp_path_factory: pytest.TempPathFactory, models_root: Path
) -> None:
    """Served: the shipped LeNet-5 (accuracy 0.96 on the gate's digits); candidate: the tiny
    model (one epoch on 512 digits); a model with letters for classes skips the gate. Then the
    candidate, forced in, is lost two ways."""
    work = tmp_path_factory.mktemp("state-gate")
    root = work / "models"
    copy_model(models_root / "tiny-v2", root / "tiny-v2", "2.0.0")
    letters = copy_model(models_root / "tiny-v2", root / "letters", "1.0.0") / "model_card.json"
    card = json.loads(letters.read_text())
    letters.write_text(json.dumps({**card, "class_names": list("abcdefghij")}))
    cfg = {"api_key": API_KEY, "workers": 1, "models_root": root, "drain_s": 0}
    srv = start_server(work, Path("lenet5-lle-vgn-mnist"), **cfg)
    try:
        refused = _post(srv, "/v1/models/promote", {"model": "tiny-v2"})
        assert refused.status_code == 409, refused.text
        body = refused.json()
        assert body["code"] == "promote_refused" and "accuracy" in body["error"]
        assert '"force": true' in body["error"]
        comparison = body["comparison"]
        assert comparison["verdict"] == "refused" and comparison["failures"]
        assert comparison["served"]["model"] == "lenet5-lle-vgn-mnist"
        assert comparison["served"]["n"] == comparison["candidate"]["n"] == 3600
        assert comparison["served"]["accuracy"] > 0.9 > comparison["candidate"]["accuracy"]
        assert comparison["deltas"]["accuracy"] < -comparison["tolerances"]["accuracy_drop"]
        assert _served(srv)["name"] == "lenet5-lle-vgn-mnist" and len(_history(srv)) == 1

        # a model that does not answer in digits cannot be compared on them: skipped, and said
        skipped = _post(srv, "/v1/models/promote", {"model": "letters"})
        assert skipped.status_code == 200, skipped.text
        gate = skipped.json()["gate"]
        assert gate["verdict"] == "skipped" and "a, b, c, d" in gate["reason"]
        assert _history(srv)[0]["comparison"] == gate
        assert _post(srv, "/v1/models/rollback").status_code == 200  # never gated

        forced = _post(srv, "/v1/models/promote", {"model": "tiny-v2", "force": True})
        assert forced.status_code == 200, forced.text
        assert forced.json()["gate"]["verdict"] == "forced"
        assert _served(srv)["gate"]["verdict"] == "forced"
        assert _history(srv)[0]["comparison"]["failures"] == comparison["failures"]
        bad = _post(srv, "/v1/models/promote", {"model": "tiny-v2", "force": "yes"})
        assert bad.status_code == 422  # a clear 4xx, not a truthy string
    finally:
        assert srv.stop() == 0

    # the promoted model's directory is deleted: the start model serves, loudly
    shutil.rmtree(root / "tiny-v2")
    srv = start_server(work, Path("lenet5-lle-vgn-mnist"), **cfg)
    try:
        served = _served(srv)
        assert served["name"] == "lenet5-lle-vgn-mnist" and served["served_because"] == "start"
        failed = served["restore_failed"]
        assert failed["model_dir"] == str((root / "tiny-v2").resolve())
        assert "does not exist" in failed["error"] and "/v1/models/promote" in failed["fix"]
        assert srv.metric("vge_model_restore_failed") == 1
        assert "ERROR" in srv.log() and "cannot restore the served model" in srv.log()
    finally:
        assert srv.stop() == 0

    # another model in its place (valid on its own, other weights): refused by the hash
    shutil.copytree(zoo_model_dir("cnn4-lle-vgn-mnist"), root / "tiny-v2")
    srv = start_server(work, Path("lenet5-lle-vgn-mnist"), **cfg)
    try:
        failed = _served(srv)["restore_failed"]
        assert "sha256" in failed["error"] and failed["recorded_action"] == "promote"
        assert srv.metric("vge_model_restore_failed") == 1
        # an operator's choice records what is served: resolved
        r = _post(srv, "/v1/models/rollback")
        assert r.status_code == 200 and r.json()["model"]["restore_failed"] is None, r.text
        assert srv.metric("vge_model_restore_failed") == 0
    finally:
        assert srv.stop() == 0
