"""End to end: train a tiny VGN model, then `vge evaluate` it; and the CLI's error paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.checkpoint import CARD_FILE
from models.data_ood import ABSTAIN_TARGETS, DEFERRED_OR_RIGHT_TARGETS, OOD_GROUPS
from models.evaluation.scores import UNCERTAINTY_SCORES
from service.cli import main


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.training import TrainConfig, train

    out = tmp_path_factory.mktemp("tiny-model")
    config = TrainConfig(
        name="tiny-lle-vgn", max_train_samples=256, epochs=1, members=3, vgn=True, batch_size=64
    )
    return train(config, out)


def test_vge_evaluate_writes_metrics_plots_and_report(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "eval"
    assert main(["evaluate", str(tiny_model), "--out", str(out)]) == 0
    assert "accuracy" in capsys.readouterr().out

    metrics = json.loads((out / "metrics.json").read_text())
    card = json.loads((tiny_model / CARD_FILE).read_text())
    assert metrics["split"] == "test" and metrics["n_samples"] == 1600  # 20 % of the 8,000 digits
    assert metrics["gated"] is True and metrics["n_members"] == 3
    # Images fed through Predictor.prepare give the same test metrics training stored in the card.
    stored = card["metrics"]["evaluation"]["classification"]
    for key in ("accuracy", "nll", "ece"):
        assert metrics["classification"][key] == pytest.approx(stored[key], abs=1e-6)
    # The card's calibrated abstain k (validation split) is the one evaluated.
    assert metrics["abstention"]["abstain_k"] == pytest.approx(
        card["abstain_calibration"]["abstain_k"]
    )
    # OOD: the project's suite (docs/ood-suite.md), 500 per group; "ood" pools the 5 far groups
    assert metrics["ood"]["n_ood"] == 2500 and set(metrics["ood"]["scores"]) >= {
        "vgmu",
        "eu",
        "epkl",
        "epjs",
    }
    suite = metrics["ood_suite"]
    assert list(suite["groups"]) == list(OOD_GROUPS) and suite["far"]["n"] == 2500
    for name, g in suite["groups"].items():
        assert g["n"] == 500 and 0 <= g["abstain_rate"] <= 1 and sum(g["predicted"]) == 500
        assert g["target"] == ABSTAIN_TARGETS.get(name, DEFERRED_OR_RIGHT_TARGETS.get(name))
        assert (g["deferred_or_right"] is None) == (name not in ("rotated_digits", "shrunk_digits"))
        assert set(g["scores"]) == set(UNCERTAINTY_SCORES)
    assert suite["far"]["scores"]["vgmu"] == metrics["ood"]["scores"]["vgmu"]
    # the card stores the same per-group numbers (computed at training time, same k and images)
    in_card = card["metrics"]["evaluation"]["ood_suite"]
    for name, g in in_card["groups"].items():
        assert g["abstain_rate"] == pytest.approx(suite["groups"][name]["abstain_rate"], abs=0.01)
    assert "ood_examples.png" in set(metrics["plots"].values())

    for name in metrics["plots"].values():
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert {
        "reliability.png",
        "margin_variance.png",
        "learned_k.png",
        "confident_errors.png",
    } <= set(metrics["plots"].values())
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "## OOD suite, per group" in report and "| letters | 500 |" in report
    assert "## OOD and error-detection AUROC per score" in report and "| 1 − max prob |" in report
    assert metrics["selective"]["max_prob"]["error_auroc"] is not None
    assert suite["groups"]["shrunk_digits"]["target_kind"] == "deferred_or_right"
    assert (
        "# Evaluation: tiny-lle-vgn" in report
        and "![Reliability diagram](reliability.png)" in report
    )


def test_vge_evaluate_val_split_default_out_dir(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --out the results go to runs/eval/<model>-<split> (git-ignored in the repository:
    an evaluation from its root leaves the working tree clean) and the last line says where."""
    import subprocess

    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["evaluate", str(tiny_model), "--split", "val"]) == 0
    out = work / "runs" / "eval" / f"{tiny_model.name}-val"
    assert sorted(p.name for p in work.iterdir()) == ["runs"]  # nothing else in the cwd
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"wrote {out.resolve()}: metrics.json, report.md and ")
    repo = Path(__file__).resolve().parents[3]
    rel = out.relative_to(work) / "metrics.json"
    ignored = subprocess.run(
        ["git", "-C", str(repo), "check-ignore", "-q", "--no-index", str(rel)], check=False
    )
    assert ignored.returncode == 0, f"{rel} is not git-ignored in the repository"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["split"] == "val" and metrics["n_samples"] == 800
    # calibration targeted 5 % deferral on exactly this split
    assert metrics["abstention"]["deferral"] == pytest.approx(0.05, abs=1 / 800)


def test_vge_evaluate_holdout_split(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "holdout"
    assert main(["evaluate", str(tiny_model), "--split", "holdout", "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["split"] == "holdout" and metrics["n_samples"] == 2000
    assert "held-out MNIST" in metrics["data"]
    err = metrics["selective"]["vgmu"]["error_auroc"]
    assert err is None or 0.0 <= err <= 1.0


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_missing_model_dir_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["evaluate", str(tmp_path / "nope")]) == 2
    assert "no such model directory" in _one_line_error(capsys)


def test_directory_without_a_model_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["evaluate", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "model card not found" in _one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_an_output_that_cannot_be_written_is_blamed_not_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("")
    assert main(["evaluate", "default", "--out", str(tmp_path / "a-file" / "out")]) == 2
    err = _one_line_error(capsys)
    assert err.startswith(f"vge evaluate: error: {tmp_path / 'a-file' / 'out'}: "), err


def test_bad_split_exits_2(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["evaluate", str(tiny_model), "--split", "train"])
    assert exc.value.code == 2
    assert "invalid choice" in _one_line_error(capsys)


def test_a_card_calibrated_with_abstain_k_alone_is_evaluated_at_the_served_k(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Found by review (2026-11-29): a valid card whose abstain_calibration holds abstain_k alone
    was a traceback (KeyError 'mode'); and evaluate took that k whatever member set it was
    calibrated for, where the server answers a VGN model from q at the k calibrated for q (a
    card from before 0.2 calibrated p: the server then uses 1.0). The report's k is the
    served one now."""
    import shutil

    from models.predictor import Predictor

    model = tmp_path / "konly"
    shutil.copytree(tiny_model, model)
    card_path = model / CARD_FILE
    card = json.loads(card_path.read_text())
    card["abstain_calibration"] = {"abstain_k": 2.0}  # no members: calibrated on p (pre-0.2)
    card_path.write_text(json.dumps(card))
    served = Predictor.from_dir(model, device="cpu").options()
    assert card["vgn"] and (served.members, served.abstain_k) == ("q", 1.0)
    out = tmp_path / "out"
    assert main(["evaluate", str(model), "--split", "test", "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["abstention"]["abstain_k"] == served.abstain_k
    report = (out / "report.md").read_text()
    assert "abstain k = 2" in report and "at the k the server answers with, 1:" in report


def test_recalibrate_keeps_the_suite_and_refuses_what_it_cannot_rebuild(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Found by review (2026-11-29): recalibrating dropped the card's OOD-suite numbers, and
    calibrated a model whose training also carved a calibration split on the validation split
    alone (a different rule than the card said). The suite is recomputed at the new k now, and
    such a model is refused (exit 2, one line)."""
    import shutil

    from models.evaluation.recalibrate import main as recalibrate_main

    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    card_path = model / CARD_FILE
    assert recalibrate_main([str(model), "--target-deferral", "0.1"]) == 0
    card = json.loads(card_path.read_text())
    assert card["abstain_calibration"]["target"] == 0.1
    suite = card["metrics"]["evaluation"]["ood_suite"]
    assert suite is not None and set(suite["groups"]) == set(OOD_GROUPS)
    card["training"]["config"]["calibration_split"] = 0.1
    card_path.write_text(json.dumps(card))
    assert recalibrate_main([str(model)]) == 2
