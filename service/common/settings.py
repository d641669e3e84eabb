"""All service settings in one place (environment variables prefixed ``VGE_`` or ``vge serve`` flags).

Every value is validated when :class:`Settings` is built, so a bad deployment fails at start-up with
a message that says which setting is wrong and how to fix it, not on the first request.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic.json_schema import JsonDict
from pydantic_settings import BaseSettings, SettingsConfigDict

from models.limits import ABSTAIN_K_MAX, ABSTAIN_K_MIN

_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
#: A directory name under models_root that the V2 repository index may list.
_INDEX_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

# A field's ``json_schema_extra`` for a setting that is no ``vge serve`` flag of its own (derived
# from another flag, or internal); every other field is one (service/cli/serve.py generates them).
NO_FLAG: JsonDict = {"cli": False}


@functools.lru_cache(maxsize=4)
def _parsed_reviewer_keys(text: str) -> dict[str, str]:
    """:func:`parse_reviewer_keys`, once per value (key checks run on every review request)."""
    return parse_reviewer_keys(text)


def parse_reviewer_keys(text: str) -> dict[str, str]:
    """``name:key,name:key`` → {key: name}; an error names the entry by its position and name,
    never its key."""
    out: dict[str, str] = {}
    for n, entry in enumerate((e.strip() for e in text.split(",") if e.strip()), start=1):
        name, sep, key = entry.partition(":")
        name, key = name.strip(), key.strip()
        if not sep or not name or len(name) > 200:
            raise ValueError(
                f"reviewer_keys entry {n} is not 'name:key' (VGE_REVIEWER_KEYS="
                "'alice:<key>,bob:<key>')"
            )
        if len(key) < 8:
            raise ValueError(f"reviewer_keys: the key of {name!r} is shorter than 8 characters")
        if key in out or name in out.values():
            raise ValueError(f"reviewer_keys: {name!r} or its key is given twice")
        out[key] = name
    return out


class Settings(BaseSettings):
    """Service configuration; ``VGE_<NAME>`` environment variables, overridden by CLI flags."""

    # env_ignore_empty: `VGE_MODEL_DIR=` (e.g. from an .env template) means "unset", not the cwd.
    # hide_input_in_errors: a ValidationError's text would otherwise repeat the value given,
    # a database URL's password or an API key included.
    model_config = SettingsConfigDict(
        env_prefix="VGE_",
        extra="forbid",
        validate_default=True,
        env_ignore_empty=True,
        hide_input_in_errors=True,
    )

    # --- network -----------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Interface to bind (0.0.0.0 for all).")
    port: Annotated[int, Field(ge=0, le=65535, description="TCP port (0 picks a free one).")] = 8000
    grpc_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        0,
        description="Port of the KServe V2 gRPC service (every front end serves it); 0: off. "
        "Needs pip install 'vge-serve[grpc]'.",
    )

    # --- model -------------------------------------------------------------------------------
    model_dir: Path | None = Field(
        None,
        description="Directory (or shipped model's name) of the model to serve; default: the "
        "shipped default model. A promote or rollback survives restarts of the same "
        "configuration; a start whose configured model (this, or none = the shipped default) "
        "differs from the previous start's serves what it was told and logs it.",
    )
    models_root: Path = Field(
        Path("var/models"),
        description="Where training jobs write models and where promote looks them up.",
    )
    repository_index_models: str | None = Field(
        None,
        description="Directories under models_root that the anonymous V2 repository index "
        "(POST /v2/repository/index) lists, comma-separated; it always lists the served model "
        "and the shipped ones. Unset: no others (promote still finds every directory).",
    )
    device: str = Field("auto", description="auto (GPU when present), cpu, cuda, cuda:N or mps.")
    model_dir_explicit: bool = Field(
        False,
        description="Serve model_dir at this start even when a promote or rollback under the "
        "same configuration is recorded (environment only: a one-start override; a changed "
        "model_dir needs none).",
        json_schema_extra=NO_FLAG,
    )
    promote_max_accuracy_drop: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        0.01,
        description="Promote gate: a candidate whose accuracy on the gate's digits (bundled "
        "MNIST test split + held-out digits) is more than this below the served model's is "
        "refused (409) unless the request says force.",
    )
    promote_max_accepted_accuracy_drop: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        0.005,
        description="Promote gate: the same for the accuracy of the answers it does not defer, "
        "each model at its own calibrated abstain_k.",
    )
    promote_max_deferral_rise: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        0.02,
        description="Promote gate: a candidate deferring more than this share of the digits "
        "above the served model's deferral rate is refused.",
    )

    # --- batching ----------------------------------------------------------------------------
    max_batch_size: Annotated[int, Field(ge=0, le=4096)] = Field(
        0,
        description="Images per forward pass; 0: auto (256 on a CUDA GPU, else 32). Batches are "
        "only as large as the queue holds: a lone request never waits for more. Compiled (on "
        "CUDA), each power-of-two bucket up to it is compiled at load (9 for 256).",
    )
    max_queue_delay_ms: Annotated[float, Field(ge=0.0, le=10_000.0)] = Field(
        5.0, description="Longest wait to fill a batch, in milliseconds (see batch_wait)."
    )
    batches_in_flight: Annotated[int, Field(ge=1, le=8)] = Field(
        1,
        description="Batches the engine computes at once, each on its own thread; a further batch "
        "starts beside a computing one only when it is full. 1: the next batch fills while one "
        "computes. 2: on the 2-core box, 64-image requests 1.6x faster and single images 5-9 % "
        "slower; on an H100 host single images 9-18 % slower at 256 connections and 64-image "
        "requests 16 % slower to 7 % faster (docs/benchmarks.md).",
    )
    batch_wait: Literal["adaptive", "always"] = Field(
        "adaptive",
        description="adaptive: hold a batch up to max_queue_delay_ms only while a front end is "
        "decoding more requests for it (no added latency at low load, fuller batches under "
        "load); always: Triton-style, always wait up to max_queue_delay_ms for a fuller batch.",
    )
    max_queue_length: Annotated[int, Field(ge=1, le=1_000_000)] = Field(
        512, description="Queued images before requests are answered 503."
    )
    request_timeout_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        10.0, description="Default per-request deadline in seconds (a request's timeout_s wins)."
    )
    abstain_k: Annotated[float | None, Field(ge=ABSTAIN_K_MIN, le=ABSTAIN_K_MAX)] = Field(
        None, description="Default abstain_k; unset: the model card's calibrated value, else 1.0."
    )

    # --- payload limits ----------------------------------------------------------------------
    max_payload_bytes: Annotated[int, Field(ge=1024)] = Field(
        32 * 1024 * 1024, description="Request body limit (32 MiB)."
    )
    max_score_bytes: Annotated[int, Field(ge=1024)] = Field(
        2 * 1024 * 1024,
        description="Body limit of /v1/score (JSON member probabilities; parsing holds a front "
        "end's interpreter, ~0.3 s per 2 MiB).",
    )
    max_image_bytes: Annotated[int, Field(ge=64)] = Field(
        8 * 1024 * 1024, description="Encoded image limit (8 MiB)."
    )
    max_image_pixels: Annotated[int, Field(ge=1)] = Field(
        4096 * 4096, description="Decoded image limit, in pixels (4096 x 4096)."
    )
    max_images: Annotated[int, Field(ge=1)] = Field(64, description="Images per request at most.")
    max_json_bytes: Annotated[int, Field(ge=1024)] = Field(
        2 * 1024 * 1024,
        description="Body limit of a V2 infer request's JSON (the whole body, or its JSON header "
        "with the binary tensor extension): parsing JSON holds a front end's interpreter. "
        "Large tensors go through the binary extension.",
    )
    max_small_body_bytes: Annotated[int, Field(ge=1024)] = Field(
        64 * 1024,
        description="Body limit of every route that takes no images or tensors (model admin, "
        "training jobs, reviews).",
    )
    max_header_bytes: Annotated[int, Field(ge=1024, le=16 * 1024 * 1024)] = Field(
        64 * 1024,
        description="Request line plus headers at most; a longer head is a 431 and the "
        "connection is closed.",
    )
    max_connections: Annotated[int, Field(ge=1, le=1_000_000)] = Field(
        1024,
        description="Open HTTP connections per front end; one more is answered 503 and closed.",
    )
    head_timeout_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        20.0,
        description="A request head (request line and headers) must arrive within this long "
        "(from the connection's opening, or a later request's first byte), else 408.",
    )
    body_min_rate: Annotated[float, Field(ge=0.0)] = Field(
        500.0,
        description="Bytes/s a request body must average once head_timeout_s has passed since "
        "its head (its allowance is head_timeout_s + received / rate seconds), else 408; 0: off.",
    )
    grpc_max_concurrent_streams: Annotated[int, Field(ge=1, le=65536)] = Field(
        100, description="gRPC: concurrent streams (RPCs) per HTTP/2 connection."
    )
    grpc_max_concurrent_rpcs: Annotated[int, Field(ge=1, le=1_000_000)] = Field(
        1024,
        description="gRPC: RPCs a front end serves at once (from their headers on); more are "
        "RESOURCE_EXHAUSTED.",
    )
    grpc_max_connection_idle_s: Annotated[float, Field(gt=0.0)] = Field(
        300.0, description="gRPC: close a connection without RPCs for this long."
    )
    grpc_max_connection_age_s: Annotated[float, Field(gt=0.0)] = Field(
        1800.0,
        description="gRPC: ask a connection to go away after this long (clients reconnect).",
    )
    grpc_max_connection_age_grace_s: Annotated[float, Field(ge=0.0)] = Field(
        30.0, description="gRPC: after the age, RPCs still running get this long, then the "
        "connection is closed.",
    )  # fmt: skip
    grpc_call_timeout_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        60.0,
        description="gRPC: a call's deadline on the server, from its headers to its answer "
        "(receiving the request included), whatever deadline the client set; DEADLINE_EXCEEDED.",
    )

    # --- processes ---------------------------------------------------------------------------
    workers: Annotated[int, Field(ge=0, le=256)] = Field(
        0,
        description="HTTP front-end processes (parse, decode, respond); 0: one per CPU available "
        "to this process but one, which is left to the engine (at least 1). One engine process "
        "per device owns the model and the batcher.",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch.compile the forward pass (fused kernels), and the decision where it is "
        "torch's (on CUDA it is one Triton kernel either way); auto: on for CUDA, off on CPU. "
        "Falls back to eager when compilation fails.",
    )
    engine_start: Literal["spawn", "fork"] = Field(
        "spawn",
        description="How the supervisor starts the engine: spawn (a fresh interpreter, so CUDA "
        "initialises in a clean process) or fork (VGE_DEVICE=cpu only: the engine starts from the "
        "supervisor's imports instead of importing torch again, ~2 s sooner where the supervisor "
        "has them, and shares those pages).",
    )
    shm_mb_per_worker: Annotated[int, Field(ge=1, le=65536)] = Field(
        64, description="Shared-memory arena per front end for request tensors (MiB, sparse)."
    )

    # --- threads -----------------------------------------------------------------------------
    decode_workers: Annotated[int, Field(ge=1, le=256)] = Field(
        4, description="Image decoding threads per front end."
    )
    torch_threads: Annotated[int, Field(ge=0, le=256)] = Field(
        0,
        description="torch intra-op threads for the forward pass; 0: auto (on CPU half the "
        "logical CPUs, leaving the rest to HTTP and decoding; 1 on a GPU).",
    )

    # --- security ----------------------------------------------------------------------------
    api_key: SecretStr | None = Field(
        None, description="Key for training and model-admin endpoints; unset disables them."
    )

    # --- durable state ---------------------------------------------------------------------
    db_url: SecretStr | None = Field(
        None,
        description="One database for the review queue, training-job history and promotion "
        "history: postgresql://user:pass@host/db lets several replicas share them; unset: SQLite "
        "files (jobs_db_url, review_dir/reviews.sqlite3). The URL may hold a password (masked "
        "wherever the server prints or returns the URL).",
    )
    umask: str = Field(
        "0077",
        description="File-mode creation mask of the server and its processes (octal): with "
        "0077 the files and directories it creates (review images, SQLite databases, job "
        "folders and logs, trained models) are its user's alone (0600/0700); 0022 lets other "
        "users read them.",
    )

    replica_name: str | None = Field(
        None,
        description="This replica's name in the shared database (its training jobs and model "
        "history); default: the host name. Give replicas on one host distinct names.",
    )

    # --- human review ------------------------------------------------------------------------
    review_queue: Literal["on", "off"] = Field(
        "off", description="Queue predictions for human review (POST /v1/predict?review=...)."
    )
    review_dir: Path = Field(
        Path("var/reviews"),
        description="Queued images (content-addressed by sha256) and, without db_url, the "
        "queue's SQLite file. Replicas sharing one PostgreSQL queue must share this directory.",
    )
    review_max_items: Annotated[int, Field(ge=1, le=100_000_000)] = Field(
        10_000, description="Pending items at most; a full queue answers review_status queue_full."
    )
    review_max_bytes: Annotated[int, Field(ge=1024)] = Field(
        1024**3,
        description="Bytes of pending items' images at most (1 GiB); a full queue answers "
        "review_status queue_full and writes nothing.",
    )
    review_lease_s: Annotated[float, Field(gt=0.0, le=86_400.0)] = Field(
        300.0, description="How long a claimed item is held for one reviewer."
    )
    review_retention_days: Annotated[float, Field(ge=0.0, le=36_500.0)] = Field(
        90.0, description="Delete reviewed/skipped items (rows and images) this old; 0: keep."
    )
    review_max_claims: Annotated[int, Field(ge=1, le=100_000)] = Field(
        10,
        description="Items one reviewer key holds claimed at once: a personal key, or the shared "
        "reviewer key (and the API key) for all the names its clients give; one more claim is a "
        "409 until one is labelled, skipped or its lease ends.",
    )
    review_max_history: Annotated[int, Field(ge=0, le=10_000)] = Field(
        50,
        description="Earlier labels kept in an item's history (the newest); older ones are "
        "dropped and counted (history_dropped).",
    )
    reviewer_key: SecretStr | None = Field(
        None,
        description="Key for the review API and page (the api_key works too); unset both: off.",
    )
    reviewer_keys: SecretStr | None = Field(
        None,
        description="Personal reviewer keys, 'name:key,name:key': a label or "
        "claim made with one is recorded under its name (reviewer_via 'key'); the shared "
        "reviewer_key records the name the client gives (reviewer_via 'shared_key').",
    )

    # --- training jobs -----------------------------------------------------------------------
    jobs_db_url: str = Field(
        "sqlite:///var/jobs.sqlite3",
        description="sqlite:///path of the job and promotion history (when db_url is unset).",
    )
    jobs_dir: Path = Field(Path("var/jobs"), description="Per-job logs.")
    data_root: Path = Field(Path("var/data"), description="Root for datasets (ImageFolder, cache).")
    max_concurrent_jobs: Annotated[int, Field(ge=1, le=64)] = Field(
        1, description="Training jobs run at once."
    )
    max_queued_jobs: Annotated[int, Field(ge=0, le=1000)] = Field(
        8,
        description="Training jobs that may wait for a free slot (beyond max_concurrent_jobs "
        "running); a submission past it is a 409 naming this limit.",
    )
    job_memory_budget_bytes: Annotated[int, Field(ge=0)] = Field(
        0,
        description="Estimated peak memory one training job may need (parameters, gradients, "
        "Adam state, the best-weights copy and one batch's activations); a job over it is "
        "refused (422, saying by how much). 0: half of the host's memory (or its cgroup limit), "
        "or 80 % of the GPU's for a job that trains on a GPU.",
    )
    job_log_max_bytes: Annotated[int, Field(ge=4096)] = Field(
        16 * 1024 * 1024,
        description="Bytes of one training job's log at most (16 MiB): past half of it the log "
        "is rotated to train.log.1, and older lines are dropped.",
    )
    job_log_retention_days: Annotated[float, Field(ge=0.0, le=36_500.0)] = Field(
        30.0,
        description="Delete a finished training job's log (its folder under jobs_dir) this "
        "long after it ended; the job's record and model stay. 0: keep.",
    )

    # --- lifecycle ---------------------------------------------------------------------------
    drain_s: Annotated[float, Field(ge=0.0, le=3600.0)] = Field(
        5.0,
        description="On SIGTERM: keep answering (readiness false, Connection: close) this long "
        "before closing the listener, so load balancers move traffic away without errors.",
    )
    shutdown_grace_s: Annotated[float, Field(ge=0.0, le=3600.0)] = Field(
        30.0,
        description="After drain_s: stop accepting and finish in-flight work within this long.",
    )
    client_timeout_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        30.0,
        description="A connection that has sent part of a request, or nothing since it opened, "
        "and then no byte for this long gets a 408 and is closed (slow or stalled clients do not "
        "hold a front end's connections and buffers).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        v = v.strip().lower()
        if not _DEVICE_RE.match(v):
            raise ValueError(
                f"device {v!r} is not understood; use auto, cpu, cuda, cuda:N or mps "
                "(VGE_DEVICE / --device)"
            )
        return v

    @field_validator("jobs_db_url")
    @classmethod
    def _check_jobs_db_url(cls, v: str) -> str:
        if not v.startswith("sqlite:///") or len(v) <= len("sqlite:///"):
            from service.common.db import shown_url  # a PostgreSQL URL here holds a password

            raise ValueError(
                f"jobs_db_url {shown_url(v)} is not supported; use sqlite:///relative/path.sqlite3 or "
                "sqlite:////absolute/path.sqlite3 (VGE_JOBS_DB_URL / --jobs-db-url), or set "
                "VGE_DB_URL=postgresql://... for a shared database"
            )
        return v

    @field_validator("db_url")
    @classmethod
    def _check_db_url(cls, v: SecretStr | None) -> SecretStr | None:
        from service.common.db import check_url

        if v is not None:
            check_url(v.get_secret_value(), "db_url (VGE_DB_URL / --db-url)")
        return v

    @field_validator("umask")
    @classmethod
    def _check_umask(cls, v: str) -> str:
        try:
            mask = int(v.strip(), 8)
        except ValueError:
            mask = -1
        if not 0 <= mask <= 0o777:
            raise ValueError(
                f"umask {v!r} is not an octal file-mode mask from 0 to 0777 (VGE_UMASK, e.g. "
                "0077 for private files, 0022 for files others can read)"
            )
        return f"{mask:04o}"

    @field_validator("repository_index_models")
    @classmethod
    def _check_repository_index_models(cls, v: str | None) -> str | None:
        if v is None:
            return None
        names = [n.strip() for n in v.split(",") if n.strip()]
        bad = [n for n in names if not _INDEX_NAME_RE.fullmatch(n)]
        if bad:
            raise ValueError(
                f"repository_index_models: {bad[0][:80]!r} is not a model directory name "
                "(letters, digits, '.', '_', '-'; a directory directly under models_root)"
            )
        return ",".join(names)

    def repository_index_names(self) -> list[str]:
        """``repository_index_models`` as a list of directory names under ``models_root``."""
        return self.repository_index_models.split(",") if self.repository_index_models else []

    def resolved_umask(self) -> int:
        """``umask`` as the number :func:`os.umask` takes."""
        return int(self.umask, 8)

    @field_validator("reviewer_keys")
    @classmethod
    def _check_reviewer_keys(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            parse_reviewer_keys(v.get_secret_value())  # raises naming the bad entry, not its key
        return v

    def reviewer_names(self) -> dict[str, str]:
        """``VGE_REVIEWER_KEYS`` as key → reviewer name (empty when unset)."""
        if self.reviewer_keys is None:
            return {}
        return _parsed_reviewer_keys(self.reviewer_keys.get_secret_value())

    @field_validator("reviewer_key")
    @classmethod
    def _check_reviewer_key(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 8:
            raise ValueError(
                "reviewer_key is shorter than 8 characters; set VGE_REVIEWER_KEY to a longer secret"
            )
        return v

    @field_validator("model_dir")
    @classmethod
    def _check_model_dir(cls, v: Path | None) -> Path | None:
        """A model directory, or the bare name of a shipped model (e.g. lenet5-lle-vgn-mnist)."""
        if v is not None and not v.is_dir():
            from models.zoo import resolve_model_dir, zoo_models

            if resolve_model_dir(v).is_dir():
                return resolve_model_dir(v)
            raise ValueError(
                f"model_dir {str(v)!r} is not a directory nor a shipped model "
                f"({', '.join(zoo_models())}); point VGE_MODEL_DIR / --model-dir at a model "
                "directory (card JSON + safetensors) or leave it unset for the default model"
            )
        return v

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 8:
            raise ValueError(
                "api_key is shorter than 8 characters; set VGE_API_KEY / --api-key to a longer "
                "secret (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )
        return v

    @model_validator(mode="after")
    def _check_limits(self) -> Settings:
        if self.grpc_port and self.grpc_port == self.port:
            raise ValueError(
                f"grpc_port ({self.grpc_port}) is the HTTP port: gRPC needs its own port "
                "(VGE_GRPC_PORT)"
            )
        if self.max_images > self.max_queue_length:
            raise ValueError(
                f"max_images ({self.max_images}) exceeds max_queue_length "
                f"({self.max_queue_length}); a full request could never be queued. Raise "
                "VGE_MAX_QUEUE_LENGTH or lower VGE_MAX_IMAGES"
            )
        if self.engine_start == "fork" and self.device != "cpu":
            raise ValueError(
                f"engine_start=fork needs device=cpu (device is {self.device!r}): CUDA must start "
                "in a clean process. Set VGE_DEVICE=cpu or VGE_ENGINE_START=spawn"
            )
        if self.max_image_bytes > self.max_payload_bytes:
            raise ValueError(
                f"max_image_bytes ({self.max_image_bytes}) exceeds max_payload_bytes "
                f"({self.max_payload_bytes}); lower VGE_MAX_IMAGE_BYTES or raise "
                "VGE_MAX_PAYLOAD_BYTES"
            )
        return self

    @property
    def jobs_database_url(self) -> str:
        """Where job and promotion history live: ``db_url``, else ``jobs_db_url``."""
        return self.db_url.get_secret_value() if self.db_url else self.jobs_db_url

    @property
    def reviews_database_url(self) -> str:
        """Where the review queue lives: ``db_url``, else ``review_dir/reviews.sqlite3``."""
        if self.db_url:
            return self.db_url.get_secret_value()
        return f"sqlite:///{self.review_dir / 'reviews.sqlite3'}"

    def resolved_replica_name(self) -> str:
        """``replica_name``, else this host's name."""
        import socket

        return self.replica_name or socket.gethostname()

    @property
    def review_enabled(self) -> bool:
        return self.review_queue == "on"

    @property
    def max_queue_delay_s(self) -> float:
        """The batcher's maximum wait for more requests, in seconds."""
        return self.max_queue_delay_ms / 1000.0

    def resolved_workers(self) -> int:
        """Front-end processes: ``workers``, else the CPUs this process may run on minus one.

        The engine needs a core of its own (on a CPU its forward pass, on a GPU the Python thread
        that feeds the device). On the 2-core box, with the default model, one front end served
        more than two or three (docs/benchmarks.md, "Front ends per core"). A light model at high
        concurrency gains from more front ends: there, set ``workers``.
        """
        if self.workers:
            return self.workers
        return max(1, _usable_cpus() - 1)

    def resolved_compile(self) -> bool:
        """Whether the engine compiles (``auto``: on CUDA devices only)."""
        if self.compile == "auto":
            return self.resolved_device().startswith("cuda")
        return self.compile == "on"

    def resolved_max_batch_size(self, device: str | None = None) -> int:
        """Images per forward pass: ``max_batch_size``, else 256 on a CUDA GPU and 32 elsewhere
        (``device``: the engine's, where the caller knows it, e.g. a front end from the model's
        description, so that it makes no CUDA call of its own; else :meth:`resolved_device`).

        On a CPU the forward pass costs about the same per image from a batch of 16 up
        (docs/benchmarks.md, "Forward pass on CPU"), and a larger batch only delays its first
        answers. On a GPU a batch costs mostly its fixed part: the compute thread's Python per
        batch (guards, launches, the copy back) and the launches themselves. On an H100 host at
        c=256, batches of 32 spent ~88 µs of the compute thread's CPU per request, and the engine
        process, event loop and compute thread sharing one GIL, was the ceiling (~5,000 req/s).
        """
        if self.max_batch_size:
            return self.max_batch_size
        return 256 if (device or self.resolved_device()).startswith("cuda") else 32

    def resolved_torch_threads(self) -> int:
        """Intra-op threads of the engine: ``torch_threads``, else half the CPUs this process may
        run on (its affinity, as :meth:`resolved_workers` counts them: a container pinned to 4
        of a host's 64 cores gets 2, not 32) on a CPU, 1 on a GPU."""
        if self.torch_threads:
            return self.torch_threads
        if self.resolved_device() == "cpu":
            return max(1, _usable_cpus() // 2)
        # On a GPU the engine's CPU work is concatenations and copies: intra-op threads would only
        # spin on the cores the front ends decode on.
        return 1

    def resolved_device(self) -> str:
        """``auto`` resolved to ``cuda`` when a GPU is present, else ``cpu``."""
        from models.device import resolve_device

        return self.device if self.device != "auto" else str(resolve_device())


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; the machine's count where there is none)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
