"""Math with a Python tool: the environment of a math task whose policy may run code (issue 45).

A turn that calls the tool ``python`` (a Qwen3-style ``<tool_call>{"name": "python", "arguments":
{"code": "..."}}</tool_call>``, or a Llama-3.1-style JSON call: ``agents.chat.tool_calls``) has each
call's code run in the sandbox (``agents.sandbox.run_python``: its own uid, no network, a scratch
directory, CPU, memory, process and time limits) and is answered with one tool message: what the
program printed, or, where a limit stopped it or it crashed, ``error: <kind>: <detail>``
(``SandboxResult.as_observation``). A malformed call, or a call of another tool, is answered with
``error: bad_call: ...`` and the conversation goes on: the policy sees its mistake. A turn that calls
nothing, a turn cut by its budget, and the last turn allowed (``meta["max_turns"]``, else the
environment's, or the broker's: ``Trajectory.last_turn``) end the conversation with the math-answer
reward of that turn's final answer (``\\boxed{}`` or ``####``, against ``meta["answer"]``).

Running a step again (the broker sends a score request again after ``score_timeout_s``) runs the
same code in a fresh sandbox, which keeps nothing between runs: a repeat has no side effect.

Use it as a scorer environment for the task's name, with the tool's schema shown to the model by
the chat template (``PYTHON_TOOL`` in the prompts' ``meta["tools"]``)::

    [scorer] environments = { math_python = "april_async.tasks.math_python:PythonToolEnvironment" }
"""

from __future__ import annotations

from april_async.agents.chat import ToolCallError, tool_calls
from april_async.agents.env import Continue, Done, Step, Trajectory
from april_async.agents.sandbox import SandboxLimits, run_python
from april_async.tasks import math_answer

TOOL_NAME = "python"
PYTHON_TOOL = {"type": "function", "function": {
    "name": TOOL_NAME,
    "description": "Run a Python 3 program in a sandbox (no network, no files outside a scratch directory, "
                   "a few seconds) and return what it prints.",
    "parameters": {"type": "object", "required": ["code"],
                   "properties": {"code": {"type": "string", "description": "The program."}}}}}
"""The tool's schema, as ``apply_chat_template(tools=...)`` takes it."""
MAX_TURNS = 4
MAX_OUTPUT_CHARS = 4000
"""The most characters of one call's output the model is shown (the rest is cut, saying so)."""


class PythonToolEnvironment:
    """The math task with a sandboxed Python tool (see the module docstring)."""

    tools = [PYTHON_TOOL]

    def __init__(self, max_turns: int = MAX_TURNS, limits: SandboxLimits | None = None):
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, not {max_turns}")
        self.max_turns = max_turns
        self.limits = limits or SandboxLimits()

    def step(self, trajectory: Trajectory) -> Step:
        text = trajectory.last_text
        limit = int(trajectory.meta.get("max_turns", self.max_turns))
        goes_on = (trajectory.finish_reason == "stop" and trajectory.turn + 1 < limit
                   and not trajectory.last_turn)
        try:
            calls = tool_calls(text)
        except ToolCallError as e:
            if not goes_on:
                return Done(math_answer.final_answer_reward(trajectory))
            return Continue({"role": "tool", "name": TOOL_NAME, "content": f"error: bad_call: {e}"})
        if not calls or not goes_on:
            return Done(math_answer.final_answer_reward(trajectory))
        return Continue({"role": "tool", "name": TOOL_NAME,
                         "content": "\n".join(self._run(call) for call in calls)})

    def _run(self, call: dict) -> str:
        code = call["arguments"].get("code")
        if call["name"] != TOOL_NAME:
            return f"error: bad_call: there is no tool {call['name']!r}; the one tool is {TOOL_NAME!r}"
        if not isinstance(code, str):
            return f"error: bad_call: {TOOL_NAME} takes its program as the string argument 'code'"
        out = run_python(code, limits=self.limits).as_observation()
        if len(out) > MAX_OUTPUT_CHARS:
            out = out[:MAX_OUTPUT_CHARS] + f"\n[output cut at {MAX_OUTPUT_CHARS} characters]"
        return out
