"""The usage chunk a client that asked for ``include_usage`` gets just before ``[DONE]``.

Whatever the upstream sent (vLLM's own ``choices: []`` chunk, llama.cpp's counts
on its last choice chunk, several choices' reports combined, or none at all),
the client sees OpenAI's form: one chunk, ``choices: []``, the catalog model's
name, and ``usage`` with ``cost`` added.
"""

from __future__ import annotations

from ...call import Call
from ...usage import Usage, cap_counts


def usage_chunk(call: Call, usage: Usage, usage_event: dict | None, last_event: dict | None,
                usage_raw: dict | None, raw_counts: Usage | None = None) -> dict:
    """The chunk for the final ``usage``: built on the upstream's own usage chunk (``usage_event``)
    when it sent one, else on the stream's ``last_event``; ``usage_raw`` is the usage object the
    upstream reported last (its other fields, e.g. ``prompt_tokens_details``, are kept), and
    ``raw_counts`` its counts when they were read already (``Usage.from_upstream``)."""
    event = usage_event
    if event is None:
        base = last_event or {}
        event = {k: base[k] for k in ("id", "object", "created") if k in base}
        if "object" not in event:
            event["object"] = "chat.completion.chunk" if call.endpoint == "chat/completions" \
                else "text_completion"
    event["model"] = call.model
    event["choices"] = []
    if usage_raw is not None:
        raw = dict(usage_raw)
        cap_counts(raw)  # as the row records them
    else:
        raw = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
               "total_tokens": usage.total_tokens}
    if usage_raw is not None and usage is not raw_counts \
            and usage != (raw_counts or Usage.from_upstream(usage_raw)):  # combined reports
        raw.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                   total_tokens=usage.total_tokens)
        details = raw.get("prompt_tokens_details")
        if isinstance(details, dict):
            raw["prompt_tokens_details"] = {**details, "cached_tokens": usage.cached_tokens}
    raw["cost"] = usage.cost(call.pricing)
    event["usage"] = raw
    return event
