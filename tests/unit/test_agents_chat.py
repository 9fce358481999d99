"""Tokens in, tokens out for tool-using conversations: the policy's sampled ids plus the chat
template's delta for each tool answer are the template's render of the whole conversation, for a
Qwen3-style and a Llama-3-style tool template written here, on a tokenizer trained here."""

from __future__ import annotations

import json

import pytest

from april_async.agents.chat import ChatRenderer, TemplateError, ToolCallError, tool_calls
from april_async.model.tokenizer import HFTokenizer
from april_async.testing.checkpoints import chat_tokenizer

transformers = pytest.importorskip("transformers")

# Jinja as transformers compiles it trims the newline right after a block tag ({% ... %}): every
# newline the templates write comes before a tag, or inside {{ '\n' }}.

QWEN_STYLE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nThese functions are yours to call; each signature is a JSON object inside <tools></tools>:\n"
    "<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "To call one, write a JSON object with its \"name\" and its \"arguments\" between "
    "<tool_call> and </tool_call>.<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% if not loop.first %}{{ raise_exception('a system message comes first or not at all') }}{% endif %}"
    "{% elif m.role == 'user' or m.role == 'assistant' %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    # A run of tool answers is one user turn, each answer in its own <tool_response>.
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}{{ raise_exception('this template has no role ' + m.role) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML turns; the tools in the system turn; tool answers as user turns of <tool_response>s."""

LLAMA_STYLE = (
    "{{ bos_token }}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if tools %}Environment: ipython\n\n"
    "When a function below helps, answer with nothing but a JSON object "
    "{\"name\": its name, \"parameters\": an object of its arguments}.\n\n"
    "{% for tool in tools %}{{ tool | tojson }}\n\n{% endfor %}{% endif %}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|eot_id|>"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% if not loop.first %}{{ raise_exception('a system message comes first or not at all') }}{% endif %}"
    "{% elif m.role == 'user' or m.role == 'assistant' %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% elif m.role == 'tool' or m.role == 'ipython' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% else %}{{ raise_exception('this template has no role ' + m.role) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""Header-delimited turns ending in <|eot_id|>; tool answers under the ipython header."""

PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

FORGETS_REASONING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Keeps the reasoning of the last assistant turn only, as reasoning models' templates do."""

TRIMS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

NO_TOOL_ROLE = ("{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
                "{{ raise_exception('unknown role: ' + m.role) }}{% endif %}"
                "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

DROPS_TOOLS = ("{% for m in messages %}{% if m.role != 'tool' %}"
               "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

RUN_ON = "{% for m in messages %}{{ m.content }}{% endfor %}"
"""No markup at all: a turn and the tool's answer meet in plain text."""

CALC = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
RESULTS = {"12 + 30": "42", "42 * 2": "84"}
SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
QUESTION = "What is 12 + 30, doubled?"
FINAL = "12 + 30 = 42, and 42 * 2 = 84. The answer is \\boxed{84}."


def qwen_call(expression: str) -> str:
    """A Qwen3-style tool-calling turn, as the policy would write it."""
    call = json.dumps({"name": "calc", "arguments": {"expression": expression}})
    return f"<tool_call>\n{call}\n</tool_call>"


def llama_call(expression: str) -> str:
    """A Llama-3.1-style (JSON) tool-calling turn, as the policy would write it."""
    return json.dumps({"name": "calc", "parameters": {"expression": expression}})


STYLES = {
    # name: (template, special tokens, other added tokens, bos, end of turn, call writer,
    #        what the template writes after the last turn)
    "qwen3": (QWEN_STYLE, [], ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
              None, "<|im_end|>", qwen_call, "\n"),
    "llama3": (LLAMA_STYLE, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                             "<|eom_id|>", "<|python_tag|>"], [],
               "<|begin_of_text|>", "<|eot_id|>", llama_call, ""),
}


def tokenizer(directory, template: str | None, specials=(), added=(), bos=None,
              eos="<|im_end|>") -> HFTokenizer:
    """The tiny byte-level BPE of the testing kit, with more added tokens (each a single id) and
    ``template`` as its chat template, saved and loaded back as the project loads a checkpoint's."""
    chat_tokenizer(directory, vocab_size=400, chat=False)
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    tok.add_tokens([transformers.AddedToken(s, special=True, normalized=False) for s in specials],
                   special_tokens=True)
    tok.add_tokens([transformers.AddedToken(s, special=False, normalized=False) for s in added])
    if bos is not None:
        tok.bos_token = bos
    tok.eos_token = eos
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(str(directory))
    loaded = HFTokenizer(directory)
    for s in [*specials, *added]:
        assert len(loaded.encode(s)) == 1, s
    return loaded


@pytest.fixture(params=sorted(STYLES))
def style(request, tmp_path):
    template, specials, added, bos, eos, call, after = STYLES[request.param]
    tok = tokenizer(tmp_path, template, specials, added, bos, eos)
    return request.param, tok, tok._tok.convert_tokens_to_ids(eos), call, after


def test_sampled_turns_and_observations_are_the_whole_conversation_rendered_at_once(style):
    name, tok, end, call, after = style
    renderer = ChatRenderer(tok, tools=[CALC])
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ids = renderer.prompt_ids(messages)
    observations = []
    for k, expression in enumerate(["12 + 30", "42 * 2"]):
        sampled = tok.encode(call(expression)) + [end]  # as the engine returns it: encoded once, never again
        assistant = renderer.assistant_message(sampled)
        assert assistant == {"role": "assistant", "content": call(expression)}
        (called,) = tool_calls(assistant["content"])
        assert called == {"name": "calc", "arguments": {"expression": expression}}
        answer = {"role": "tool", "name": "calc", "tool_call_id": f"call-{k}",
                  "content": RESULTS[called["arguments"]["expression"]]}
        observation = renderer.observation_ids(messages, sampled, answer)
        observations.append(observation)
        ids += sampled + observation
        messages += [assistant, answer]
    sampled = tok.encode(FINAL) + [end]
    assert tool_calls(renderer.assistant_message(sampled)["content"]) == []
    ids += sampled
    messages.append(renderer.assistant_message(sampled))

    rendered = tok._tok.apply_chat_template(messages, tools=[CALC], tokenize=False)
    assert rendered.count("\\boxed{84}") == 1 and "42 * 2" in rendered  # the whole conversation is rendered
    whole = tok._tok.apply_chat_template(messages, tools=[CALC], tokenize=True)["input_ids"]
    assert whole == ids + tok.encode(after)  # the template's separator after the last turn is never sampled
    assert renderer.decode(ids) + after == rendered

    # Each observation is the tool's message as the template writes it, then the next generation prompt.
    if name == "qwen3":
        assert renderer.decode(observations[0]) == (
            "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    else:
        assert renderer.decode(observations[1]) == (
            "<|start_header_id|>ipython<|end_header_id|>\n\n84<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_the_prompt_is_the_template_with_its_generation_prompt_and_a_raw_tokenizer_serves_too(style):
    _, tok, _, _, _ = style
    messages = [{"role": "user", "content": QUESTION}]
    want = tok._tok.apply_chat_template(messages, tools=[CALC], add_generation_prompt=True,
                                        tokenize=True)["input_ids"]
    assert ChatRenderer(tok, tools=[CALC]).prompt_ids(messages) == want
    assert ChatRenderer(tok._tok, tools=[CALC]).prompt_ids(messages) == want
    without = ChatRenderer(tok).prompt_ids(messages)
    assert without != want and "calc" not in tok.decode(without)  # no tools: none shown


def test_parallel_calls_answer_in_one_observation(tmp_path):
    template, specials, added, bos, eos, call, _ = STYLES["qwen3"]
    tok = tokenizer(tmp_path, template, specials, added, bos, eos)
    renderer = ChatRenderer(tok, tools=[CALC])
    messages = [{"role": "user", "content": QUESTION}]
    sampled = tok.encode(call("12 + 30") + "\n" + call("42 * 2")) + [tok.eos_id]
    calls = tool_calls(renderer.assistant_message(sampled)["content"])
    assert [c["arguments"]["expression"] for c in calls] == ["12 + 30", "42 * 2"]
    answers = [{"role": "tool", "content": "42"}, {"role": "tool", "content": "84"}]
    observation = renderer.observation_ids(messages, sampled, answers)
    assert renderer.decode(observation) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n84\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    whole = tok._tok.apply_chat_template(messages + [renderer.assistant_message(sampled), *answers],
                                         tools=[CALC], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert renderer.prompt_ids(messages) + sampled + observation == whole


def test_a_turn_cut_before_its_end_of_turn_token_gets_the_closing_in_its_observation(tmp_path):
    template, specials, added, bos, eos, call, _ = STYLES["qwen3"]
    tok = tokenizer(tmp_path, template, specials, added, bos, eos)
    renderer = ChatRenderer(tok, tools=[CALC])
    messages = [{"role": "user", "content": QUESTION}]
    sampled = tok.encode(call("12 + 30"))  # the turn's budget ran out right after the call
    answer = {"role": "tool", "content": "42"}
    observation = renderer.observation_ids(messages, sampled, answer)
    assert renderer.decode(observation).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n42")
    whole = tok._tok.apply_chat_template(messages + [renderer.assistant_message(sampled), answer],
                                         tools=[CALC], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert renderer.prompt_ids(messages) + sampled + observation == whole


def test_a_template_that_rewrites_earlier_turns_is_refused_by_where_it_differs(tmp_path):
    tok = tokenizer(tmp_path, FORGETS_REASONING)
    renderer = ChatRenderer(tok)
    messages = [{"role": "user", "content": QUESTION}]
    sampled = tok.encode("<think>\nAdd first.\n</think>\n\ncalc 12 + 30") + [tok.eos_id]
    with pytest.raises(TemplateError, match=r"rewrites the conversation.*at character \d+: '<think>") as e:
        renderer.observation_ids(messages, sampled, {"role": "tool", "content": "42"})
    assert "'calc 12 + 30" in str(e.value)  # what the longer render has there instead


def test_a_template_that_does_not_write_the_sampled_turn_verbatim_is_refused(tmp_path):
    tok = tokenizer(tmp_path, TRIMS)
    renderer = ChatRenderer(tok)
    sampled = tok.encode("calc 12 + 30\n") + [tok.eos_id]  # the policy ended its turn with a newline
    with pytest.raises(TemplateError, match="sampled turn verbatim"):
        renderer.observation_ids([{"role": "user", "content": QUESTION}], sampled,
                                 {"role": "tool", "content": "42"})


def test_no_chat_template_or_no_tool_role_is_refused(tmp_path):
    bare = tokenizer(tmp_path / "bare", None)
    with pytest.raises(TemplateError, match="no chat template"):
        ChatRenderer(bare)
    with pytest.raises(TemplateError, match="no chat template"):
        ChatRenderer(bare._tok)
    from april_async.model.tokenizer import CharTokenizer
    with pytest.raises(TemplateError, match="CharTokenizer has no chat template"):
        ChatRenderer(CharTokenizer())

    messages = [{"role": "user", "content": QUESTION}]
    answer = {"role": "tool", "content": "42"}
    refuses = tokenizer(tmp_path / "refuses", NO_TOOL_ROLE)
    sampled = refuses.encode("calc 12 + 30") + [refuses.eos_id]
    with pytest.raises(TemplateError, match="refuses a conversation of roles user, assistant, tool: "
                                            "unknown role: tool"):
        ChatRenderer(refuses).observation_ids(messages, sampled, answer)
    drops = tokenizer(tmp_path / "drops", DROPS_TOOLS)
    with pytest.raises(TemplateError, match="drops a message of role 'tool'"):
        ChatRenderer(drops).observation_ids(messages, sampled, answer)


def test_a_cut_the_tokenizer_merges_across_is_refused(tmp_path):
    tok = tokenizer(tmp_path, RUN_ON)
    renderer = ChatRenderer(tok)
    question = [{"role": "user", "content": "Q.\n"}]
    # The trained merges make " answer" one token: a turn cut at " ans" (its budget spent) and a tool
    # answer that starts with "wer" meet inside a token.
    assert len(tok.encode(" answer")) == 1
    with pytest.raises(TemplateError, match="not a token boundary"):
        renderer.observation_ids(question, tok.encode("The ans"), {"role": "tool", "content": "wer is 72"})
    # Cut between two words, the ids are those of the whole text.
    sampled = tok.encode("The answer")
    observation = renderer.observation_ids(question, sampled, {"role": "tool", "content": " is 72"})
    assert renderer.prompt_ids(question) + sampled + observation == tok.encode("Q.\nThe answer is 72")


def test_a_plain_chatml_template_renders_tool_turns_under_their_own_role(tmp_path):
    tok = tokenizer(tmp_path, PLAIN)
    renderer = ChatRenderer(tok)
    sampled = tok.encode("calc 12 + 30") + [tok.eos_id]
    observation = renderer.observation_ids([{"role": "user", "content": QUESTION}], sampled,
                                           {"role": "tool", "content": "42"})
    assert renderer.decode(observation) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_tool_calls_of_both_styles():
    qwen = ("<think>\nI need the sum.\n</think>\n\n" + qwen_call("12 + 30")
            + '\n<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"APRIL\\"}"}\n</tool_call>')
    assert tool_calls(qwen) == [{"name": "calc", "arguments": {"expression": "12 + 30"}},
                                {"name": "search", "arguments": {"q": "APRIL"}}]  # a string's JSON is parsed
    assert tool_calls(llama_call("42 * 2")) == [{"name": "calc", "arguments": {"expression": "42 * 2"}}]
    assert tool_calls("<|python_tag|>" + llama_call("1 + 1") + "\n") == [
        {"name": "calc", "arguments": {"expression": "1 + 1"}}]
    assert tool_calls('{"name": "now"}') == [{"name": "now", "arguments": {}}]
    assert tool_calls(FINAL) == [] and tool_calls("") == []


@pytest.mark.parametrize("text, problem", [
    ('<tool_call>\n{"name": "calc", "arguments": {"expression": }}\n</tool_call>',
     r"tool call 1 .*not valid JSON"),
    (qwen_call("1") + '<tool_call>{"name": "calc", "arguments": {}', "tool call 2 .*never closed"),
    ('{"name": "calc"}</tool_call>', "closes no <tool_call>"),
    ("<tool_call><tool_call>{}</tool_call>", "another <tool_call> opens"),
    ('<tool_call>["calc"]</tool_call>', "a JSON list, not an object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no function name"),
    ('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>', "arguments of 'calc' are a JSON list"),
    ('<tool_call>{"name": "calc", "arguments": "{oops"}</tool_call>', "arguments of 'calc': not valid JSON"),
    ('{"name": "calc", "parameters": {"expression": "1 + 1"}', "the turn's tool call: not valid JSON"),
    ("<|python_tag|>brave_search.call(query='x')", "not a JSON tool call"),
])
def test_malformed_tool_calls_are_typed_errors_naming_the_problem(text, problem):
    with pytest.raises(ToolCallError, match=problem):
        tool_calls(text)


@pytest.mark.parametrize("style", sorted(STYLES))
def test_the_brokers_prompt_and_the_scorers_observations_are_the_whole_conversations_render(tmp_path, style):
    """The path a run takes: the broker renders the prompt with the task's tools (``meta["tools"]``)
    and keeps its conversation (``meta["messages"]``); the scorer answers each call with
    ``observation_ids`` from the score request alone (the response so far, its context spans). Two
    calls and a final answer: prompt + sampled + observations is the template's render of it all."""
    import numpy as np

    from april_async.model.tokenizer import chat_messages
    from april_async.scorer.actor import observation_ids
    from april_async.tasks.base import Problem
    from april_async.tasks.source import encode_prompt
    from april_async.wire import messages as m

    def ids_of(ids):
        return np.asarray(ids, dtype=np.int32)

    template, specials, added, bos, eos, call, _ = STYLES[style]
    tok = tokenizer(tmp_path, template, specials, added, bos, eos)
    problem = Problem("p", QUESTION, "calc", meta={"tools": [CALC]})
    prompt = encode_prompt(problem, tok, chat=True, system=SYSTEM)
    meta = {"tools": [CALC], "messages": chat_messages(QUESTION, SYSTEM)}
    response, context, conversation = [], [], list(meta["messages"])
    for turn, expression in enumerate(RESULTS):
        sampled = tok.encode(call(expression)) + [tok.eos_id]
        response += sampled
        req = m.ScoreRequest(sample_id=1, lease_id=turn + 1, group_id=1, prompt=ids_of(prompt),
                             response=ids_of(response), finish_reason="stop", task="calc",
                             meta=meta, turn=turn, context=list(context), takes_observation=True)
        ids = observation_ids(tok, req, RESULTS[expression])
        context.append(m.TokenSpan(len(response), len(ids)))
        response += ids
        answer = {"role": "tool", "content": RESULTS[expression]}
        conversation += [ChatRenderer(tok).assistant_message(sampled), answer]
    final = tok.encode(FINAL) + [tok.eos_id]
    conversation.append({"role": "assistant", "content": FINAL})
    whole = tok._tok.apply_chat_template(conversation, tools=[CALC], tokenize=True)["input_ids"]
    ending = tok.encode(STYLES[style][6]) if STYLES[style][6] else []
    assert prompt + response + final + ending == whole
    bare = m.ScoreRequest(sample_id=1, lease_id=1, group_id=1, prompt=ids_of(prompt),
                          response=ids_of(tok.encode(call("12 + 30"))), finish_reason="stop",
                          task="calc", meta={}, turn=0, context=[], takes_observation=True)
    with pytest.raises(ValueError, match="meta has no 'messages'"):
        observation_ids(tok, bare, "42")
