"""A line's outcome as its output or error file has it, and those files written from the store.

The output file has one line per line answered 2xx, ``{"id": "batch_req_…", "custom_id", "response":
{"status_code", "request_id": <generation id>, "body"}, "error": null}``; the error file the same for
every other final answer, and ``"response": null`` with an ``error`` for a line that got none
(``batch_expired``), or ``batch_answer_lost`` for a line whose answer was charged while its
gateway was stopped before the runner kept it. Lines are in the order of the input.
"""

from __future__ import annotations

import os
from typing import Any, AsyncIterator

import orjson


def request_id() -> str:
    return f"batch_req_{os.urandom(12).hex()}"


def answered(custom_id: str, status: int, generation_id: str, body: Any) -> str:
    return orjson.dumps({"id": request_id(), "custom_id": custom_id,
                         "response": {"status_code": status, "request_id": generation_id, "body": body},
                         "error": None}).decode()


def lost(custom_id: str, status: int, generation_id: str) -> str:
    return orjson.dumps({
        "id": request_id(), "custom_id": custom_id,
        "response": {"status_code": status, "request_id": generation_id, "body": None},
        "error": {"code": "batch_answer_lost",
                  "message": f"The gateway stopped after this line was answered (usage row {generation_id}) and "
                             "before its answer was kept."}}).decode()


def expired(custom_id: str) -> str:
    return orjson.dumps({"id": request_id(), "custom_id": custom_id, "response": None,
                         "error": {"code": "batch_expired",
                                   "message": "This line was not run before the batch expired."}}).decode()


async def file_lines(lines: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The file's bytes, line by line, from the store's ended lines (an expired one's made here)."""
    async for row in lines:
        text = row["result"] if row["state"] == "done" else expired(row["custom_id"])
        yield text.encode() + b"\n"


async def write_files(svc, batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's output and error files, written and not complete yet (``BatchStore.conclude`` completes
    them with the batch's status); ``{"output_file_id", "error_file_id"}`` (None: no such line), and the
    files' ``(id, size)`` as ``files``."""
    out: dict[str, Any] = {"output_file_id": None, "error_file_id": None, "files": []}
    batch_id = batch["id"]
    for ok, column, name in ((True, "output_file_id", "output"), (False, "error_file_id", "error")):
        if not await svc.lines.counted(batch_id, ok):
            continue
        file_id, size = await svc.files.write(batch["org"], "batch_output", f"{batch_id}_{name}.jsonl",
                                              file_lines(svc.lines.ended(batch_id, ok)))
        out[column] = file_id
        out["files"].append((file_id, size))
    return out
