"""Tokens in, tokens out: a tool-using conversation as token ids, rendered with the checkpoint's
own chat template.

The policy's ids are never re-tokenized. A trajectory is built as

    prompt_ids(messages) + sampled_1 + observation_ids(...) + sampled_2 + ... + sampled_n

where each ``sampled_k`` is exactly what the engine returned for turn ``k`` and each observation
is the chat template's *delta* for the tool's message: the text the template writes after the
sampled turn (the rest of the turn's closing, the tool message, the next generation prompt),
tokenized on its own. With the conversation the sampled ids decode to, the sum is what the
template renders for the whole conversation, tokenized at once.

The delta is taken from three renders of the conversation ``messages`` so far (which ended with a
generation prompt), the assistant turn ``a`` (the text the sampled ids decode to) and the tool
message ``t``:

- ``P = render(messages, generation prompt)``: the text the policy was prompted with;
- ``A = render(messages + [a])``: the turn closed, no generation prompt;
- ``B = render(messages + [a, t], generation prompt)``: the next turn's prompt.

``A`` must start with ``P`` followed by the sampled text verbatim (the template writes the turn as
it was sampled, its end-of-turn token included), and ``B`` must start with ``A`` (appending the
tool message rewrites nothing before it). The observation is ``B`` after ``P`` and the sampled
text. A template that fails either check (one that strips the reasoning of earlier turns, trims
or re-formats a turn) is refused with a ``TemplateError`` naming where the two renders differ:
appending ids to a sampled prefix could not reproduce what the template writes.

The cut itself: a tokenizer splits its text at added tokens (``<|im_end|>``, ``<|eot_id|>``)
before its model sees it, so when the sampled turn ends with its end-of-turn token no merge can
cross the cut. A turn that ended without one (cut at its token budget) ends in plain text, and a
byte-level BPE could merge across the cut; the tail of the turn since its last added token is
encoded with and without the delta to check that the cut is a token boundary (a ``TemplateError``
if not). The cut after the delta (its generation prompt, then the next sampled turn) is the one
every prompt has with its response, and is not checked here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


class TemplateError(ValueError):
    """The chat template cannot give the ids of a tool's answer: no template, a role it refuses
    or drops, or renders that are not prefixes of one another (the message names the first
    differing characters)."""


class ToolCallError(ValueError):
    """An assistant turn's tool call is malformed; the message names the call and the problem."""


def _unwrap(tokenizer: Any) -> Any:
    """The ``transformers`` tokenizer behind ``tokenizer``: the project's ``HFTokenizer`` or a raw
    ``transformers`` tokenizer."""
    from april_async.model.tokenizer import HFTokenizer

    if isinstance(tokenizer, HFTokenizer):
        return tokenizer._tok
    if not hasattr(tokenizer, "apply_chat_template"):
        raise TemplateError(f"a {type(tokenizer).__name__} has no chat template: a tool-using conversation "
                            "needs a Hugging Face tokenizer that ships one")
    return tokenizer


def _excerpt(text: str, at: int, width: int = 40) -> str:
    piece = text[at:at + width]
    return repr(piece + ("..." if len(text) > at + width else "")) if piece else "the end of the text"


def _first_difference(a: Sequence, b: Sequence) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter one's length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _require_prefix(short: str, long: str, what: str) -> None:
    """Raise a ``TemplateError`` unless ``long`` starts with ``short``, naming the first difference."""
    if long.startswith(short):
        return
    at = _first_difference(short, long)
    raise TemplateError(f"{what}: the renders differ at character {at}: {_excerpt(short, at)} "
                        f"against {_excerpt(long, at)}")


class ChatRenderer:
    """A conversation as token ids, through a Hugging Face tokenizer's chat template.

    ``tokenizer``: an ``HFTokenizer`` (``april_async.model.tokenizer``) or a raw ``transformers``
    tokenizer with a ``chat_template``. ``tools``: the OpenAI-style function schemas the template
    shows the model (``tools=`` of ``apply_chat_template``), or None. ``template_kwargs``: further
    variables for the template (for instance ``enable_thinking``), passed to every render.
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, *,
                 template_kwargs: Mapping[str, Any] | None = None):
        self._tok = _unwrap(tokenizer)
        if not getattr(self._tok, "chat_template", None):
            raise TemplateError(f"the tokenizer ({type(self._tok).__name__}) has no chat template: a "
                                "tool-using conversation is rendered with the checkpoint's own")
        self.tools = list(tools) if tools is not None else None
        self.template_kwargs = dict(template_kwargs or {})
        added = getattr(self._tok, "added_tokens_decoder", {}) or {}
        self._added_ids = frozenset(added)
        self._special_ids = frozenset(getattr(self._tok, "all_special_ids", None) or ()) | frozenset(
            i for i, token in added.items() if getattr(token, "special", False))

    # ---- the tokenizer, as this module uses it --------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """``text``'s ids with no special token added (the template writes every one)."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included, as the tokenizer writes them."""
        return self._tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render(self, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool) -> str:
        """The template's text for ``messages`` (with ``tools``); a template that raises (a role it
        does not know, say) is a ``TemplateError`` quoting it."""
        import jinja2

        roles = ", ".join(dict.fromkeys(str(m.get("role")) for m in messages))
        try:
            text = self._tok.apply_chat_template(
                [dict(m) for m in messages], tools=self.tools, tokenize=False,
                add_generation_prompt=generation_prompt, **self.template_kwargs)
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template refuses a conversation of roles {roles}: {e}") from None
        if not isinstance(text, str):
            raise TemplateError(f"the chat template rendered a {type(text).__name__}, not text")
        return text

    # ---- a trajectory ---------------------------------------------------------------------------

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The first prompt: ``messages`` rendered with the generation prompt, tokenized without
        adding special tokens (the template writes them, ``<|begin_of_text|>`` included)."""
        return self.encode(self.render(messages, generation_prompt=True))

    def assistant_message(self, assistant_ids: Sequence[int]) -> dict[str, str]:
        """The assistant message of a sampled turn, as the conversation holds it: the text the ids
        decode to, less a last special token (the end-of-turn token, which the template writes
        itself). Append it, then the tool's message, to the conversation of the next turn."""
        ids = list(assistant_ids)
        if ids and ids[-1] in self._special_ids:
            ids = ids[:-1]
        return {"role": "assistant", "content": self.decode(ids)}

    def observation_ids(self, messages: Sequence[Mapping[str, Any]], assistant_ids: Sequence[int],
                        tool_message: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> list[int]:
        """The ids to append after a sampled turn for the tool's answer.

        ``messages``: the conversation the turn was prompted with (it ended with the generation
        prompt); ``assistant_ids``: the ids the policy sampled, normally ending with the template's
        end-of-turn token; ``tool_message``: the tool's message (``{"role": "tool", "content": ...}``,
        with ``name`` or ``tool_call_id`` where the template reads them), or a list of them for
        parallel calls. Returns the ids of the rest of the turn's closing, the tool message and the
        next generation prompt, so that ``prompt + assistant_ids + observation`` is the template's
        render of the whole conversation. ``TemplateError`` when the template cannot give that (see
        the module's docstring).
        """
        tools = [dict(tool_message)] if isinstance(tool_message, Mapping) else [dict(m) for m in tool_message]
        if not tools:
            raise ValueError("observation_ids needs a tool message")
        messages = [dict(m) for m in messages]
        sampled = self.decode(assistant_ids)
        assistant = self.assistant_message(assistant_ids)
        prompt = self.render(messages, generation_prompt=True)
        closed = self.render(messages + [assistant], generation_prompt=False)
        opened = self.render(messages + [assistant] + tools, generation_prompt=True)
        _require_prefix(prompt + sampled, closed,
                        "the template does not write the sampled turn verbatim after its prompt")
        _require_prefix(closed, opened,
                        "the template rewrites the conversation when the tool message is appended "
                        "(the render without it is not a prefix of the render with it)")
        added = opened[len(closed):]
        for tool in tools:
            content = tool.get("content")
            if isinstance(content, str) and content.strip() and content.strip() not in added:
                raise TemplateError(f"the chat template drops a message of role {tool.get('role')!r}: its "
                                    f"content {_excerpt(content, 0)} is not in what it adds "
                                    f"({_excerpt(added, 0)})")
        delta = opened[len(prompt) + len(sampled):]
        ids = self.encode(delta)
        self._check_cut(list(assistant_ids), sampled, delta, ids)
        return ids

    def _check_cut(self, assistant_ids: list[int], sampled: str, delta: str, delta_ids: list[int]) -> None:
        """Raise a ``TemplateError`` if encoding the delta on its own splits tokens differently from
        encoding it after the sampled turn. The tokenizer splits at added tokens first, so only the
        turn's text since its last added token can merge with the delta: that tail is encoded with
        and without the delta (just the end-of-turn token and the delta, for a turn that ended)."""
        if not delta or not assistant_ids:
            return
        last = max((k for k, i in enumerate(assistant_ids) if i in self._added_ids), default=None)
        tail = sampled
        if last is not None:
            head = self.decode(assistant_ids[:last])
            if sampled.startswith(head):
                tail = sampled[len(head):]
        together = self.encode(tail + delta)
        apart = self.encode(tail) + delta_ids
        if together != apart:
            at = max(_first_difference(together, apart) - 2, 0)
            raise TemplateError(
                f"the cut between the sampled turn and the tool's answer is not a token boundary: "
                f"{_excerpt(tail[-20:], 0)} then {_excerpt(delta, 0)} encode as {together[at:at + 5]} "
                f"together but {apart[at:at + 5]} apart (the turn ends without an end-of-turn token, and "
                "the tokenizer merges across the cut)")


# ---- tool calls ---------------------------------------------------------------------------------

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
"""Qwen3's (and Hermes') markers: each call a JSON object ``{"name", "arguments"}`` between them."""

PYTHON_TAG = "<|python_tag|>"
"""Llama 3.1's marker that may open a tool-calling turn."""


def tool_calls(text: str) -> list[dict[str, Any]]:
    """The tool calls of an assistant turn's text (without its end-of-turn token), each as
    ``{"name": str, "arguments": dict}``; ``[]`` for a turn that calls nothing.

    Two styles are read:

    - Qwen3: one or more ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, anywhere in
      the turn (after its reasoning, say);
    - Llama 3.1 (JSON tool calling): the whole turn is one JSON object
      ``{"name": ..., "parameters": {...}}``, maybe after ``<|python_tag|>``.

    Arguments given as a JSON string (OpenAI's habit) are parsed. A malformed call (JSON that does
    not parse, an unclosed marker, no name, arguments that are not an object) is a
    ``ToolCallError`` naming the call and the problem.
    """
    if TOOL_CALL_OPEN in text or TOOL_CALL_CLOSE in text:
        return _tagged_calls(text)
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG):].strip()
    if body.startswith("{"):
        return [_call(_parse(body, "the turn's tool call"), "the turn's tool call")]
    if tagged:
        raise ToolCallError(f"the turn opens with {PYTHON_TAG} but is not a JSON tool call: "
                            f"{_excerpt(body, 0)} (built-in tools' Python calls are not read)")
    return []


def _tagged_calls(text: str) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    at = 0
    while True:
        start, stray = text.find(TOOL_CALL_OPEN, at), text.find(TOOL_CALL_CLOSE, at)
        if start < 0 <= stray or 0 <= stray < start:
            raise ToolCallError(f"the {TOOL_CALL_CLOSE} at character {stray} closes no {TOOL_CALL_OPEN}")
        if start < 0:
            return calls
        where = f"tool call {len(calls) + 1} (at character {start})"
        body_at = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_at)
        if end < 0:
            raise ToolCallError(f"{where}: {TOOL_CALL_OPEN} is never closed by {TOOL_CALL_CLOSE}")
        body = text[body_at:end]
        if TOOL_CALL_OPEN in body:
            raise ToolCallError(f"{where}: another {TOOL_CALL_OPEN} opens before this one is closed")
        calls.append(_call(_parse(body, where), where))
        at = end + len(TOOL_CALL_CLOSE)


def _parse(body: str, where: str) -> Any:
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"{where}: not valid JSON ({e.msg} at character {e.pos}): "
                            f"{_excerpt(body.strip(), 0, 80)}") from None


def _call(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ToolCallError(f"{where}: a JSON {type(value).__name__}, not an object with a name and "
                            "arguments")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError(f"{where}: no function name (a non-empty string under \"name\")")
    key = next((k for k in ("arguments", "parameters") if k in value), None)
    arguments = value[key] if key is not None else {}
    if isinstance(arguments, str):
        arguments = _parse(arguments, f"{where}: the arguments of {name!r}")
    if not isinstance(arguments, dict):
        raise ToolCallError(f"{where}: the arguments of {name!r} are a JSON {type(arguments).__name__}, "
                            "not an object")
    return {"name": name, "arguments": arguments}
