"""The input pipeline measured through a real ``vge serve`` with its defaults (issue 32).

    python -m benchmarks.inputs [--per-family 200] [--per-group 500] [--seed 0] [--write]

Starts ``vge serve`` (the shipped default model, CPU, a fresh state directory, a free loopback
port), POSTs every image as a user would (multipart ``/v1/predict``, 16 images per request) and
reports:

* digits as people send them (:mod:`models.data_photos`: held-out digits rendered as photos and
  scans, per family): answers accepted and accepted answers correct, under the server's default
  ``prepare`` (``mnist``) and ``prepare=none`` (the pixels as sent, today's behaviour before);
* the in-distribution targets: the bundled test split and the 2,000 held-out digits, each and
  pooled, sent as PNG: accuracy, accepted answers correct, deferral;
* the OOD suite (:mod:`models.data_ood`, seed 0 unless ``--seed``) sent as PNG: the abstain rate
  per group with ``prepare=mnist`` and ``prepare=none`` side by side, and how many pictures the
  reading found no digit in;
* the reading's CPU per image (in this process, one thread): an MNIST digit (served as sent), a
  28×28 digit off centre, photos of 100, 300 and 3000×2000 px.

With ``--model NAME`` it serves that model (``VGE_MODEL_DIR``) instead of the default, and
``--section`` names the docs/benchmarks.md section written (default: the issue 32 one). The OOD
table also gives, per group, "deferred or right" for the labelled near groups (issue 33:
shrunk digits ≥ 98 %), and, far groups pooled against the in-distribution digits, the AUROC of
the served scores: VGMU, 1 − max prob, TU and EU, each twice — as served (an image the reading
finds no digit in ranks most uncertain, as it is answered) and on the images read as digits
alone (the model's own score, what issue 33's "EU alone" asks).

``--write`` replaces the section in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import torch
from torchvision.io import encode_png

REPO = Path(__file__).resolve().parents[1]
PER_REQUEST = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(model: str | None = None) -> Iterator[str]:
    """A plain ``vge serve`` (defaults but a fresh state directory and a loopback port; ``model``
    sets ``VGE_MODEL_DIR``)."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="vge-inputs-") as state:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VGE_")}
        env.update(
            VGE_HOST="127.0.0.1", VGE_PORT=str(port), VGE_LOG_LEVEL="warning",
            VGE_JOBS_DB_URL=f"sqlite:///{state}/jobs.sqlite3", VGE_JOBS_DIR=f"{state}/jobs",
            VGE_MODELS_ROOT=f"{state}/models", VGE_DEVICE="cpu",
        )  # fmt: skip
        if model:
            env["VGE_MODEL_DIR"] = model
        proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli.serve"], cwd=state, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(proc.stderr.read().decode()[-2000:])  # type: ignore[union-attr]
                try:
                    if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("vge serve not ready in 180 s")
                time.sleep(0.3)
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def predict(url: str, blobs: list[bytes], prepare: str | None = None) -> list[dict]:
    """Every blob's /v1/predict result, :data:`PER_REQUEST` images per request."""
    out: list[dict] = []
    params = {"prepare": prepare} if prepare else {}
    with httpx.Client(base_url=url, timeout=120) as client:
        for start in range(0, len(blobs), PER_REQUEST):
            files = [
                ("images", (f"{i}", b)) for i, b in enumerate(blobs[start : start + PER_REQUEST])
            ]
            r = client.post("/v1/predict", files=files, params=params)
            r.raise_for_status()
            out.extend(r.json()["results"])
    return out


def _png(a: np.ndarray) -> bytes:
    return bytes(encode_png(torch.from_numpy(np.ascontiguousarray(a))[None]).numpy())


def _rates(rows: list[dict], labels: np.ndarray) -> dict[str, float]:
    pred = np.array([r["prediction"] for r in rows])
    abstain = np.array([r["abstain"] for r in rows])
    accepted = ~abstain
    correct = pred == labels
    return {
        "n": len(rows),
        "accuracy": float(correct.mean()),
        "accepted": float(accepted.mean()),
        "accepted_correct": float(correct[accepted].mean()) if accepted.any() else float("nan"),
        "deferral": float(abstain.mean()),
    }


def _wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson interval of a rate ``p`` over ``n``."""
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def _scores(rows: list[dict]) -> dict[str, np.ndarray]:
    """The served scores of ``rows`` (higher = more uncertain) and which were read as digits."""
    return {
        "vgmu": np.array([r["vgmu"] for r in rows]),
        "max_prob": np.array(
            [1 - max(lp["probability"] for lp in r["probabilities"]) for r in rows]
        ),
        "tu": np.array([r["tu"] for r in rows]),
        "eu": np.array([r["eu"] for r in rows]),
        "read": np.array([r["input_check"] == "ok" for r in rows]),
    }


def _aurocs(id_rows: list[dict], ood_rows: list[dict]) -> dict[str, tuple[float, float]]:
    """Per score, the OOD AUROC (OOD positive) as served — an image without a digit ranks most
    uncertain, as it is answered — and on the OOD images read as digits alone."""
    from sklearn.metrics import roc_auc_score

    a, b = _scores(id_rows), _scores(ood_rows)
    out = {}
    for name in ("vgmu", "max_prob", "tu", "eu"):
        served = np.where(b["read"], b[name], np.inf)
        served = np.nan_to_num(served, posinf=1e9)
        y = np.r_[np.zeros(a[name].size), np.ones(served.size)]
        auc_served = roc_auc_score(y, np.r_[a[name], served])
        read = b[name][b["read"]]
        y2 = np.r_[np.zeros(a[name].size), np.ones(read.size)]
        auc_read = roc_auc_score(y2, np.r_[a[name], read]) if read.size else float("nan")
        out[name] = (float(auc_served), float(auc_read))
    return out


def reading_cost() -> list[tuple[str, float]]:
    """µs of CPU per image of :func:`models.prepare.canonicalise` (one thread)."""
    from PIL import Image
    from torchvision.io import decode_image

    from models.data import load_holdout_mnist
    from models.data_photos import photo_digits
    from models.prepare import canonicalise

    torch.set_num_threads(1)
    digits, _ = load_holdout_mnist()
    photos = photo_digits(40, families=("paper",))

    def decoded(b: bytes) -> torch.Tensor:
        return decode_image(torch.frombuffer(bytearray(b), dtype=torch.uint8))

    big = np.array(Image.open(io.BytesIO(photos.images[0])).convert("L").resize((3000, 2000)))
    cases = {
        "MNIST digit (served as sent)": [torch.from_numpy(d)[None] for d in digits[:200]],
        "28×28 digit, 3 px off centre": [
            torch.from_numpy(np.roll(d, 3, 1))[None] for d in digits[:200]
        ],
        "photo ~100 px (models.data_photos)": [
            decoded(b) for b in photos.images if decoded(b).shape[-1] <= 110
        ][:20],
        "photo 300×300 RGB": [
            torch.from_numpy(np.array(Image.open(io.BytesIO(b)).convert("RGB").resize((300, 300))))
            .permute(2, 0, 1)
            .contiguous()
            for b in photos.images[:20]
        ],  # fmt: skip
        "photo 3000×2000 gray": [torch.from_numpy(big)[None]],
    }
    out = []
    for name, images in cases.items():
        for im in images[:3]:
            canonicalise(im)
        reps = max(1, 200 // len(images))
        t0 = time.process_time()
        for _ in range(reps):
            for im in images:
                canonicalise(im)
        out.append((name, (time.process_time() - t0) / (reps * len(images)) * 1e6))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--per-family", type=int, default=200, help="photographed digits per family")
    ap.add_argument("--per-group", type=int, default=500, help="OOD suite images per group")
    ap.add_argument(
        "--model", default=None, help="serve this model (VGE_MODEL_DIR); default: the default"
    )
    ap.add_argument(
        "--section", default="Input pipeline (issue 32)", help="docs/benchmarks.md section"
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="draw of the photographed digits and of the OOD suite (0: the one every model was "
        "read on; 1, 2, ...: fresh draws no choice looked at)",
    )
    ap.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md")
    args = ap.parse_args(argv)

    from models.data import bundled_split, load_bundled_mnist, load_holdout_mnist
    from models.data_ood import ABSTAIN_TARGETS, FAR_GROUPS, ood_suite
    from models.data_ood.suite import DEFERRED_OR_RIGHT_TARGETS, ood_suite_labels
    from models.data_photos import FAMILIES, HANDWRITTEN, photo_digits

    photos = photo_digits(args.per_family, seed=args.seed)
    images, labels = load_bundled_mnist()
    test = bundled_split()["test"]
    hx, hy = load_holdout_mnist()
    suite = ood_suite(args.per_group, seed=args.seed)
    suite_labels = ood_suite_labels(args.per_group, seed=args.seed)
    lines: list[str] = []
    with serve(args.model) as url:
        models = httpx.get(url + "/v1/models", timeout=10).json()["models"][0]
        lines.append(f"Served: `{models['name']}` {models['version']} at its calibrated "
                     f"abstain_k = {models['abstain_k']:.4g}, through a real `vge serve` "
                     f"(CPU), {PER_REQUEST} images per multipart request.\n")  # fmt: skip
        lines += [f"### Digits as people send them (models.data_photos, seed {args.seed})", "",
                  "| family | n | prepare | accepted | accepted answers correct | accuracy (all) |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        fam = np.array(photos.families)
        pooled: dict[str, list[dict]] = {"mnist": [], "none": []}
        for prepare in ("mnist", "none"):
            rows = predict(url, photos.images, prepare)
            for f in FAMILIES:
                m = fam == f
                r = _rates(
                    [row for row, keep in zip(rows, m, strict=True) if keep], photos.labels[m]
                )
                lines.append(f"| {f} | {r['n']} | {prepare} | {r['accepted']:.1%} | "
                             f"{r['accepted_correct']:.2%} | {r['accuracy']:.1%} |")  # fmt: skip
            hand = np.isin(fam, HANDWRITTEN)
            r = _rates(
                [row for row, keep in zip(rows, hand, strict=True) if keep], photos.labels[hand]
            )
            pooled[prepare] = [r]
            lo, hi = _wilson(r["accepted"], r["n"])
            lines.append(f"| **handwritten, pooled** | {r['n']} | {prepare} | **{r['accepted']:.1%}** "
                         f"({lo:.1%}–{hi:.1%}) | **{r['accepted_correct']:.2%}** | {r['accuracy']:.1%} |")  # fmt: skip
        lines += ["", "### In distribution (sent as PNG, default prepare)", "",
                  "| digits | n | accuracy | accepted answers correct | deferral (95 % CI) |",
                  "|---|---|---|---|---|"]  # fmt: skip
        test_rows = predict(url, [_png(im) for im in images[test]])
        hold_rows = predict(url, [_png(im) for im in hx])
        for name, rows, y in (
            ("bundled test split", test_rows, labels[test]),
            ("2,000 held-out", hold_rows, hy),
            ("pooled", test_rows + hold_rows, np.concatenate([labels[test], hy])),
        ):
            r = _rates(rows, y)
            lo, hi = _wilson(r["deferral"], r["n"])
            lines.append(f"| {name} | {r['n']} | {r['accuracy']:.4f} | {r['accepted_correct']:.4f} | "
                         f"{r['deferral']:.2%} ({lo:.2%}–{hi:.2%}) |")  # fmt: skip
        lines += ["", f"### OOD suite (seed {args.seed}, {args.per_group} per group, sent as PNG): abstain rate",
                  "", "| group | target | prepare=none (before) | prepare=mnist (served) | "
                  "deferred or right (served) | no digit found |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        far_rows: list[dict] = []
        for group, imgs in suite.items():
            blobs = [_png(im) for im in imgs]
            before = predict(url, blobs, "none")
            after = predict(url, blobs)
            rate_b = np.mean([r["abstain"] for r in before])
            rate_a = np.mean([r["abstain"] for r in after])
            found = sum(r["input_check"] != "ok" for r in after)
            if group in FAR_GROUPS:
                far_rows += after
            target = ABSTAIN_TARGETS.get(group)
            dor = ""
            if group in suite_labels and suite_labels[group].ndim == 1:
                right = np.array([r["prediction"] for r in after]) == suite_labels[group]
                dor = f"{np.mean(right | np.array([r['abstain'] for r in after])):.1%}"
            if group in DEFERRED_OR_RIGHT_TARGETS:
                target_text = f"≥ {DEFERRED_OR_RIGHT_TARGETS[group]:.0%} deferred or right"
            else:
                target_text = "" if target is None else f"≥ {target:.0%}"
            lines.append(f"| {group} | {target_text} | {rate_b:.1%} | {rate_a:.1%} | {dor} | "
                         f"{found} |")  # fmt: skip
        lines += ["", "### Far OOD pooled against the pooled digits: AUROC of the served scores",
                  "", "| score | as served (no digit = most uncertain) | on images read as digits |",
                  "|---|---|---|"]  # fmt: skip
        names = {"vgmu": "VGMU", "max_prob": "1 − max prob", "tu": "TU", "eu": "EU"}
        for name, (served, read) in _aurocs(test_rows + hold_rows, far_rows).items():
            lines.append(f"| {names[name]} | {served:.4f} | {read:.4f} |")
    lines += ["", "### The reading's CPU per image (models.prepare.canonicalise, 1 thread)", "",
              "| input | µs |", "|---|---|"]  # fmt: skip
    for name, us in reading_cost():
        lines.append(f"| {name} | {us:,.0f} |")
    body = "\n".join(lines) + "\n"
    print(body)
    if args.write:
        from benchmarks.report import write_section

        command = "python -m benchmarks.inputs" + (f" --model {args.model}" if args.model else "")
        command += f" --seed {args.seed}" if args.seed else ""
        command += (
            "" if args.section == ap.get_default("section") else f' --section "{args.section}"'
        )
        write_section(args.section, command + " --write", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
