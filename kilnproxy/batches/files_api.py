"""``/v1/files``: upload (multipart ``file`` and ``purpose`` = ``batch``), list, get, content, delete.

An upload is written to the store as it arrives, chunk by chunk (never held whole), bounded by
``[batches] max_file_bytes``: over it, 413 ``file_too_large`` and nothing is kept; another purpose,
400 and nothing is kept; other form fields are read and ignored. The lines are not checked here (a
batch checks its input). A file is its org's: another org's key gets 404 ``file_not_found``.
"""

from __future__ import annotations

from aiohttp import web

from ..errors import GatewayError, bad_request
from ..proxy.endpoints.reads import authorized_key, json_response
from ..proxy.tenancy.changes import answer_store_trouble
from ..store.batch_api.files import CHUNK_BYTES
from .objects import file_not_found, file_object, list_page, page_query
from .service import BATCHES

MAX_FIELD_BYTES = 1024  # a form field other than ``file`` (``purpose``), read at most this long
FORM_ROOM = 64 * 1024  # a Content-Length this far over max_file_bytes may still hold a file within it


def too_large(max_bytes: int) -> GatewayError:
    return GatewayError(413, "file_too_large",
                        f"The file is larger than {max_bytes} bytes ([batches] max_file_bytes).", param="file")


async def upload(request: web.Request) -> web.Response:
    key = authorized_key(request)
    svc = request.app[BATCHES]
    max_bytes = svc.config.batches.max_file_bytes
    if request.content_length is not None and request.content_length > max_bytes + FORM_ROOM:
        raise too_large(max_bytes)
    if not request.content_type.startswith("multipart/form-data"):
        raise bad_request("Upload a file as multipart/form-data with the fields `file` and `purpose`.")
    try:
        reader = await request.multipart()
    except (ValueError, AssertionError) as exc:
        raise bad_request(f"The multipart body cannot be read: {exc}") from None
    purpose, stored = None, None
    try:
        while (part := await reader.next()) is not None:
            if part.name == "file" and stored is None:
                _check_purpose(purpose)
                stored = await _store(svc, key.org, part, max_bytes)
            elif part.name == "purpose":
                purpose = (await part.read_chunk(MAX_FIELD_BYTES)).decode("utf-8", "replace")
                _check_purpose(purpose)
            else:
                await part.release()  # another form field: ignored
        if stored is None:
            raise bad_request("The upload has no `file` field.", param="file")
        if purpose is None:
            raise bad_request("The upload has no `purpose` field; give purpose=batch.", param="purpose")
        _check_purpose(purpose)
    except BaseException:
        if stored is not None:
            with answer_store_trouble():
                await svc.files.discard(stored[0])
        raise
    file_id, size = stored
    with answer_store_trouble():
        await svc.files.finish(file_id, size)
        return json_response(file_object(await svc.files.get(key.org, file_id)))


def _check_purpose(purpose: str | None) -> None:
    if purpose is not None and purpose != "batch":
        raise bad_request(f"`purpose` must be \"batch\", not {purpose[:40]!r}: the gateway keeps files for "
                          "the Batch API only.", param="purpose")


async def _store(svc, org: str, part, max_bytes: int) -> tuple[str, int]:
    """The part's bytes written to a new file as they arrive; its id and size (413 past ``max_bytes``,
    the file discarded)."""
    with answer_store_trouble():
        file_id = await svc.files.begin(org, "batch", part.filename or "upload.jsonl")
    try:
        size = seq = 0
        buffer = bytearray()
        while chunk := await part.read_chunk(CHUNK_BYTES):
            size += len(chunk)
            if size > max_bytes:
                raise too_large(max_bytes)
            buffer += chunk
            while len(buffer) >= CHUNK_BYTES:  # every chunk stored but the last is CHUNK_BYTES
                with answer_store_trouble():
                    await svc.files.append(file_id, seq, bytes(buffer[:CHUNK_BYTES]))
                del buffer[:CHUNK_BYTES]
                seq += 1
        if buffer:
            with answer_store_trouble():
                await svc.files.append(file_id, seq, bytes(buffer))
    except BaseException:
        with answer_store_trouble():
            await svc.files.discard(file_id)
        raise
    return file_id, size


async def list_files(request: web.Request) -> web.Response:
    key = authorized_key(request)
    limit, after = page_query(request.query, 10_000, 10_000)
    with answer_store_trouble():
        rows = await request.app[BATCHES].files.list(key.org, limit + 1, after)
    return json_response(list_page([file_object(r) for r in rows], limit))


async def _own_file(request: web.Request) -> tuple[dict, str]:
    key = authorized_key(request)
    file_id = request.match_info["file_id"]
    with answer_store_trouble():
        row = await request.app[BATCHES].files.get(key.org, file_id)
    if row is None:
        raise file_not_found(file_id)
    return row, key.org


async def get_file(request: web.Request) -> web.Response:
    row, _ = await _own_file(request)
    return json_response(file_object(row))


async def file_content(request: web.Request) -> web.StreamResponse:
    """The file's bytes, streamed chunk by chunk from the store."""
    row, _ = await _own_file(request)
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                       "Content-Length": str(row["bytes"])})
    await resp.prepare(request)
    async for chunk in request.app[BATCHES].files.chunks(row["id"]):
        await resp.write(chunk)
    await resp.write_eof()
    return resp


async def delete_file(request: web.Request) -> web.Response:
    key = authorized_key(request)
    file_id = request.match_info["file_id"]
    with answer_store_trouble():
        deleted = await request.app[BATCHES].files.delete(key.org, file_id)
    if not deleted:
        raise file_not_found(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})


def add_routes(app: web.Application, expect_handler) -> None:
    app.router.add_post("/v1/files", upload, expect_handler=expect_handler)
    app.router.add_get("/v1/files", list_files, expect_handler=expect_handler)
    app.router.add_get("/v1/files/{file_id}", get_file, expect_handler=expect_handler)
    app.router.add_get("/v1/files/{file_id}/content", file_content, expect_handler=expect_handler)
    app.router.add_delete("/v1/files/{file_id}", delete_file, expect_handler=expect_handler)
