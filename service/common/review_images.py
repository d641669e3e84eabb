"""The review queue's images as files: their bytes on disk, their type, their names in exports.

Why apart from the queue's table (:mod:`service.common.review_store`): an image is stored once
however often it is queued, and how it is stored and named has nothing to do with SQL.

* :class:`BlobStore`: image bytes on disk, content-addressed by sha256
  (``<review_dir>/blobs/ab/abcdef…``), written atomically; the same image queued twice is stored
  once. Bytes are stored as sent (the queue's byte bound, not this store, limits what they hold).
* :func:`sniff_content_type`: an image's type read from its first bytes (clients' declared types
  are not trusted).
* :func:`class_folder` and :data:`OUTLIER_FOLDER`: the folder an image reviewed as a class, or
  marked *not a digit*, is written to in the review export and a training job's data
  (service.engine.jobs, models.data): never a path of its own, never two classes in one folder.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path

_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"BM", "image/bmp"),
)


def sniff_content_type(data: bytes) -> str:
    """The image type from its first bytes (clients' declared types are not trusted)."""
    for magic, ctype in _MAGIC:
        if data.startswith(magic):
            return ctype
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "application/octet-stream"


#: The export's folder of the images reviewers marked *not a digit* (none of the model's classes):
#: ``outliers/<sha256>.png`` beside the class folders. :func:`class_folder` never returns it: a
#: class literally named ``outliers`` gets ``%6Futliers``.
OUTLIER_FOLDER = "outliers"

#: A class name used as it is for its folder in exports and training data: letters, digits,
#: ``_ . + -``, starting with a letter or digit (never ``.``, ``..``, a ``/`` or a hidden name),
#: at most 100 characters. Model cards' class names are checked elsewhere; this holds whatever
#: a card said.
SAFE_CLASS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}")
#: Bytes kept as they are when a class name is percent-encoded (every other byte is ``%XX``).
_KEEP_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


def class_folder(label: str) -> str:
    """The folder name of class ``label`` in exports and training data: ``label`` itself when it
    matches :data:`SAFE_CLASS_NAME` (the digits' ``"0"``…``"9"``, ``"cat"``), else its UTF-8
    bytes percent-encoded but for letters, digits and ``_`` (``../x`` → ``%2E%2E%2Fx``), or
    ``%sha256-<hex>`` when that is longer than 200 characters. A class named like
    :data:`OUTLIER_FOLDER` gets its first letter encoded (``%6Futliers``): that folder holds the
    images marked *not a digit*.

    Never a path of more than one component, never ``.`` or ``..``, and one-to-one: a safe name
    has no ``%`` and an encoded one always has one, so two classes never share a folder (the
    letters of an encoded name are kept as they are, so only the reserved name starts ``%6F``).
    """
    if label == OUTLIER_FOLDER:
        return f"%{ord(label[0]):02X}{label[1:]}"
    if SAFE_CLASS_NAME.fullmatch(label):
        return label
    encoded = "".join(chr(b) if b in _KEEP_BYTES else f"%{b:02X}" for b in label.encode())
    if len(encoded) <= 200 and "%" in encoded:
        return encoded
    return "%sha256-" + hashlib.sha256(label.encode()).hexdigest()


class BlobStore:
    """Image bytes on disk by sha256, written atomically (temp file + rename), stored once."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, sha: str) -> Path:
        return self.root / sha[:2] / sha

    def put(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self.path(sha)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{sha}.{uuid.uuid4().hex}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return sha

    def ensure(self, data: bytes, sha: str) -> None:
        """Write ``data`` (whose sha256 is ``sha``) again if its file is gone: an enqueue calls it
        after its row is in, so that a retention sweep which deleted the image meanwhile (its
        last reference went with an old item just before the new row appeared) cannot leave a
        queued item without one (:meth:`delete_unless`)."""
        if not self.path(sha).exists():
            self.put(data)

    def get(self, sha: str) -> bytes:
        return self.path(sha).read_bytes()

    def delete(self, sha: str) -> None:
        self.path(sha).unlink(missing_ok=True)

    def delete_unless(self, sha: str, referenced: Callable[[], bool]) -> bool:
        """Delete the image unless ``referenced()`` (asked again once the file is out of the way):
        it is first renamed aside, so an enqueue that checks for it meanwhile (:meth:`ensure`)
        writes it anew, and it is put back if an item refers to it by then. Whether it was
        deleted."""
        path = self.path(sha)
        aside = path.with_name(f".{sha}.{uuid.uuid4().hex}.deleting")
        try:
            os.replace(path, aside)
        except FileNotFoundError:
            return False
        try:
            still = referenced()
        except BaseException:  # the database failed: the file goes back, it may be needed
            _put_back(aside, path)
            raise
        if still:  # an item queued it between the first check and the rename
            _put_back(aside, path)
            return False
        aside.unlink(missing_ok=True)
        return True


def _put_back(aside: Path, path: Path) -> None:
    """Undo :meth:`BlobStore.delete_unless`'s rename: the file back at ``path``, unless an
    enqueue wrote it anew there meanwhile (same bytes: the set-aside copy goes)."""
    if path.exists():
        aside.unlink(missing_ok=True)
    else:
        os.replace(aside, path)
