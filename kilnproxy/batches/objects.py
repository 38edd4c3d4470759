"""The Batch API's objects as clients read them (OpenAI's), its errors, and its list pages.

Every ``*_at`` is integer Unix seconds or null. ``request_counts`` is always an object.
"""

from __future__ import annotations

from typing import Any, Mapping

import orjson

from ..errors import GatewayError, bad_request

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
WINDOWS = {"24h": 24 * 3600}  # completion_window -> seconds
TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
         "cancelled_at")
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def file_object(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": int(row["bytes"]), "created_at": int(row["created_at"]),
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "expires_at": None, "status_details": None}


def batch_object(row: Mapping[str, Any]) -> dict[str, Any]:
    out = {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"], "errors": _json(row["errors"]),
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        "created_at": int(row["created_at"]), "expires_at": int(row["expires_at"]),
    }
    for name in TIMES:
        out[name] = None if row[name] is None else int(row[name])
    out["request_counts"] = {"total": int(row["total"]), "completed": int(row["completed"]),
                             "failed": int(row["failed"])}
    out["metadata"] = _json(row["metadata"])
    return out


def _json(text: str | None) -> Any:
    return None if text is None else orjson.loads(text)


def list_page(objects: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """``objects`` read with ``limit + 1`` rows: the extra one says ``has_more``."""
    data = objects[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(objects) > limit}


def page_query(query: Mapping[str, str], default: int, most: int) -> tuple[int, str | None]:
    """``limit`` (1 to ``most``, else 400) and ``after`` of a list's query string."""
    raw = query.get("limit")
    if raw is None:
        limit = default
    else:
        try:
            limit = int(raw)
        except ValueError:
            raise bad_request(f"`limit` must be an integer from 1 to {most}.", param="limit") from None
        if not 1 <= limit <= most:
            raise bad_request(f"`limit` must be an integer from 1 to {most}, not {limit}.", param="limit")
    return limit, query.get("after") or None


def file_not_found(file_id: str) -> GatewayError:
    return GatewayError(404, "file_not_found", f"No file `{file_id}` for this organization.", param="file_id")


def batch_not_found(batch_id: str) -> GatewayError:
    return GatewayError(404, "batch_not_found", f"No batch `{batch_id}` for this organization.",
                        param="batch_id")


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """null, or an object of at most 16 string values (keys up to 64 characters, values up to 512)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS or not all(
            isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE
            for k, v in metadata.items()):
        raise bad_request(f"`metadata` must be null or an object of at most {MAX_METADATA_KEYS} strings "
                          f"(keys up to {MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE}).",
                          param="metadata")
    return metadata
