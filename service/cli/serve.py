"""``vge serve``: start the HTTP service. Flags override ``VGE_*`` environment variables."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

if TYPE_CHECKING:
    from service.common.settings import Settings

_FLAGS: list[tuple[str, type, str]] = [
    ("host", str, "interface to bind (VGE_HOST; default 127.0.0.1)"),
    ("port", int, "TCP port (VGE_PORT; default 8000)"),
    ("grpc_port", int, "KServe V2 gRPC port, 0 = off (VGE_GRPC_PORT; needs vge-serve[grpc])"),
    (
        "model_dir",
        Path,
        "model directory to serve; as a flag it wins over the model history (the last promoted "
        "or rolled-back model, restored at every start). VGE_MODEL_DIR is the model of the "
        "first start only (default: shipped model)",
    ),
    ("models_root", Path, "where trained models land / promote looks (VGE_MODELS_ROOT)"),
    (
        "promote_max_accuracy_drop",
        float,
        "promote gate: refuse a candidate this much less accurate than the served model on the "
        "gate's digits (VGE_PROMOTE_MAX_ACCURACY_DROP; 0.01)",
    ),
    (
        "promote_max_accepted_accuracy_drop",
        float,
        "promote gate: the same for the answers not deferred, each model at its calibrated "
        "abstain_k (VGE_PROMOTE_MAX_ACCEPTED_ACCURACY_DROP; 0.005)",
    ),
    (
        "promote_max_deferral_rise",
        float,
        "promote gate: refuse a candidate deferring this much more (VGE_PROMOTE_MAX_DEFERRAL_RISE;"
        " 0.02)",
    ),
    ("device", str, "auto, cpu, cuda, cuda:N, mps (VGE_DEVICE; default auto)"),
    ("workers", int, "HTTP front-end processes, 0 = one per CPU but one (VGE_WORKERS; default 0)"),
    ("compile", str, "auto, on, off: torch.compile the engine (VGE_COMPILE; auto = on CUDA)"),
    ("shm_mb_per_worker", int, "shared-memory arena per front end, MiB (VGE_SHM_MB_PER_WORKER)"),
    (
        "max_batch_size",
        int,
        "images per forward pass, 0 = 32 on CPU, 256 on GPU (VGE_MAX_BATCH_SIZE)",
    ),
    ("batches_in_flight", int, "batches computed at once (VGE_BATCHES_IN_FLIGHT; default 1)"),
    ("max_queue_delay_ms", float, "max wait to fill a batch (VGE_MAX_QUEUE_DELAY_MS; default 5)"),
    ("batch_wait", str, "adaptive or always (VGE_BATCH_WAIT; default adaptive)"),
    ("max_queue_length", int, "queued images before 503 (VGE_MAX_QUEUE_LENGTH; default 512)"),
    ("request_timeout_s", float, "default per-request deadline (VGE_REQUEST_TIMEOUT_S; 10)"),
    ("abstain_k", float, "default abstain_k (VGE_ABSTAIN_K; default: model's calibrated)"),
    ("api_key", str, "key for training/admin endpoints (VGE_API_KEY; prefer the env var)"),
    ("max_payload_bytes", int, "request body limit (VGE_MAX_PAYLOAD_BYTES)"),
    ("max_score_bytes", int, "/v1/score body limit (VGE_MAX_SCORE_BYTES)"),
    ("max_image_bytes", int, "encoded image limit (VGE_MAX_IMAGE_BYTES)"),
    ("max_image_pixels", int, "decoded image pixel limit (VGE_MAX_IMAGE_PIXELS)"),
    ("max_images", int, "images per request (VGE_MAX_IMAGES; default 64)"),
    ("decode_workers", int, "image decoding threads (VGE_DECODE_WORKERS; default 4)"),
    ("torch_threads", int, "torch intra-op threads, 0 = default (VGE_TORCH_THREADS)"),
    ("db_url", str, "shared database postgresql://... for reviews, jobs, promotions (VGE_DB_URL)"),
    ("review_queue", str, "on/off: queue predictions for human review (VGE_REVIEW_QUEUE; off)"),
    ("review_dir", Path, "queued images and the queue's SQLite file (VGE_REVIEW_DIR)"),
    ("review_max_items", int, "pending review items at most (VGE_REVIEW_MAX_ITEMS; 10000)"),
    ("review_max_bytes", int, "pending review images' bytes at most (VGE_REVIEW_MAX_BYTES; 1 GiB)"),
    ("review_retention_days", float, "delete closed reviews this old (VGE_REVIEW_RETENTION_DAYS)"),
    ("jobs_db_url", str, "job store, sqlite:///path (VGE_JOBS_DB_URL)"),
    ("jobs_dir", Path, "job logs (VGE_JOBS_DIR)"),
    ("data_root", Path, "dataset root for training jobs (VGE_DATA_ROOT)"),
    ("max_concurrent_jobs", int, "training jobs run at once (VGE_MAX_CONCURRENT_JOBS; 1)"),
    ("drain_s", float, "on SIGTERM, keep answering this long, not ready (VGE_DRAIN_S; 5)"),
    ("shutdown_grace_s", float, "then finish in-flight work within (VGE_SHUTDOWN_GRACE_S; 30)"),
    ("log_level", str, "debug, info, warning, error (VGE_LOG_LEVEL)"),
]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``vge serve`` to the ``vge`` command's subparsers."""
    p = subparsers.add_parser(
        "serve",
        help="start the HTTP prediction service",
        description="Serve a VGE model over HTTP: N front-end processes (FastAPI on uvicorn) and "
        "one engine process that batches across them and runs the model. "
        "Every flag also reads from the VGE_<NAME> environment variable; flags win.",
    )
    for name, typ, help_text in _FLAGS:
        # `--review-queue` alone means on (the spelling); `--review-queue off` also works.
        extra: dict[str, Any] = {"nargs": "?", "const": "on"} if name == "review_queue" else {}
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=typ, default=None,
                       help=help_text, **extra)  # fmt: skip
    p.set_defaults(func=run, handler=run)
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    """``VGE_*`` environment variables, overridden by the flags given (raises ValidationError)."""
    from service.common.settings import Settings

    overrides = {n: getattr(args, n) for n, _, _ in _FLAGS if getattr(args, n, None) is not None}
    if "model_dir" in overrides:
        # Chosen on the command line for this start: it wins over the model history, where
        # VGE_MODEL_DIR (a deployment's standing configuration) names only the first start's model.
        overrides["model_dir_explicit"] = True
    return Settings(**overrides)


def run(args: argparse.Namespace) -> int:
    """Build settings (env + flags), then serve until SIGTERM."""
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or 'settings'}: "
            f"{err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        )
        print(f"vge serve: error: invalid settings: {problems}", file=sys.stderr)
        return 2
    if settings.model_dir is None:
        from models.zoo import resolve_model_dir

        if not resolve_model_dir(None).is_dir():
            print(
                f"vge serve: error: the shipped default model is missing at {resolve_model_dir(None)};"
                " pass --model-dir (or VGE_MODEL_DIR)",
                file=sys.stderr,
            )
            return 2
    from service.supervisor import run as serve

    return serve(settings)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m service.cli.serve``)."""
    parser = argparse.ArgumentParser(prog="vge")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(argv if argv is not None else sys.argv[1:])])
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
