"""``multipart/form-data`` request bodies → files and text fields, in memory.

python-multipart's parser (what Starlette's ``request.form()`` uses) over a body that is already
complete and capped (:class:`service.frontend.middleware.ServingMiddleware`, ``VGE_MAX_PAYLOAD_BYTES``).
Starlette's form API spools every file into a ``SpooledTemporaryFile`` behind an ``UploadFile``
(built for uploads that may not fit in memory) and reads it back through ``await file.read()``;
the images of a scoring request are small and go straight to the decoder, so here each part is
collected as ``bytes``. On the 2-core box the one-image request of the serving benchmark cost a
FastAPI app 199–217 µs of CPU with ``request.form()`` and 160 µs with this (wrk, 64 connections;
docs/benchmarks.md, "Reading the 2-core numbers").

Every malformed body is a :class:`service.common.errors.BadInput` (400) naming the problem; more files
than ``max_files`` is a 413 (too many images); a file under another name than the one asked for
is a 422. Every part counts against ``max_parts`` (files plus fields plus a few empty ones by default), empty ones too,
and the parser stops at the first part past it (413): a browser's empty file input is skipped,
not stored, and 422,535 of them in a 30 MB body were parsed whole (5 s on the event loop).

Bodies over :data:`INLINE_PARSE_BYTES` are parsed in a worker thread (:func:`parse_form_async`):
python-multipart is Python, so the event loop gets the interpreter back every switch interval.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

from service.common.errors import BadInput, InvalidValue, PayloadTooLarge

if TYPE_CHECKING:  # python-multipart declares its callbacks' TypedDict for type checkers only
    from python_multipart.multipart import MultipartCallbacks

#: Parts beyond ``max_files + max_fields`` a body may hold by default: a form's empty file inputs,
#: which are skipped but still parsed.
EMPTY_PARTS = 16
#: Bodies up to this size are parsed on the event loop (a 64-image request of MNIST digits is
#: ~25 KB: no thread hop on the serving path); larger ones in a worker thread.
INLINE_PARSE_BYTES = 64 * 1024


@dataclass(slots=True)
class Form:
    """A parsed body: ``files`` (``(filename, bytes)`` in order) and text ``fields``."""

    files: list[tuple[str, bytes]] = field(default_factory=list)
    fields: dict[str, str] = field(default_factory=dict)


class _Collector:
    """python-multipart callbacks that gather each part's headers and bytes."""

    def __init__(
        self, form: Form, max_files: int, max_fields: int, file_field: bytes | None,
        max_parts: int,
    ) -> None:  # fmt: skip
        self.form = form
        self.file_field = file_field
        self.max_files = max_files
        self.max_fields = max_fields
        self.max_parts = max_parts
        self._parts = 0  # every part, empty or not
        self._header_name = b""
        self._header_value: list[bytes] = []
        self._disposition = b""
        self._chunks: list[bytes] = []
        self._field_parts = 0  # every text part, repeated names included

    def on_part_begin(self) -> None:
        self._parts += 1
        if self._parts > self.max_parts:  # raised through the parser: it stops here
            raise PayloadTooLarge(
                f"too many multipart parts: more than {self.max_parts} in one request "
                f"({self.max_files} files (VGE_MAX_IMAGES) and {self.max_fields} fields at most, "
                "empty parts included)"
            )
        self._disposition = b""
        self._chunks = []

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value.append(data[start:end])

    def on_header_end(self) -> None:
        name = self._header_name.lower()
        if name == b"content-disposition":  # the only part header read (types are not trusted)
            self._disposition = b"".join(self._header_value)
        self._header_name, self._header_value = b"", []

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        self._chunks.append(data[start:end])

    def on_part_end(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name")
        if name is None:
            raise BadInput('a multipart part has no Content-Disposition "name"')
        data = b"".join(self._chunks)
        # A file: it has a filename (RFC 7578 makes that only a SHOULD; `filename*` is RFC 5987's
        # form; python-multipart's header parser drops it, hence the look at the raw header), or
        # it is the file field (`curl -F 'images=<digit.png'` sends the bytes with neither a
        # filename nor a type; they were refused as "a field that is not valid UTF-8"). Elsewhere
        # a typed part stays a text field (aiohttp sends bytes fields as application/octet-stream).
        filename = options.get(b"filename")
        starred = b"filename*=" in self._disposition.lower()
        if filename == b"" and not data:
            return  # a form's file input left empty: browsers send it as an empty nameless file
        if filename is not None or starred or name == self.file_field:
            if self.file_field is not None and name != self.file_field:
                raise InvalidValue(
                    f"unknown file field {_text(name)!r}: send images as "
                    f"{self.file_field.decode()!r} parts"
                )
            if len(self.form.files) >= self.max_files:
                raise PayloadTooLarge(
                    f"too many images: more than {self.max_files} files in one request "
                    "(VGE_MAX_IMAGES); split the request"
                )
            # The filename only ever appears in messages: undecodable bytes are replaced, not refused.
            self.form.files.append(((filename or b"").decode(errors="replace"), data))
            return
        self._field_parts += 1
        if self._field_parts > self.max_fields:
            raise BadInput(f"too many form fields: more than {self.max_fields}")
        key = _text(name)
        if key in self.form.fields:  # which one was meant? (as a parameter repeated in the query)
            raise InvalidValue(f"{key[:64]} is given more than once in the form: give it once")
        self.form.fields[key] = _text(data)


def _text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise BadInput("a multipart field is not valid UTF-8") from None


async def parse_form_async(
    body: bytes, content_type: str, *, max_files: int, max_fields: int,
    file_field: str | None = None,
) -> Form:  # fmt: skip
    """:func:`parse_form`, in a worker thread when ``body`` is over :data:`INLINE_PARSE_BYTES`
    (never a long parse on the event loop), else inline (no thread hop for small requests)."""
    if len(body) <= INLINE_PARSE_BYTES:
        return parse_form(
            body, content_type, max_files=max_files, max_fields=max_fields, file_field=file_field
        )
    return await asyncio.to_thread(
        parse_form, body, content_type, max_files=max_files, max_fields=max_fields,
        file_field=file_field,
    )  # fmt: skip


def parse_form(
    body: bytes, content_type: str, *, max_files: int, max_fields: int,
    file_field: str | None = None, max_parts: int | None = None,
) -> Form:  # fmt: skip
    """Parse a complete ``multipart/form-data`` ``body`` sent with ``content_type``.

    Parts with a ``filename`` (or ``filename*``, or a Content-Type other than ``text/*``) are
    files, others text fields (a repeated field keeps its last
    value; every text part counts towards ``max_fields``). Raises :class:`BadInput` for a missing
    or over-long boundary, a malformed or truncated body, a part without a name, a text field that
    is not UTF-8, or too many text parts; :class:`PayloadTooLarge` beyond ``max_files`` files;
    :class:`InvalidValue` (422) for a file under another name than ``file_field`` when given (a
    file sent under the wrong name would otherwise be scored without a word).
    :class:`PayloadTooLarge` too past ``max_parts`` parts of any kind (default: ``max_files +
    max_fields +`` :data:`EMPTY_PARTS`), raised at the first part over it.
    """
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadInput("multipart/form-data without a boundary in its Content-Type")
    form = Form()
    c = _Collector(
        form, max_files, max_fields, None if file_field is None else file_field.encode(),
        max_files + max_fields + EMPTY_PARTS if max_parts is None else max_parts,
    )  # fmt: skip
    callbacks: MultipartCallbacks = {
        "on_part_begin": c.on_part_begin,
        "on_part_data": c.on_part_data,
        "on_part_end": c.on_part_end,
        "on_header_field": c.on_header_field,
        "on_header_value": c.on_header_value,
        "on_header_end": c.on_header_end,
    }
    try:
        parser = MultipartParser(boundary, callbacks)  # (refuses long ones)
        parser.write(body)
        parser.finalize()
    except FormParserError as exc:
        raise BadInput(f"malformed multipart body: {str(exc)[:200]}") from None
    if parser.state != MultipartState.END:
        raise BadInput("malformed multipart body: it ends before its closing boundary")
    return form
