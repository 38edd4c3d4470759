"""A batch's input checked, line by line, before any line runs (SPEC 14).

Each line must be a JSON object ``{"custom_id", "method": "POST", "url", "body"}``: ``custom_id`` a
string unique in the file, ``url`` the batch's endpoint, ``body`` an object. The file is read chunk by
chunk from the store and its good lines stored as they are read (``LineStore.insert``, a page at a
time); duplicates are found by the store afterwards. Each bad line is one entry of ``errors.data``
(its first problem; ``line`` counted from 1), up to ``MAX_ERRORS``, then one entry saying how many
more. Blank lines are skipped (they still count in the numbering).
"""

from __future__ import annotations

from typing import Any

import orjson

MAX_ERRORS = 1000
PAGE = 500


def error(code: str, message: str, line: int | None, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def line_problem(raw: bytes, n: int, endpoint: str) -> tuple[dict | None, dict | None]:
    """The line's request (``custom_id``, ``body``), or its error."""
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, error("invalid_json_line", "This line is not valid JSON.", n)
    if not isinstance(item, dict):
        return None, error("invalid_request", "This line is not a JSON object.", n)
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, error("invalid_custom_id", "`custom_id` must be a string that no other line has.", n,
                           "custom_id")
    if item.get("method") != "POST":
        return None, error("invalid_method", "`method` must be \"POST\".", n, "method")
    if item.get("url") != endpoint:
        return None, error("invalid_url", f"`url` must be the batch's endpoint, {endpoint}.", n, "url")
    if not isinstance(item.get("body"), dict):
        return None, error("invalid_body", "`body` must be a JSON object.", n, "body")
    return item, None


async def check_input(svc, batch: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """Read and check the batch's input, storing its lines; (the number of lines, the errors)."""
    batch_id, endpoint = batch["id"], batch["endpoint"]
    await svc.lines.clear(batch_id)
    if await svc.files.get(batch["org"], batch["input_file_id"]) is None:
        return 0, [error("file_not_found", f"The input file {batch['input_file_id']} no longer exists.", None,
                         "input_file_id")]
    errors: list[dict[str, Any]] = []
    bad = n = good = 0
    page: list[tuple[int, str, str]] = []
    async for raw in svc.files.lines(batch["input_file_id"]):
        n += 1
        if not raw.strip():
            continue
        item, problem = line_problem(raw, n, endpoint)
        if problem is not None:
            bad += 1
            if len(errors) < MAX_ERRORS:
                errors.append(problem)
            continue
        good += 1
        if not bad:  # once a line is bad no line will run: the rest are only checked
            page.append((n, item["custom_id"], orjson.dumps(item["body"]).decode()))
            if len(page) >= PAGE:
                await svc.lines.insert(batch_id, page)
                page = []
    if page and not bad:
        await svc.lines.insert(batch_id, page)
    if not bad:
        for dup in await svc.lines.duplicates(batch_id, MAX_ERRORS):
            bad += 1
            errors.append(error("duplicate_custom_id", f"`custom_id` {dup['custom_id'][:100]!r} is on an earlier "
                                "line too.", dup["line"], "custom_id"))
    if good + bad == 0:
        errors.append(error("empty_file", "The input file has no lines.", None, "input_file_id"))
    if len(errors) < bad:
        errors.append(error("too_many_errors", f"{bad - len(errors)} more lines are bad.", None))
    if errors:
        await svc.lines.clear(batch_id)
    return good, errors
