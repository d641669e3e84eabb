"""The training process's own code: what runs inside the process a training job is spawned in.

:class:`service.engine.jobs.JobManager` starts one process per job (``multiprocessing`` spawn
context) with :func:`child_main` as its target; spawn pickles the target by reference, so the
child imports this module, and only what it imports, not the engine's scheduling and storage.
The child lowers its CPU priority (training yields to serving), exits when the server process
dies, writes its output to the job's capped log (:class:`service.common.job_logs.CappedLog`),
and runs :func:`models.training.train`, sending each progress event, then a final ``_result`` or
``_error`` message, back on the ``events`` queue. The parent sets ``stop`` to cancel: training
checks it between steps (``should_stop``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from service.common.job_logs import CappedLog

__all__ = ["child_main"]


def child_main(
    job_id: str,
    config_json: str,
    out_dir: str,
    log_path: str,
    events: Any,
    stop: Any,
    parent_pid: int,
    log_max_bytes: int = 16 * 1024 * 1024,
) -> None:
    """Entry point of the spawned training process (exits if the server process dies). Its
    output goes to the job's log, capped at ``log_max_bytes`` (:class:`CappedLog`)."""
    with contextlib.suppress(OSError):
        os.nice(10)  # training yields the CPU to serving

    def _watch_parent() -> None:  # never outlive the server (e.g. after SIGKILL)
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=_watch_parent, daemon=True).start()
    log_file = CappedLog(Path(log_path), log_max_bytes)
    sys.stdout = sys.stderr = log_file
    logging.basicConfig(level=logging.INFO, stream=log_file,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    try:
        from models.training import TrainConfig, train

        config = TrainConfig.model_validate_json(config_json)
        print(f"job {job_id}: training {config_json}", flush=True)

        def on_event(event: dict[str, Any]) -> None:
            events.put(json.loads(json.dumps(event, default=str)))
            print(json.dumps(event, default=str), flush=True)

        path = train(config, Path(out_dir), on_event=on_event, should_stop=stop.is_set)
        events.put({"type": "_result", "model_dir": str(path), "stopped": stop.is_set()})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit non-zero
        traceback.print_exc(file=log_file)
        events.put({"type": "_error", "error": f"{type(exc).__name__}: {exc}"})
        log_file.flush()
        raise SystemExit(1) from None
    finally:
        log_file.flush()
