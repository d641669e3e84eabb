"""The served model is durable state, and promote is gated (issue 24, items 1 and 3).

Real ``vge serve`` processes on loopback, sharing a work directory (and so the jobs database that
holds the model history) across restarts:

* promote → ``kill -9`` of the engine → the supervisor's new engine serves the promoted model;
  promote → full restart → promoted; rollback → restart → rolled back;
* the served-model rule (issue 32): a promote or rollback survives restarts of the same
  configuration; a start whose configured model (``--model-dir`` / ``VGE_MODEL_DIR``, or none =
  the shipped default) differs from the previous start's serves what it was told and logs it
  (explicit → plain → promote → plain);
* the promote gate refuses a worse candidate with 409 and the comparison, ``force`` serves it;
* a recorded model that is deleted or whose weights were replaced is not restored: the start model
  serves, and the log (ERROR), ``vge_model_restore_failed`` and ``/v1/models`` say so;
* a model directory is validated whole before anything is recorded or served (issue 36): bad
  cards, symlinked or foreign weights are a 422 naming the problem, not recorded, not swapped;
  a recorded model whose card went bad never stops the server (``kill -9`` → restore fails →
  the start model, then the shipped default, answer 200).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from models.zoo import DEFAULT_MODEL, zoo_model_dir
from tests.service.conftest import (
    API_KEY,
    Server,
    copy_model,
    kill_engine,
    start_in_process,
    start_server,
)
from tests.service.inprocess import InProcessServer

A = {"Authorization": f"Bearer {API_KEY}"}


def _served(srv: Server | InProcessServer) -> dict[str, Any]:
    return httpx.get(srv.url + "/v1/models", timeout=10).json()["models"][0]


def _history(srv: Server | InProcessServer) -> list[dict[str, Any]]:
    return httpx.get(srv.url + "/v1/models/history", headers=A, timeout=10).json()["history"]


def _post(
    srv: Server | InProcessServer, path: str, body: dict[str, Any] | None = None
) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=A, timeout=120)


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """``tiny-v1`` (1.0.0) and ``tiny-v2`` (2.0.0): the same weights, so the gate passes."""
    root = tmp_path_factory.mktemp("state-models")
    copy_model(tiny_model, root / "tiny-v1", "1.0.0")
    copy_model(tiny_model, root / "tiny-v2", "2.0.0")
    return root


def test_served_model_survives_kill_and_restarts_of_the_same_configuration(
    tmp_path_factory: pytest.TempPathFactory, models_root: Path
) -> None:
    """promote → kill -9 engine → promoted; → full restart → promoted; rollback → restart →
    rolled back; --model-dir naming the same directory as VGE_MODEL_DIR did is the same
    configuration (promoted, and again after the engine's restart); a changed VGE_MODEL_DIR is
    served (a new deployment). One work directory throughout: each server start costs seconds."""
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

    # the history says tiny-v2; --model-dir tiny-v1 names the configured model as VGE_MODEL_DIR
    # did: the same configuration, so the promote survives
    srv = start_server(work, None, args=["--model-dir", str(models_root / "tiny-v1")], **cfg)
    try:
        served = _served(srv)
        assert (served["version"], served["served_because"]) == ("2.0.0", "restored")
    finally:
        assert srv.stop() == 0

    # a VGE_MODEL_DIR other than the last start's is a new deployment (a rolling restart onto a
    # new directory): served and recorded as a start, not replaced by the history's promote
    srv = start_server(work, models_root / "tiny-v2", **cfg)
    try:
        served = _served(srv)
        assert (served["version"], served["served_because"]) == ("2.0.0", "start")
        note = _history(srv)[0]["note"]
        assert note.startswith("configured model changed: ") and "tiny-v2" in note, note
        assert "configured model changed" in srv.log()
    finally:
        assert srv.stop() == 0


def test_the_gate_refuses_a_worse_model_and_a_lost_model_is_reported(
    tmp_path_factory: pytest.TempPathFactory, models_root: Path
) -> None:
    """Served: the shipped LeNet-5 (accuracy 0.96 on the gate's digits); candidate: the tiny
    model (one epoch on 512 digits); a model with letters for classes skips the gate. Then the
    candidate, forced in, is lost two ways. In process: each start a new run of the server (the
    rules, not processes, are under test)."""
    work = tmp_path_factory.mktemp("state-gate")
    root = work / "models"
    copy_model(models_root / "tiny-v2", root / "tiny-v2", "2.0.0")
    letters = copy_model(models_root / "tiny-v2", root / "letters", "1.0.0") / "model_card.json"
    card = json.loads(letters.read_text())
    letters.write_text(json.dumps({**card, "class_names": list("abcdefghij")}))
    cfg = {"api_key": API_KEY, "models_root": root}
    srv = start_in_process(work, Path("lenet5-lle-vgn-mnist"), **cfg)
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
    srv = start_in_process(work, Path("lenet5-lle-vgn-mnist"), **cfg)
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
    srv = start_in_process(work, Path("lenet5-lle-vgn-mnist"), **cfg)
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


def test_the_served_model_rule_explicit_plain_promote_plain(
    tmp_path_factory: pytest.TempPathFactory, models_root: Path
) -> None:
    """A promote or rollback survives restarts of the same configuration; a start whose
    configured model (--model-dir / VGE_MODEL_DIR, or none = the shipped default) differs from
    the previous start's serves what it was told and logs it. Issue 32's walk: after
    ``--model-dir X`` a plain ``vge serve`` served X again; now it serves the shipped default."""
    work = tmp_path_factory.mktemp("state-rule")
    cfg = {"api_key": API_KEY, "workers": 1, "models_root": models_root, "drain_s": 0}
    explicit = ["--model-dir", str(models_root / "tiny-v1")]
    srv = start_server(work, None, args=explicit, **cfg)
    try:  # explicit: what it was told
        served = _served(srv)
        assert (served["name"], served["served_because"]) == ("tiny", "start")
    finally:
        assert srv.stop() == 0

    srv = start_server(work, None, **cfg)
    try:  # plain: the shipped default, not the previous start's tiny-v1; the log says why
        served = _served(srv)
        assert (served["name"], served["served_because"]) == (DEFAULT_MODEL, "start")
        note = _history(srv)[0]["note"]
        assert note == (f"configured model changed: none (the shipped default), was "
                        f"{(models_root / 'tiny-v1').resolve()}")  # fmt: skip
        assert note in srv.log()
        # a promote under this configuration (forced: the tiny model is worse than the default)
        r = _post(srv, "/v1/models/promote", {"model": "tiny-v2", "force": True})
        assert r.status_code == 200 and r.json()["gate"]["verdict"] == "forced", r.text
        # the engine's restarts within this run restore it (the change was this run's start)
        assert kill_engine(srv)["version"] == "2.0.0"
    finally:
        assert srv.stop() == 0

    srv = start_server(work, None, **cfg)
    try:  # plain again: the same configuration, so the promote survives
        served = _served(srv)
        assert (served["version"], served["served_because"]) == ("2.0.0", "restored")
        assert served["restored_from"]["action"] == "promote"
        assert "configured model changed" not in srv.log()
        assert [h["action"] for h in _history(srv)] == ["promote", "start", "start"]
    finally:
        assert srv.stop() == 0


def _set(card_path: Path, **changes: Any) -> None:
    """Change top-level fields of a model card on disk (``a__b``: key b of section a)."""
    card = json.loads(card_path.read_text())
    for key, value in changes.items():
        section, _, sub = key.partition("__")
        card.update({section: {**card[section], sub: value}} if sub else {key: value})
    card_path.write_text(json.dumps(card))


def _predict_ok(srv: Server, png: bytes) -> dict[str, Any]:
    r = httpx.post(srv.url + "/v1/predict", files=[("images", ("a.png", png))], timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _kill_engine_until(srv: Server, cond: Any) -> dict[str, Any]:
    """kill -9 the engine and wait for the supervisor's new one to serve a model with ``cond``."""
    import os
    import signal

    from tests.service.conftest import engine_pid, until

    engine = engine_pid(srv)
    assert engine is not None
    os.kill(engine, signal.SIGKILL)
    until(lambda: engine_pid(srv) not in (None, engine), "a new engine", srv)
    until(lambda: httpx.get(srv.url + "/readyz", timeout=5).status_code == 200
          and cond(_served(srv)), "the new engine's model", srv)  # fmt: skip
    return _served(srv)


def test_a_model_directory_is_validated_whole_and_a_bad_recorded_one_never_stops_the_server(
    tmp_path_factory: pytest.TempPathFactory, models_root: Path, pngs: list[bytes]
) -> None:
    """Issue 36 items 1-2, through a real process tree. Promote of a bad card, a class name that
    is a path, an oversized input, symlinked or foreign weights: 422 naming the problem, nothing
    recorded, nothing swapped (the card's uncertainty reference used to fail only after the
    swap, and the model stayed recorded). Then a served model's card goes bad on disk: reload
    and rollback refuse it, and after kill -9 the restore fails, the start model serves with
    restore_failed; with the start model broken too, the next restart serves the shipped
    default. The supervisor never stops; /v1/predict answers 200 throughout."""
    import hashlib

    from safetensors.torch import load_file, save_file

    from models.checkpoint import file_sha256

    work = tmp_path_factory.mktemp("state-untrusted")
    root = work / "models"
    start = copy_model(models_root / "tiny-v1", root / "tiny-v1", "1.0.0")
    good = copy_model(models_root / "tiny-v2", root / "tiny-v2", "2.0.0")
    secret = work / "secret.txt"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/sh\n")
    secret_sha = hashlib.sha256(secret.read_bytes()).hexdigest()
    bad = {  # directory -> (what is wrong, words the 422 must hold)
        "bad-card": ({"uncertainty_reference__deferral": "not-a-number"},
                     "uncertainty_reference.deferral"),
        "path-class": ({"class_names": [str(i) for i in range(9)] + ["../outside"]},
                       "class_names"),
        "big-input": ({"input_size": [768, 768]}, "input_size"),
        "no-channels": ({"in_channels": -1}, "in_channels"),
        "no-mean": ({"mean": []}, "mean"),
        "linked": ("symlink", "symbolic link"),
        "junk": ("junk", "not a readable safetensors file"),
        "nan-weights": ("nan", "warm-up failed"),
    }  # fmt: skip
    for name, (change, _) in bad.items():
        d = copy_model(good, root / name, "3.0.0")
        weights = d / "model.safetensors"
        if change == "symlink":
            weights.unlink()
            weights.symlink_to(secret)
        elif change == "junk":  # a card that hashes the junk: the header refuses it
            weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not safetensors!")
            _set(d / "model_card.json", weights_sha256=file_sha256(weights))
        elif change == "nan":  # well-formed weights that answer NaN: the warm-up refuses them
            state = load_file(weights)
            state = {k: v.fill_(float("nan")) if v.is_floating_point() else v
                     for k, v in state.items()}  # fmt: skip
            save_file(state, weights)
            _set(d / "model_card.json", weights_sha256=file_sha256(weights))
        else:
            _set(d / "model_card.json", **change)
    cfg = {"api_key": API_KEY, "workers": 1, "models_root": root, "drain_s": 0}
    srv = start_server(work, start, **cfg)
    try:
        for name, (_, words) in bad.items():
            r = _post(srv, "/v1/models/promote", {"model": name})
            assert r.status_code == 422, (name, r.text)
            body = r.json()
            assert body["code"] == "invalid_value" and words in body["error"], (name, body)
            assert "was not served" in body["error"]
        assert secret_sha[:16] not in srv.log()  # the symlink's target was never hashed
        assert [h["action"] for h in _history(srv)] == ["start"]  # nothing recorded
        assert _served(srv)["version"] == "1.0.0"  # nothing swapped
        assert "Traceback" not in srv.log()

        r = _post(srv, "/v1/models/promote", {"model": "tiny-v2"})
        assert r.status_code == 200, r.text
        promoted = _history(srv)[0]
        # the served model's card goes bad on disk (after it served)
        _set(good / "model_card.json", uncertainty_reference__deferral="not-a-number")
        r = _post(srv, "/v1/models/reload")
        assert r.status_code == 422 and "uncertainty_reference.deferral" in r.text, r.text
        assert _served(srv)["version"] == "2.0.0" and _history(srv)[0] == promoted

        # kill -9: the new engine cannot restore it; the start model serves, and says why
        served = _kill_engine_until(srv, lambda m: m["restore_failed"] is not None)
        assert (served["version"], served["served_because"]) == ("1.0.0", "start")
        failed = served["restore_failed"]
        assert failed["history_id"] == promoted["id"]
        assert "uncertainty_reference.deferral" in failed["error"]
        assert srv.metric("vge_model_restore_failed") == 1
        _predict_ok(srv, pngs[0])
        r = _post(srv, "/v1/models/rollback", {"to": promoted["id"]})  # not gated, still checked
        assert r.status_code == 422 and "uncertainty_reference.deferral" in r.text, r.text
        assert _history(srv)[0] == promoted

        # the start model breaks too: the next restart serves the shipped default
        _set(start / "model_card.json", class_names=["/abs"] * 10)
        served = _kill_engine_until(srv, lambda m: m["name"] == DEFAULT_MODEL)
        assert served["restore_failed"]["start_model_error"].count("class_names") == 1
        _predict_ok(srv, pngs[0])
        assert srv.proc.poll() is None  # the supervisor never gave up
        assert srv.metric("vge_process_restarts_total", role="engine") == 2
    finally:
        assert srv.stop() == 0


def test_new_files_for_the_configured_model_are_served_without_an_alarm(
    tmp_path_factory: pytest.TempPathFactory, models_root: Path
) -> None:
    """Found by review (2026-11-29): nothing promoted, the configured model's files replaced in
    place (as an upgrade of the image or package that ships the default replaces its weights):
    the next start of the same configuration tried to restore the recorded start, its sha256
    failed, and the server raised the restore alarm (ERROR, vge_model_restore_failed 1) while
    serving the right model. Now it serves the new files as a start, recorded, no alarm; a
    replaced *promoted* model still alarms (the test above)."""
    work = tmp_path_factory.mktemp("state-upgrade")
    configured = copy_model(models_root / "tiny-v1", work / "models" / "configured", "1.0.0")
    cfg = {"api_key": API_KEY, "models_root": work / "models"}
    srv = start_in_process(work, configured, **cfg)
    try:
        assert _served(srv)["version"] == "1.0.0"
    finally:
        assert srv.stop() == 0
    shutil.rmtree(configured)
    copy_model(zoo_model_dir("lenet5-lle-vgn-mnist"), configured, "9.0.0")  # other weights
    srv = start_in_process(work, configured, **cfg)
    try:
        served = _served(srv)
        assert (served["name"], served["version"]) == ("lenet5-lle-vgn-mnist", "9.0.0")
        assert served["served_because"] == "start" and served.get("restore_failed") is None
        assert srv.metric("vge_model_restore_failed") == 0
        top = _history(srv)[0]
        assert top["action"] == "start" and "changed since its last start" in top["note"]
        assert "ERROR" not in srv.log()
    finally:
        assert srv.stop() == 0
