"""Prompts as a vLLM OpenAI server tokenizes them, so the router's page ids are the engine's.

`ModelTokenizer(dir)` loads the model directory's own tokenizer and chat template
(transformers, offline) and renders a request body the way vLLM 0.32's OpenAI server does:

  completions  a string prompt: tokenizer(prompt, add_special_tokens=body's, default true);
               token ids: as given; a batch: its first prompt; truncate_prompt_tokens: the
               last N
  chat         the messages normalised as vLLM does (a string content is one text part; text
               parts are joined with newlines for a template that reads content as a string,
               kept as a list of {"type": "text"} parts for one that loops over it; the
               developer role becomes system for a template that does not know it), then
               tokenizer.apply_chat_template(messages, tools, add_generation_prompt (default
               true), continue_final_message, **chat_template_kwargs, tokenize=True); a
               request's own chat_template wins

A message with an image (or any non-text part) ends what the router tokenizes: it renders
the messages before it without a generation prompt (the engine expands an image into
placeholder tokens only its processor knows; blocks from there on carry the image's hash in
vLLM's extra keys, which the translator never lets a text page match). What cannot be
rendered gives no tokens (the request is routed without affinity, never refused: the
engine decides what is valid). How often this agrees with the engine is measured by the
vLLM group's router test and bench/router/vllm_agreement.py.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from pathlib import Path

TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal")
IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil", "image_embeds")
_CONTENT_LOOP = re.compile(r"{%-?\s*for\s+\w+\s+in\s+(?:\w+\s*\[\s*['\"]content['\"]\s*\]|\w+\.content\b|content\b)")
IMAGE_BYTES_MAX = 64 << 20


class NotRenderable(ValueError):
    """The body is not something the router can tokenize as the engine would."""


class ModelTokenizer:
    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ValueError(f"--tokenizer needs transformers installed ({e})") from None
        p = Path(path)
        if not p.is_dir():
            raise ValueError(f"--tokenizer: {path!r} is not a model directory")
        try:
            self.tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - whatever transformers raises, the flag is wrong
            raise ValueError(f"--tokenizer: cannot load a tokenizer from {path!r}: {e}") from None
        template = self.tok.chat_template
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()), None)
        self.template: str | None = template
        self.content_as_parts = bool(template and _CONTENT_LOOP.search(template))
        self.knows_developer = bool(template and "developer" in template)
        self.path = str(p)

    # ---- bodies ------------------------------------------------------------------------------
    def tokens(self, chat: bool, payload: dict) -> list[int]:
        """The prompt token ids the engine will run; NotRenderable when the router cannot tell."""
        try:
            ids = self._chat(payload) if chat else self._completion(payload)
        except NotRenderable:
            raise
        except Exception as e:  # noqa: BLE001 - a template may raise anything on odd input
            raise NotRenderable(f"{type(e).__name__}: {str(e)[:200]}") from None
        trunc = payload.get("truncate_prompt_tokens")
        if isinstance(trunc, int) and not isinstance(trunc, bool) and 0 < trunc < len(ids):
            ids = ids[-trunc:]
        return ids

    def _completion(self, payload: dict) -> list[int]:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]  # a batch: routed by its first prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [int(t) for t in prompt]
        if not isinstance(prompt, str) or not prompt:
            raise NotRenderable("prompt must be a string or token ids")
        special = payload.get("add_special_tokens", True)
        return list(self.tok(prompt, add_special_tokens=special is not False)["input_ids"])

    def _chat(self, payload: dict) -> list[int]:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            raise NotRenderable("messages must be a non-empty list")
        conv, cut = [], False
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise NotRenderable("each message needs a role")
            msg = self._message(m)
            if msg is None:  # a non-text part: render what comes before it
                cut = True
                break
            conv.append(msg)
        if not conv:
            return []
        kwargs = payload.get("chat_template_kwargs")
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        for k in ("tokenize", "return_dict", "conversation", "chat_template", "tools", "documents"):
            kwargs.pop(k, None)
        template = payload.get("chat_template") if isinstance(payload.get("chat_template"), str) else self.template
        if template is None:
            raise NotRenderable("the model has no chat template")
        add_gen = payload.get("add_generation_prompt", True) is not False and not cut
        cont = payload.get("continue_final_message") is True and not cut
        if cont:
            add_gen = False
        tools = payload.get("tools") if isinstance(payload.get("tools"), list) else None
        if isinstance(payload.get("documents"), list):
            kwargs["documents"] = payload["documents"]
        out = self.tok.apply_chat_template(
            conv,
            tools=tools,
            chat_template=template,
            add_generation_prompt=add_gen,
            continue_final_message=cont,
            tokenize=True,
            return_dict=False,
            **kwargs,
        )
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]

    def _message(self, m: dict) -> dict | None:
        role = m["role"]
        if role == "developer" and not self.knows_developer:
            role = "system"
        content = m.get("content")
        if content is None:
            parts: list = []
        elif isinstance(content, str):
            parts = [content]
        elif isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, str):
                    parts.append(part)
                    continue
                if not isinstance(part, dict):
                    raise NotRenderable("a content part must be an object")
                kind = part.get("type")
                if kind in TEXT_PART_TYPES:
                    text = part.get("text", part.get("refusal"))
                    if not isinstance(text, str):
                        raise NotRenderable("a text part needs its text")
                    parts.append(text)
                else:
                    return None
        else:
            raise NotRenderable("content must be a string or a list of parts")
        out: dict = {"role": role}
        out["content"] = [{"type": "text", "text": t} for t in parts] if self.content_as_parts else "\n".join(parts)
        for k in ("name", "tool_call_id"):
            if isinstance(m.get(k), str):
                out[k] = m[k]
        if role == "assistant" and isinstance(m.get("tool_calls"), list):
            out["tool_calls"] = m["tool_calls"]
        if role == "assistant" and isinstance(m.get("reasoning"), str):
            out["reasoning"] = out["reasoning_content"] = m["reasoning"]
        return out


def first_image(payload) -> bytes | None:
    """The content hash of a chat request's first image (None without one): sha256 of the
    image bytes of a data: URL, else of the URL (or of the part's uuid, which vLLM also uses
    as the item's identity). Bounded: a huge data URL is hashed as its text."""
    messages = payload.get("messages") if isinstance(payload, dict) else None
    if not isinstance(messages, list):
        return None
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
                continue
            if isinstance(part.get("uuid"), str):
                return hashlib.sha256(b"uuid:" + part["uuid"].encode()).digest()
            url = part.get("image_url")
            if isinstance(url, dict):
                url = url.get("url")
            if not isinstance(url, str):
                return hashlib.sha256(repr(sorted(part)).encode()).digest()
            if url.startswith("data:") and "," in url and len(url) <= IMAGE_BYTES_MAX:
                try:
                    return hashlib.sha256(base64.b64decode(url.split(",", 1)[1], validate=False)).digest()
                except (binascii.Error, ValueError):
                    pass
            return hashlib.sha256(url.encode("utf-8", "replace")).digest()
    return None


def request_model(payload) -> str | None:
    model = payload.get("model") if isinstance(payload, dict) else None
    return model if isinstance(model, str) and model else None
