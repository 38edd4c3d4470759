"""What the mock upstream generates: the words of a completion and the JSON shapes they travel in
(vLLM's, and llama.cpp's and Ollama's quirks), for ``kilnproxy.mock_servers.mock_upstream``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from .mock_common import VOCAB


def count_tokens(body: dict) -> int:
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return sum(len(p) if isinstance(p, list) else (1 if isinstance(p, int) else len(str(p).split()))
                   for p in prompt)
    if "messages" in body:
        total = 0
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            total += 4 + (len(content.split()) if isinstance(content, str) else 0)
        return total
    return len(str(prompt).split())


class Generation:
    """The words of one completion and the JSON shapes they travel in."""

    def __init__(self, body: dict, opts: dict, chat: bool, prompt_tokens: int, max_tokens: int, n: int = 1):
        self.body = body
        self.n = n
        self.opts = opts
        self.chat = chat
        self.flavor = opts["flavor"]
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.id = opts.get("id") or ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = opts.get("created") or int(time.time())
        self.model = body.get("model", "mock")
        self.words = [VOCAB[i % len(VOCAB)] for i in range(max_tokens)]
        if opts.get("cut_emoji"):  # the answer stops between the two halves of U+1F600
            self.words[-1] = "\ud83d"
        options = body.get("stream_options") or {}
        self.include_usage = bool(options.get("include_usage"))
        # an integer beyond 64 bits on every chunk and answer (given as a string: orjson reads one as a float)
        self.extra = {"big_integer": int(opts["big_integer"])} if opts.get("big_integer") else {}

    def usage(self, completion_tokens: int) -> dict:
        if self.opts.get("usage_tokens"):  # given as a string, as big_integer is
            count = int(self.opts["usage_tokens"])
            return {"prompt_tokens": count, "total_tokens": count, "completion_tokens": count}
        usage = {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + completion_tokens,
                 "completion_tokens": completion_tokens}
        cached = self.opts.get("cached_tokens")
        if cached is not None or self.opts.get("prompt_tokens_details"):
            usage["prompt_tokens_details"] = {"cached_tokens": int(cached or 0)}
        return usage

    def finish_reason(self) -> str:
        return "length"

    def words_of(self, index: int) -> list[str]:
        """The words of choice ``index``: one fewer for each later choice, so that their counts differ."""
        return self.words[:max(1, len(self.words) - index)]

    def whole(self) -> dict:
        choices = []
        for index in range(self.n):
            text = " " + " ".join(self.words_of(index))
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text.strip()},
                                "logprobs": None, "finish_reason": self.finish_reason(), "stop_reason": None})
            else:
                choices.append({"index": index, "text": text, "logprobs": None,
                                "finish_reason": self.finish_reason(), "stop_reason": None})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage(len(self.words)), **self.extra}

    def chunk(self, choices: list, **extra: Any) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.flavor == "vllm_old":
            out["usage"] = None
        if self.flavor == "ollama" and not self.chat:
            out["usage"] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        out.update(extra)
        out.update(self.extra)
        return out

    def choice(self, text: str | None, finish: str | None, first: bool = False, index: int = 0) -> dict:
        if self.chat:
            delta = {"content": text} if text is not None else {}
            if first:
                delta = {"role": "assistant", "content": None if self.flavor == "llamacpp" else ""}
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}

    def frames(self) -> list[dict]:
        """Every chunk of the stream but [DONE], in order."""
        if self.n > 1:
            return self.llama_choice_frames()
        out = []
        if self.chat:
            out.append(self.chunk([self.choice(None, None, first=True)]))
        n = len(self.words)
        for i, word in enumerate(self.words):
            text = " " + word
            if i == 0 and self.opts.get("echo") and not self.chat:
                text = str(self.body.get("prompt", "")) + text
            last = i == n - 1
            extra = {}
            if self.opts.get("continuous_usage"):
                extra["usage"] = self.usage(i + 1)
            if i == 0 and self.opts.get("pad_bytes"):
                extra["padding"] = "x" * int(self.opts["pad_bytes"])
            finish = None
            if last and self.flavor in ("llamacpp", "ollama") or (last and self.chat):
                finish = self.finish_reason()
            if last and self.flavor == "llamacpp" and not self.chat:
                extra["usage"] = self.usage(n)
                extra["timings"] = {"prompt_n": self.prompt_tokens, "predicted_n": n}
            out.append(self.chunk([self.choice(text, finish)], **extra))
        if self.flavor not in ("llamacpp", "ollama") and not self.chat:
            out.append(self.chunk([self.choice("", self.finish_reason())]))
        if self.include_usage and not (self.flavor == "llamacpp" and not self.chat):
            out.append(self.chunk([], usage=self.usage(n)))
        return out


    def llama_choice_frames(self) -> list[dict]:
        """llama.cpp with ``n`` > 1: the choices' chunks interleaved, each choice ending with its own usage."""
        per_choice = []
        for index in range(self.n):
            words = self.words_of(index)
            frames = [self.chunk([self.choice(None, None, first=True, index=index)])] if self.chat else []
            frames += [self.chunk([self.choice(" " + word, None, index=index)]) for word in words]
            last = self.chunk([self.choice(None if self.chat else "", self.finish_reason(), index=index)])
            if not self.chat:
                last["usage"] = self.usage(len(words))
            frames.append(last)
            if self.chat and self.include_usage:
                frames.append(self.chunk([], usage=self.usage(len(words))))
            per_choice.append(frames)
        out = []
        for step in range(max(map(len, per_choice))):
            out += [frames[step] for frames in per_choice if step < len(frames)]
        return out
