"""The promote gate: may a candidate model replace the served one?

A promote swaps the model every request is answered by, so before it does, the candidate and the
served model are measured on the same fixed data and the candidate must not be worse beyond set
tolerances. What the gate checks, and why:

* **The data** (:data:`GATE_DATA`, :func:`gate_data`): the bundled MNIST test split (1,600 digits)
  and the 2,000 held-out digits outside the bundled 8k, 3,600 images no model trained here saw in
  training or model selection, so neither model is flattered by digits it learned. Both models
  answer them through the serving path (``conform``, ``run``, ``score_columns``) at their own
  calibrated ``abstain_k`` (:func:`evaluate_for_gate`): the numbers are what a client would get.
* **Three numbers** per model (:func:`rates`): accuracy over every digit, the accuracy of the
  answers it does not defer (what a client relies on), and the deferral rate (what it hands to a
  person). A model can trade one for another (defer more to look more accurate), so each is
  checked on its own.
* **The verdict** (:func:`compare_for_gate`, :func:`gate_verdict`): the candidate fails on
  accuracy or accepted-answer accuracy more than its tolerance below the served model's, or a
  deferral rate more than its tolerance above (:class:`GateTolerances`; exactly at a tolerance it
  passes). A candidate that accepts nothing fails whenever the served model accepts something.
  No failure: ``passed``; failures: ``refused``, or ``forced`` when the operator said so.
* **What it cannot judge** (:func:`gate_skip_reason`): the labels are the digits 0-9, so a model
  whose classes are not exactly ``"0"`` … ``"9"`` answers another question; the gate is skipped
  for it (and said so), never passed on meaningless numbers.

Pure evaluation: numbers, model cards and a predictor in; dicts (JSON-ready, stored with the
history entry) and sentences out. Who asks, what a refusal means on the wire and how it is logged
belong to the server (``service.engine.model_manager``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from torch import Tensor

    from models.checkpoint import ModelCard
    from models.ensembles import EnsembleOutput
    from models.serving import ScoreColumns, ScoreOptions

__all__ = [
    "GATE_DATA",
    "GatePredictor",
    "GateTolerances",
    "Verdict",
    "compare_for_gate",
    "evaluate_for_gate",
    "gate_data",
    "gate_skip_reason",
    "gate_verdict",
    "rates",
]

#: What the gate evaluates on: MNIST digits no model trained here ever saw in training or model
#: selection (the bundled test split, and the 2,000 held-out digits outside the bundled 8k).
GATE_DATA = "bundled MNIST test split (1,600 digits) + held-out MNIST digits (2,000)"
DIGITS = [str(i) for i in range(10)]
#: A comparison exactly at a tolerance passes, whatever the float round-off.
EPS = 1e-9

#: ``passed``: no failure; ``forced``: failures, served anyway on request; ``refused``: failures.
Verdict = Literal["passed", "forced", "refused"]


class GatePredictor(Protocol):
    """What the gate needs of a loaded model (:class:`models.predictor.Predictor` has it, and so
    does the engine's ``ServedPredictor``): its card and the serving path."""

    @property
    def card(self) -> ModelCard: ...

    def conform(self, image: Tensor) -> Tensor: ...

    def run(self, parts: Sequence[Tensor | np.ndarray]) -> EnsembleOutput: ...

    def options(self, *, top_k: int = ...) -> ScoreOptions: ...

    def score_columns(self, out: EnsembleOutput, options: ScoreOptions) -> ScoreColumns: ...


@dataclass(frozen=True)
class GateTolerances:
    """How much worse than the served model a candidate may be (shares, 0-1): accuracy and
    accepted-answer accuracy may drop by at most ``accuracy_drop`` / ``accepted_accuracy_drop``,
    the deferral rate rise by at most ``deferral_rise``."""

    accuracy_drop: float
    accepted_accuracy_drop: float
    deferral_rise: float

    def as_dict(self) -> dict[str, float]:
        """As the comparison shows them (``tolerances``)."""
        return {
            "accuracy_drop": self.accuracy_drop,
            "accepted_accuracy_drop": self.accepted_accuracy_drop,
            "deferral_rise": self.deferral_rise,
        }


@functools.lru_cache(maxsize=1)
def gate_data() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The gate's evaluation data by part: uint8 images ``(N, 28, 28)`` and digit labels."""
    from models.data import bundled_split, load_bundled_mnist, load_holdout_mnist

    images, labels = load_bundled_mnist()
    idx = bundled_split()["test"]
    held_images, held_labels = load_holdout_mnist()
    return {"test": (images[idx], labels[idx]), "holdout": (held_images, held_labels)}


def gate_skip_reason(card: ModelCard) -> str | None:
    """Why the gate cannot evaluate ``card``'s model on its digits (None: it can).

    The data's labels are the digits 0-9: a model whose classes are not exactly the names
    ``"0"`` … ``"9"`` (in any order) answers other questions, and accuracy on digits says nothing
    about it. Inputs of another channel count or size are conformed as the server conforms
    uploads (gray to RGB, resized), so a digit model of another input shape is still compared.
    """
    names = [str(c) for c in card.class_names]
    if sorted(names) != DIGITS:
        shown = ", ".join(names[:4]) + (", …" if len(names) > 4 else "")
        return (
            f"{card.name} {card.version}'s classes ({shown}) are not the ten digits '0'…'9' of "
            "the gate's evaluation data"
        )
    return None


def rates(correct: np.ndarray, abstain: np.ndarray) -> dict[str, Any]:
    """``n``, ``accuracy``, ``accepted_accuracy`` (None when every answer is deferred) and
    ``deferral`` of per-image bools ``correct`` and ``abstain``, rounded to 5 decimals."""
    accepted = ~abstain
    return {
        "n": int(correct.size),
        "accuracy": round(float(correct.mean()), 5),
        "accepted_accuracy": round(float(correct[accepted].mean()), 5) if accepted.any() else None,
        "deferral": round(float(abstain.mean()), 5),
    }


def evaluate_for_gate(predictor: GatePredictor, batch: int) -> dict[str, Any]:
    """Accuracy, accepted-answer accuracy and deferral rate of ``predictor`` on :func:`gate_data`,
    through the serving path (``conform``, ``run``, ``score_columns``) at the card's calibrated
    ``abstain_k`` for its answer members (1.0 when uncalibrated), in batches of ``batch``.

    Thread-safe on a served predictor (it is called beside the batcher's compute thread).
    """
    card = predictor.card
    options = predictor.options(top_k=1)
    digit_of = np.array([int(c) for c in card.class_names])
    same_shape = card.in_channels == 1 and tuple(card.input_size) == (28, 28)
    parts, corrects, abstains = {}, [], []
    for part, (images, labels) in gate_data().items():
        if same_shape:
            x = images[:, None]
        else:
            x = np.stack([predictor.conform(torch.from_numpy(im)[None]).numpy() for im in images])
        preds, flags = [], []
        for start in range(0, len(x), batch):
            columns = predictor.score_columns(predictor.run([x[start : start + batch]]), options)
            preds.append(columns.column("prediction"))
            flags.append(columns.column("abstain"))
        correct = digit_of[np.concatenate(preds)] == labels
        abstain = np.concatenate(flags)
        parts[part] = rates(correct, abstain)
        corrects.append(correct)
        abstains.append(abstain)
    return {
        "model": card.name,
        "version": card.version,
        "abstain_k": round(float(options.abstain_k), 5),
        "members": options.members,
        **rates(np.concatenate(corrects), np.concatenate(abstains)),
        "by_part": parts,
    }


def compare_for_gate(
    served: dict[str, Any], candidate: dict[str, Any], tolerances: GateTolerances
) -> dict[str, Any]:
    """The gate's comparison of two :func:`evaluate_for_gate` results: tolerances, deltas
    (candidate − served) and ``failures``, one sentence per metric worse beyond its tolerance."""
    failures: list[str] = []
    deltas: dict[str, float | None] = {}
    for metric, tolerance, what in (
        ("accuracy", tolerances.accuracy_drop, "accuracy"),
        ("accepted_accuracy", tolerances.accepted_accuracy_drop, "accepted-answer accuracy"),
    ):
        s, c = served[metric], candidate[metric]
        if s is None:  # the served model accepts nothing: nothing to fall short of
            deltas[metric] = None
        elif c is None:
            deltas[metric] = None
            failures.append(f"the candidate accepts no answer (deferral 1.0); the served "
                            f"model's {what} is {s:.4f}")  # fmt: skip
        else:
            deltas[metric] = round(c - s, 5)
            if c < s - tolerance - EPS:
                failures.append(f"{what} {c:.4f} is {s - c:.4f} below the served model's "
                                f"{s:.4f} (tolerance {tolerance:g})")  # fmt: skip
    s, c = served["deferral"], candidate["deferral"]
    deltas["deferral"] = round(c - s, 5)
    tolerance = tolerances.deferral_rise
    if c > s + tolerance + EPS:
        failures.append(f"deferral rate {c:.4f} is {c - s:.4f} above the served model's {s:.4f} "
                        f"(tolerance {tolerance:g})")  # fmt: skip
    return {
        "data": GATE_DATA,
        "tolerances": tolerances.as_dict(),
        "served": served,
        "candidate": candidate,
        "deltas": deltas,
        "failures": failures,
    }


def gate_verdict(failures: Sequence[str], force: bool) -> Verdict:
    """``passed`` without ``failures``; with some, ``forced`` when ``force`` (served anyway), else
    ``refused``."""
    if not failures:
        return "passed"
    return "forced" if force else "refused"
