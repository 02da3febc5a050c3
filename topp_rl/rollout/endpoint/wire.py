"""The OpenAI wire format of the endpoint (`topp_rl.rollout.endpoint.server`): what a request may ask, its prompt
ids, and the response bodies.

A request is served at the run's sampling settings or refused (`Refused`, an HTTP 400 naming the run's values):
the trainer scores every token over the set the run's sampler kept, so a turn drawn at other settings could not
be scored exactly. `max_tokens` / `max_completion_tokens` below the run's `max_new_tokens` are honoured by cutting
the completion (exact: the kept tokens are what was sampled); above it, the turn is served at the run's limit
(finish_reason "length" when it reaches it; the choice's `max_tokens` says the limit served). Chat messages are
rendered by the tokenizer's chat template (with `tools`), or `MINIMAL_CHAT_TEMPLATE` for a tokenizer without one
(the tiny model's). Tool calls in the model's output in the `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` form (Qwen / Hermes templates) come back as OpenAI `tool_calls`; text that does not parse stays
plain content.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any

from topp_rl.data import SamplingParams
from topp_rl.data.sample import Sample, SampleStatus

# For a tokenizer without a chat template (the tiny model's char tokenizer): role initial, ':', content, EOS per
# message, then "a:" for the reply. Only characters the char tokenizer has; an assistant turn that ended on EOS
# renders back as exactly the ids sampled, so the next request joins its sample.
MINIMAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] or '' }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
# Keys a request may carry besides the sampling settings; anything else is refused (never silently ignored).
CHAT_KEYS = {"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens", "max_completion_tokens",
             "n", "stream", "user", "logprobs"}
COMPLETION_KEYS = {"model", "prompt", "max_tokens", "n", "stream", "user", "logprobs", "echo"}
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")
# Settings that change the distribution sampled from; served only at their neutral value.
NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class Refused(ValueError):
    """A request the endpoint does not serve: HTTP 400 with this message (`param`: the offending key)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def run_settings(params: SamplingParams) -> str:
    return (f"temperature={params.temperature} top_p={params.top_p} top_k={params.top_k} min_p={params.min_p} "
            f"max_tokens<={params.max_new_tokens} n=1")


def check_request(body: Any, params: SamplingParams, *, allowed: set[str]) -> int:
    """Refuse what the run cannot serve exactly; returns the completion's token limit."""
    if not isinstance(body, Mapping):
        raise Refused(f"the request body is a {type(body).__name__}; send a JSON object")
    unknown = sorted(set(body) - allowed - set(SAMPLING_KEYS) - set(NEUTRAL) - {"seed", "stop"})
    if unknown:
        raise Refused(f"request keys {unknown} are not served by this endpoint; it serves {sorted(allowed)} at the "
                      f"run's sampling settings ({run_settings(params)})", unknown[0])
    for key in SAMPLING_KEYS:
        value = body.get(key)
        run = getattr(params, key)
        if value is not None and not _same(key, value, run):
            raise Refused(f"{key}={value!r}: this run samples at {run_settings(params)} and trains on exactly those "
                          f"kept sets; leave {key} out or send {run}", key)
    for key, neutral in NEUTRAL.items():
        if body.get(key) not in (None, neutral):
            raise Refused(f"{key}={body[key]!r} changes the distribution sampled from; this run samples at "
                          f"{run_settings(params)} (leave {key} out)", key)
    for key, ok in (("n", (None, 1)), ("stream", (None, False)), ("logprobs", (None, False)), ("echo", (None, False)),
                    ("seed", (None,)), ("stop", (None, [], "")), ("tool_choice", (None, "auto")),
                    ("parallel_tool_calls", (None, True))):
        if body.get(key) not in ok:
            raise Refused(f"{key}={body[key]!r} is not served (the run's settings: {run_settings(params)}; the run's "
                          "seed draws every turn, generation stops at the run's stop ids, the model may call any "
                          "tool or none; leave it out)", key)
    limit = params.max_new_tokens
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise Refused(f"{key}={value!r} must be an integer >= 1", key)
            limit = min(limit, value)
    return limit


def asked_tokens(body: Mapping[str, Any]) -> int | None:
    """The completion length a (checked) request asked: the smaller of `max_tokens` / `max_completion_tokens`."""
    asked = [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    return min(asked) if asked else None


def _same(key: str, value: Any, run: float | int) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if key == "top_k" and value < 0 and run == 0:  # -1 (SGLang / vLLM) and 0 both mean no top-k
        return True
    return float(value) == float(run)


def chat_prompt_ids(body: Mapping[str, Any], tokenizer: Any) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Refused("messages must be a non-empty list of {role, content} objects", "messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise Refused("tools must be a list of tool definitions", "tools")
    template = None if tokenizer.chat_template else MINIMAL_CHAT_TEMPLATE
    try:
        ids = tokenizer.apply_chat_template([_message(m) for m in messages], tools=tools or None,
                                            add_generation_prompt=True, tokenize=True, chat_template=template)
    except Refused:
        raise
    except Exception as e:  # the template's own complaint (a role it does not know, say) is the client's to fix
        raise Refused(f"the chat template could not render these messages: {type(e).__name__}: {e}",
                      "messages") from e
    return [int(t) for t in (ids["input_ids"] if isinstance(ids, Mapping) else ids)]


def _message(m: Any) -> dict[str, Any]:
    """An OpenAI message as HF chat templates read it: text parts joined, tool-call arguments as objects."""
    if not isinstance(m, Mapping) or "role" not in m:
        raise Refused(f"a message must be an object with a role, got {m!r}", "messages")
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):  # [{type: text, text: ...}, ...]
        if any(not isinstance(p, Mapping) or p.get("type") != "text" for p in content):
            raise Refused("only text content parts are served", "messages")
        out["content"] = "".join(p["text"] for p in content)
    calls = []
    for call in m.get("tool_calls") or ():
        fn = dict(call.get("function", {}))
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass  # kept as the string the client sent
        calls.append({**call, "function": fn})
    if calls:
        out["tool_calls"] = calls
    return out


def completion_prompt_ids(body: Mapping[str, Any], tokenizer: Any, vocab_size: int) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=False)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise Refused(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", "prompt")
        return list(prompt)
    raise Refused("prompt must be a non-empty string or a non-empty list of token ids (one prompt per request)",
                  "prompt")


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a completion; ([text], []) when any <tool_call> body is not a JSON object
    with a string name."""
    bodies = _TOOL_CALL.findall(text)
    if not bodies:
        return text, []
    calls = []
    for k, raw in enumerate(bodies):
        try:
            call = json.loads(raw)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{k}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    content = _TOOL_CALL.sub("", text).strip()
    return content or None, calls


def finish_reason(out: Sample, kept: int) -> str:
    return "stop" if out.status == SampleStatus.COMPLETED and kept == out.response_length else "length"


def chat_response(*, model: str, prompt_ids: list[int], ids: list[int], text: str, reason: str,
                  max_tokens: int | None = None) -> dict[str, Any]:
    """`max_tokens`: the limit the turn was served at (an extra field of the choice, like the ids)."""
    content, calls = parse_tool_calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if calls and reason == "stop" else reason,
              "logprobs": None, "prompt_token_ids": prompt_ids, "completion_token_ids": ids, "max_tokens": max_tokens}
    return _envelope("chat.completion", model, choice, prompt_ids, ids)


def completion_response(*, model: str, prompt_ids: list[int], ids: list[int], text: str, reason: str,
                        max_tokens: int | None = None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None, "prompt_token_ids": prompt_ids,
              "completion_token_ids": ids, "max_tokens": max_tokens}
    return _envelope("text_completion", model, choice, prompt_ids, ids)


def _envelope(kind: str, model: str, choice: dict[str, Any], prompt_ids: list[int], ids: list[int]) -> dict[str, Any]:
    return {"id": f"topp-rl-{time.monotonic_ns()}", "object": kind, "created": int(time.time()), "model": model,
            "choices": [choice], "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                                           "total_tokens": len(prompt_ids) + len(ids)}}


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
