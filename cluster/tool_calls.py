"""Tool calling on ``/v1/chat/completions``, as vLLM serves it with ``--enable-auto-tool-choice
--tool-call-parser NAME``: the request's ``tools`` reach the chat template (its ``tools``
variable, as in transformers' ``apply_chat_template``), and with ``tool_choice="auto"`` the
parser turns the model's tool-call markup into OpenAI ``tool_calls`` (``finish_reason``
``"tool_calls"``). Parsers:

- ``hermes`` (Qwen 2.5 / 3, Hermes, and the many models trained on its format): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text before the first call is
  the message's content. Markup that does not parse stays text.

``tool_choice="required"`` and a named function constrain the output with a JSON schema
(structured outputs, as vLLM does): a JSON array of ``{"name", "parameters"}``, or the named
function's arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

TOOL_CALL_PARSERS = ("hermes",)
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_START, _END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.S)


class ToolFunction(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str
    function: ToolFunction


class ToolCallFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    """An assistant message's earlier call, sent back in a conversation."""

    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class ToolRequestError(ValueError):
    """A request's tools or tool_choice cannot be served; ``field`` names the parameter."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass
class ToolPlan:
    """How one chat request uses its tools: ``template_tools`` (what the template gets), the
    output's reading (``mode``: None, ``"auto"`` (the parser), ``"required"`` or ``"named"``),
    and for the forced modes the JSON schema the output is constrained to (``constraint``)."""

    template_tools: list[dict] | None = None
    mode: str | None = None
    name: str | None = None  # the named function
    constraint: dict | None = None

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The choice's message and finish reason for the whole output ``text``."""
        content, calls = self.read(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        return message, self.finish_reason(finish, len(calls))

    def finish_reason(self, finish: str | None, num_calls: int) -> str | None:
        """``"tool_calls"`` where the output stopped on calls (a named function's answer keeps
        ``"stop"``, as OpenAI's)."""
        return "tool_calls" if finish == "stop" and num_calls and self.mode != "named" else finish

    def read(self, text: str) -> tuple[str | None, list[dict]]:
        if self.mode == "auto":
            return parse_tool_calls(text)
        if self.mode == "named":  # the output is the function's arguments
            return None, [_openai_call(self.name, text)]
        try:  # required: a JSON array of {"name", "parameters"}
            items = json.loads(text)
            return None, [_openai_call(i["name"], i["parameters"]) for i in items]
        except (ValueError, TypeError, KeyError):
            return text, []

    def stream(self) -> "ToolCallStream | ForcedToolStream":
        return ToolCallStream() if self.mode == "auto" else ForcedToolStream(self)


def plan_tools(
    tools: list[Tool] | None, tool_choice: Any, parser: str | None, parallel: bool | None = None
) -> ToolPlan:
    """How the request's tools are served (``parser``: the server's ``--tool-call-parser``
    where ``--enable-auto-tool-choice``). ``"required"`` and a named function constrain the
    output to a JSON schema (structured outputs), as vLLM does; they need no parser.
    ``parallel`` False (``parallel_tool_calls``): a required answer holds one call."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolRequestError("tool_choice needs tools", "tool_choice")
        return ToolPlan()
    if len(tools) > MAX_TOOLS:
        raise ToolRequestError(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    for i, t in enumerate(tools):
        if t.type != "function":
            raise ToolRequestError(f"tools[{i}].type must be 'function', got {t.type[:40]!r}", "tools")
        if not _NAME.match(t.function.name):
            raise ToolRequestError(
                f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '.' or '-', "
                f"got {t.function.name[:70]!r}",
                "tools",
            )
    listed = [msgspec.to_builtins(t) for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        fn = next((t.function for t in tools if t.function.name == name), None)
        if choice.get("type") != "function" or fn is None:
            raise ToolRequestError(
                f"tool_choice must name one of the request's tools ({{'type': 'function', 'function': "
                f"{{'name': ...}}}}), got {str(choice)[:80]}",
                "tool_choice",
            )
        return ToolPlan(listed, "named", fn.name, _schema(fn))
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": _schema(t.function)},
                "required": ["name", "parameters"],
            }
            for t in tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if parallel is False:
            schema["maxItems"] = 1
        return ToolPlan(listed, "required", None, schema)
    if choice not in ("auto", "none"):
        shown = f"{choice!r:.60}"
        msg = f"tool_choice must be 'auto', 'none', 'required' or a function, got {shown}"
        raise ToolRequestError(msg, "tool_choice")
    if choice == "auto" and parser is None:
        raise ToolRequestError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', "tool_choice"
        )
    return ToolPlan(listed, "auto" if choice == "auto" else None)


def _schema(fn: ToolFunction) -> dict:
    return fn.parameters if fn.parameters else {"type": "object"}


def template_tool_calls(calls: list[ToolCall]) -> list[dict]:
    """An assistant message's calls as chat templates read them: arguments as a mapping where
    they are a JSON object (templates render them with ``tojson``), else the string."""
    out = []
    for c in calls:
        try:
            args = json.loads(c.function.arguments)
        except ValueError:
            args = c.function.arguments
        out.append({"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": args}})
    return out


def _openai_call(name: str, args) -> dict:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
    }


def _call(body: str) -> dict | None:
    """One hermes call body as an OpenAI tool call, or None where it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _openai_call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole output's (content, tool calls): the text itself and none where it holds no call
    that parses (then the markup is left as it was)."""
    if _START not in text:
        return text, []
    calls = []
    for m in _CALLS.finditer(text):
        call = _call((m.group(1) if m.group(1) is not None else m.group(2)).strip())
        if call is None:
            return text, []
        calls.append(call)
    return text[: text.index(_START)].strip() or None, calls


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back: a tag may follow)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallStream:
    """Parses one streamed sequence as ``parse_tool_calls`` parses the whole: the text before
    the first ``<tool_call>`` goes out as it comes (less what may begin the tag); from the tag
    on, the rest is held and read at the end, as its calls or (where any call does not parse)
    as text."""

    def __init__(self):
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content
        self.held = False  # a tag was seen: the rest waits for the end
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        self.text += text
        content, calls = "", []
        if not self.held:
            i = self.text.find(_START, self.sent)  # (a tag never starts before what was sent)
            if i >= 0:
                self.held, upto = True, i
            else:
                upto = len(self.text) - (0 if final else _partial_tag(self.text, _START))
            content, self.sent = self.text[self.sent : upto], max(self.sent, upto)
        if final and self.held:
            calls = parse_tool_calls(self.text)[1]
            if not calls:
                content, self.sent = content + self.text[self.sent :], len(self.text)
        for k, c in enumerate(calls):
            c["index"] = k
        self.num_calls = len(calls)
        return content, calls


class ForcedToolStream:
    """A streamed forced call (``required`` / a named function): nothing until the output
    ends, then its calls (or, where the output was cut short, its text)."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.text, self.num_calls = plan, "", 0

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        self.text += text
        if not final:
            return "", []
        content, calls = self.plan.read(self.text)
        for k, c in enumerate(calls):
            c["index"] = k
        self.num_calls = len(calls)
        return ("" if calls else content or ""), calls
