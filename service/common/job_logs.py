"""A training job's log on disk: size-capped while it is written, read from its end, and rendered
for a person.

Why: a job's process writes every progress event to its log (a line per optimiser step), so a
long run with small batches wrote ~0.7 GB, kept for good, and the logs endpoint read the whole
file to return its last line (+570 MB of the engine's memory per call on a 315 MB log).

* :class:`CappedLog` — the training process's ``stdout``/``stderr`` and logging stream. The log
  is ``train.log``; when it would pass half of ``max_bytes`` it is renamed ``train.log.1``
  (replacing the one before) and a new ``train.log`` starts with a line saying so: the two files
  never hold more than ``max_bytes`` together, and always the newest lines.
* :func:`read_tail` — the last ``lines`` lines of ``train.log`` (continued into ``train.log.1``
  when it has fewer), read backwards in blocks from the end: the memory and time of a call are
  those of the lines it returns, never of the file.
* :func:`render_text` — the same lines for a person (``GET …/logs?format=text``): each JSON
  progress event as one short line (``epoch 2/5  step 88/220  train_loss 0.3121  …``), every
  other line as written.
"""

from __future__ import annotations

import io
import json
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["LOG_NAME", "CappedLog", "log_paths", "read_tail", "render_text"]

#: The current log of a job, in its own folder (``jobs_dir/<job id>/``); the rotated one adds ``.1``.
LOG_NAME = "train.log"
_BLOCK = 64 * 1024


def log_paths(job_dir: Path) -> tuple[Path, Path]:
    """``(current, rotated)`` log files of the job whose folder is ``job_dir``."""
    current = job_dir / LOG_NAME
    return current, current.with_name(LOG_NAME + ".1")


class CappedLog(io.TextIOBase):
    """A text stream over ``path`` whose file and its one rotated predecessor hold at most
    ``max_bytes`` together (thread-safe; line-buffered: every write reaches the file at once)."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        super().__init__()
        self.path = Path(path)
        self.rotated = self.path.with_name(self.path.name + ".1")
        self.half = max(1024, max_bytes // 2)
        self._lock = threading.Lock()
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        self._size = self._file.tell()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False  # progress bars (tqdm) stay off, as for any file

    def write(self, text: str) -> int:
        data = text.encode("utf-8", errors="replace")
        with self._lock:
            if self._file.closed:
                return len(text)
            if len(data) > self.half:  # one write larger than a file: keep its end
                data = b"[...]" + data[-(self.half - 1024) :]
            if self._size + len(data) > self.half:
                self._rotate()
            self._file.write(data)
            self._file.flush()
            self._size += len(data)
        return len(text)

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, self.rotated)
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        note = (
            f"[log rotated at {self.half:,} bytes (VGE_JOB_LOG_MAX_BYTES / 2): earlier lines are "
            f"in {self.rotated.name}, older ones were dropped]\n"
        ).encode()
        self._file.write(note)
        self._size = len(note)

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()
        super().close()


def _tail_of(path: Path, lines: int, max_bytes: int) -> list[bytes]:
    """Up to the last ``lines`` lines of ``path`` (without line ends), reading backwards by
    blocks: at most the bytes of those lines plus one block, and never more than ``max_bytes``
    (a longer line keeps its end, after ``[...]``)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return []
    with f:
        pos = f.seek(0, os.SEEK_END)
        chunks: list[bytes] = []
        newlines = read = 0
        # Stop once the first wanted line's start is in (one line end more than lines wanted).
        while pos > 0 and newlines <= lines and read < max_bytes:
            step = min(_BLOCK, pos, max_bytes - read)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            chunks.append(chunk)
            newlines += chunk.count(b"\n")
            read += len(chunk)
    data = b"".join(reversed(chunks))
    if data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        return []
    parts = data.split(b"\n")
    if pos > 0:  # the first part is a partial line: dropped, or cut at max_bytes
        parts = parts[1:] if len(parts) > lines else [b"[...]" + parts[0], *parts[1:]]
    return parts[-lines:]


def read_tail(job_dir: Path, lines: int, max_bytes: int = 32 * 1024 * 1024) -> str:
    """The last ``lines`` lines of the job's log (its rotated part too when the current one has
    fewer), each ending in a newline; empty when it has none. At most ``max_bytes`` are read
    from each file (a log written before the cap existed can be any size)."""
    current, rotated = log_paths(job_dir)
    out = _tail_of(current, lines, max_bytes)
    if len(out) < lines and rotated.exists():
        out = _tail_of(rotated, lines - len(out), max_bytes) + out
    return "".join(line.decode("utf-8", errors="replace") + "\n" for line in out)


def _number(value: Any, digits: int = 4) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _event_line(event: dict[str, Any]) -> str | None:
    """One progress event (models.training.events) as a short line; None for other JSON."""
    kind = event.get("type")
    if kind == "start":
        return (
            f"start: {event.get('name', '')} on {event.get('device', '?')}, "
            f"{event.get('train_size', '?')} training / {event.get('val_size', '?')} validation "
            f"images, {event.get('total_steps', '?')} steps"
        )
    if kind in ("step", "epoch"):
        parts = [f"epoch {event.get('epoch', '?')}"]
        if event.get("step") is not None:
            parts.append(f"step {event['step']}/{event.get('total_steps', '?')}")
        for key in ("train_loss", "val_loss", "val_accuracy"):
            if event.get(key) is not None:
                parts.append(f"{key} {_number(event[key])}")
        parts.append(f"eta {_duration(event.get('eta_s'))}")
        return "  ".join(parts)
    if kind == "done":
        parts = ["done"]
        for key in ("epoch", "best_epoch", "val_accuracy", "test_accuracy", "test_nll"):
            if event.get(key) is not None:
                parts.append(f"{key} {_number(event[key])}")
        if event.get("cancelled"):
            parts.append("(stopped early)")
        if event.get("path"):
            parts.append(f"model {event['path']}")
        return "  ".join(parts)
    return None


def render_text(raw: str) -> str:
    """``raw`` log lines for a person: progress events (one JSON object per line) as short
    lines, every other line unchanged."""
    out = []
    for line in raw.splitlines():
        text = line
        if line.startswith("{") and line.endswith("}"):
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict) and (rendered := _event_line(event)) is not None:
                text = rendered
        out.append(text + "\n")
    return "".join(out)
