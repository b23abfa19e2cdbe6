"""Tool calling: the hermes parser on whole outputs and streamed in any split, the request
checks, and a real server (``--enable-auto-tool-choice --tool-call-parser hermes``) whose
model's greedy answer, under a tokenizer built around it, is a tool call."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from cluster.tool_calls import Tool, ToolCallStream, ToolFunction, ToolRequestError, parse_tool_calls, plan_tools
from tests.serve_helpers import API_KEY, ServerProcess, ray_address

CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
TEXTS = [
    "plain text, no call",
    f"Let me check. <tool_call>\n{json.dumps(CALL)}\n</tool_call>",
    f"<tool_call>{json.dumps(CALL)}</tool_call>\n<tool_call>{json.dumps({'name': 'now', 'arguments': {}})}</tool_call>",
    f"<tool_call>{json.dumps(CALL)}",  # unclosed at the end (EOS right after the JSON)
    "<tool_call>not json</tool_call> tail",  # not a call: text
    "a < b and <tool_ca is no tag",
    f"<tool_call>{json.dumps(CALL)}</tool_call><tool_call>{{bad}}</tool_call>",  # one bad: all text
    f"Sure.<tool_call>{json.dumps(CALL)}</tool_call>Done.",  # text after the calls: dropped
    f"\n\n<tool_call>{json.dumps(CALL)}</tool_call>",
]


def _strip_ids(calls):
    return [{k: v for k, v in c.items() if k not in ("id", "index")} for c in calls]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_parser_equals_whole_parse(text):
    content, calls = parse_tool_calls(text)
    rng = random.Random(len(text))
    for _ in range(20):  # random splits, down to one character a delta
        ts, got_content, got_calls, at = ToolCallStream(), "", [], 0
        while at < len(text):
            n = rng.randint(1, 7)
            c, k = ts.feed(text[at : at + n], final=at + n >= len(text))
            got_content, got_calls, at = got_content + c, got_calls + k, at + n
        assert _strip_ids(got_calls) == _strip_ids(calls)
        assert [c["index"] for c in got_calls] == list(range(len(calls)))
        if calls:
            assert got_content.strip() == (content or "")
        else:
            assert got_content == text
    if calls:
        assert json.loads(calls[0]["function"]["arguments"]) == CALL["arguments"]
        assert calls[0]["function"]["name"] == "get_weather" and calls[0]["type"] == "function"


def test_plan_tools_modes_and_refusals():
    tools = [Tool(type="function", function=ToolFunction(name="get_weather", parameters={"type": "object"}))]
    assert plan_tools(None, None, None).mode is None
    assert plan_tools(tools, "none", None).mode is None and plan_tools(tools, "none", None).template_tools
    auto = plan_tools(tools, None, "hermes")  # tools given: "auto" by default
    assert auto.mode == "auto" and auto.template_tools[0]["function"]["name"] == "get_weather"
    named = plan_tools(tools, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert (named.mode, named.constraint) == ("named", {"type": "object"})
    assert named.message('{"city": "Oslo"}', "stop") == (
        {"role": "assistant", "content": None, "tool_calls": [_with_id(named, "get_weather", '{"city": "Oslo"}')]},
        "stop",
    )
    required = plan_tools(tools, "required", None)
    assert required.constraint["minItems"] == 1 and "maxItems" not in required.constraint
    assert plan_tools(tools, "required", None, parallel=False).constraint["maxItems"] == 1
    message, finish = required.message('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', "stop")
    assert finish == "tool_calls" and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert required.message('[{"name": "get_w', "length") == (
        {"role": "assistant", "content": '[{"name": "get_w'},
        "length",
    )
    for tl, choice, parser, field, text in [
        (tools, "auto", None, "tool_choice", "--enable-auto-tool-choice"),
        (tools, {"type": "function", "function": {"name": "other"}}, "hermes", "tool_choice", "one of the request"),
        (tools, "sometimes", "hermes", "tool_choice", "must be 'auto'"),
        (None, "auto", "hermes", "tool_choice", "needs tools"),
        ([Tool(type="retrieval", function=ToolFunction(name="x"))], None, "hermes", "tools", "'function'"),
        ([Tool(type="function", function=ToolFunction(name="a b"))], None, "hermes", "tools", "letters, digits"),
    ]:
        with pytest.raises(ToolRequestError, match=text) as info:
            plan_tools(tl, choice, parser)
        assert info.value.field == field


def _with_id(plan, name, args):
    """The call ``plan`` makes of ``args``, its (random) id taken from a fresh read."""
    call = plan.read(args)[1][0]
    assert call["function"] == {"name": name, "arguments": args}
    return {**call, "id": ANY_ID}


class _AnyId(str):
    def __eq__(self, other):
        return isinstance(other, str) and other.startswith("chatcmpl-tool-")

    __hash__ = str.__hash__


ANY_ID = _AnyId("chatcmpl-tool-*")


def test_required_calls_decode_to_their_schema(ray_local):
    """tool_choice='required': the output, constrained to the plan's schema on the byte-level
    demo model, reads back as calls of the request's tools with arguments of their schemas."""
    from cluster import LLM, SamplingParams
    from cluster.demo_model import ensure_demo_model

    params = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}
    tools = [
        Tool(type="function", function=ToolFunction(name="get_weather", parameters=params)),
        Tool(type="function", function=ToolFunction(name="now")),
    ]
    plan = plan_tools(tools, "required", None)
    llm = LLM(model=str(ensure_demo_model()), block_size=16, num_kv_blocks=64, max_model_len=256)
    try:
        sp = [
            SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_outputs={"json": plan.constraint})
            for s in range(4)
        ]
        outs = llm.generate(["Call: "] * 4, sp, use_tqdm=False)
    finally:
        llm.shutdown()
    for o in outs:
        message, finish = plan.message(o.outputs[0].text, o.outputs[0].finish_reason)
        assert finish == "tool_calls", o.outputs[0].text
        for call in message["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            assert call["function"]["name"] in ("get_weather", "now")
            assert call["function"]["name"] == "now" or args["city"] in ("Oslo", "Rome")


TEMPLATE = (
    "{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} "
    "{% for c in m.tool_calls or [] %}call {{ c.function.name }} {{ c.function.arguments.city }} {% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "w10", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tool_model(ckpt_dir, tmp_path_factory):
    """The tiny llama, with a tool-aware template and a tokenizer that names the first three
    greedy tokens after a chat prompt '<tool_call>', a call's JSON and '</tool_call>'; returns
    (dir, user message, the token greedy decoding emits next)."""
    import transformers

    base = ckpt_dir("llama")
    out = tmp_path_factory.mktemp("tool-model")
    for f in base.iterdir():
        shutil.copy(f, out / f.name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    rng = random.Random(3)
    for _ in range(200):
        user = " ".join(f"w{rng.randrange(20, 250)}" for _ in range(3))
        ids = tok.apply_chat_template([{"role": "user", "content": user}], tools=TOOLS, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.no_grad():
            g = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=0)[0, len(ids) :]
        g = g.tolist()
        if len(set(g[:3])) == 3 and not set(g[:3]) & (set(ids) | {0, 1, 2, 10}) and g[3] not in g[:3]:
            break
    else:
        raise AssertionError("no prompt found whose greedy tokens can be renamed")
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    names = {g[0]: "<tool_call>", g[1]: json.dumps(CALL, separators=(",", ":")), g[2]: "</tool_call>"}
    spec["model"]["vocab"] = {names.get(i, w): i for w, i in vocab.items()}
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out, user, g[3]


@pytest.fixture(scope="module")
def tool_server(ray_local, tool_model, tmp_path_factory):
    model, _, _ = tool_model
    args = ["--model", str(model), "--api-key", API_KEY, "--max-model-len", "256", "--num-kv-blocks", "64"]
    args += ["--block-size", "16", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    proc = ServerProcess(args, tmp_path_factory.mktemp("tools") / "server.log", ray_addr=ray_address(), api_key=API_KEY)
    try:
        yield proc.wait_ready()
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


def test_server_returns_the_models_tool_call(tool_server, tool_model):
    import openai

    model, user, after = tool_model
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    kw = dict(
        model=str(model),
        messages=[{"role": "user", "content": user}],
        tools=TOOLS,
        temperature=0,
        max_tokens=10,
        extra_body={"stop_token_ids": [after]},
    )
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == CALL["arguments"]
    # streamed: the call whole in one delta, no content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", CALL["arguments"])
    ]
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # without tools the same prompt is plain text (the template renders no tool list)
    plain = client.chat.completions.create(**{**kw, "tools": None}).choices[0]
    assert plain.message.tool_calls is None
    # the call and its result sent back: the template sees both (the prompt grows by them)
    follow = kw["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "w40 w41"},
    ]
    r2 = client.chat.completions.create(**{**kw, "messages": follow})
    assert r2.usage.prompt_tokens == r.usage.prompt_tokens + len(
        "assistant: call get_weather Paris tool: w40 w41".split()
    )
    # a named function: the output is constrained to its parameters' schema (an object; this
    # vocabulary spells one: the call token), its arguments
    named = client.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "w10"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "w10" and json.loads(call.function.arguments) == CALL
    assert named.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="one of the request's tools"):
        client.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "nope"}})
    client.close()
