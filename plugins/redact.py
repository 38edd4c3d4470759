"""redact: replace e-mail addresses and API keys in prompts before they reach the model.

Install::

    [plugins]
    modules = ["plugins/redact.py"]

    [plugins.settings.redact]          # all optional
    replacement = "[REDACTED]"         # what a match becomes
    emails = true                      # redact e-mail addresses
    api_keys = true                    # redact strings that look like API keys / tokens
    patterns = ['\\b\\d{3}-\\d{2}-\\d{4}\\b']   # more regular expressions (Python syntax)
    header = true                      # tell the client how many: X-Redactions: <n>

What is searched: ``prompt`` on /v1/completions (a string or a list of
strings; token ids are left alone) and, on /v1/chat/completions, the
``content`` of every message (a string, or the ``text`` of its text parts).
The model and the model server never see the original; the client's own copy
is untouched. API-key-looking means the common shapes: ``sk-...`` (OpenAI,
Anthropic, kilnproxy), ``ghp_``/``github_pat_`` (GitHub), ``AKIA...`` (AWS),
``xox?-`` (Slack), ``AIza...`` (Google), ``hf_...`` (Hugging Face),
``Bearer <token>``, and JWTs.
"""

from __future__ import annotations

import re

from kilnproxy import hookimpl

NAME = "redact"

EMAIL = r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"
API_KEYS = (
    r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_-]{16,}",
    r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{30,}",
    r"\bgithub_pat_[A-Za-z0-9_]{30,}",
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    r"\bxox[abposr]-[A-Za-z0-9-]{10,}",
    r"\bAIza[0-9A-Za-z_-]{35}",
    r"\bhf_[A-Za-z0-9]{30,}",
    r"\beyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}",
    r"(?<=Bearer )[A-Za-z0-9._~+/-]{15,}[A-Za-z0-9_~+/-]=*",  # not a sentence's final dot
)


def pattern_for(settings) -> re.Pattern:
    """One regular expression for everything the settings ask to redact."""
    parts = []
    if settings.get("emails", True):
        parts.append(EMAIL)
    if settings.get("api_keys", True):
        parts.extend(API_KEYS)
    parts.extend(settings.get("patterns", ()))
    return re.compile("|".join(f"(?:{p})" for p in parts) or r"(?!)")  # re caches the compiled pattern


@hookimpl
def startup(gateway):
    settings = gateway.plugin_settings(NAME)
    patterns = settings.get("patterns", [])
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ValueError("[plugins.settings.redact] patterns must be a list of strings")
    for p in patterns:
        try:
            re.compile(p)
        except re.error as exc:
            raise ValueError(f"[plugins.settings.redact] patterns: {p!r} is not a regular expression: {exc}")
    if not isinstance(settings.get("replacement", ""), str):
        raise ValueError("[plugins.settings.redact] replacement must be a string")


@hookimpl
def rewrite_request(call, body):
    settings = call.settings(NAME)
    pattern = pattern_for(settings)
    replacement = settings.get("replacement", "[REDACTED]")
    count = 0

    def scrub(text):
        nonlocal count
        if not isinstance(text, str):
            return text
        text, n = pattern.subn(replacement, text)
        count += n
        return text

    if call.endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            body["prompt"] = [scrub(p) for p in prompt]
        elif isinstance(prompt, str):
            body["prompt"] = scrub(prompt)
    else:
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and part.get("type") == "text":
                        part["text"] = scrub(part.get("text"))
            else:
                message["content"] = scrub(content)
    call.state[NAME] = count


@hookimpl
def response_headers(call):
    if call.settings(NAME).get("header", False):
        return {"X-Redactions": str(call.state.get(NAME, 0))}
    return None
