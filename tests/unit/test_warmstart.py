"""The supervised warm start, tiny: the packing, a few steps that lower the loss, a checkpoint
that loads with its tokenizer, and the evaluation."""

import json

import pytest
import torch
from pydantic import ValidationError

from april_async.warmstart import WarmStartStopped
from april_async.warmstart.config import WarmStartConfig
from april_async.warmstart.sft import (
    IGNORE,
    _pack,
    evaluate,
    held_out_problems,
    make_initial_checkpoint,
    write_initial_policy,
)
from april_async.engines.base import EngineOutput
from april_async.model.decoder import CausalLM
from april_async.model.tokenizer import CharTokenizer, load_tokenizer

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, batch_rows=4,
            seq_len=128, max_steps=40, eval_every=40, eval_problems=6, max_response_tokens=24, target_reward=None,
            lr=1e-2, warmup_steps=5, threads=1)


def test_pack_trains_on_responses_only_and_keeps_problems_apart():
    rows = [[([1, 10, 11, 20, 21, 2], 3, []), ([1, 12, 22, 2], 2, [])]]
    ids, targets, positions, mask = _pack(rows, 12)
    assert ids[0, :10].tolist() == [1, 10, 11, 20, 21, 2, 1, 12, 22, 2] and ids[0, 10:].tolist() == [0, 0]
    # position t predicts token t+1: only the response tokens (and <eos>) are targets
    assert targets[0].tolist() == [IGNORE, IGNORE, 20, 21, 2, IGNORE, IGNORE, 22, 2, IGNORE, IGNORE, IGNORE]
    assert positions[0, :10].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    m = mask[0, 0]
    assert m[4, :5].all() and not m[4, 5:].any()  # causal within the first problem
    assert m[7, 6:8].all() and not m[7, :6].any()  # the second one cannot see the first
    assert m[11].tolist() == [False] * 11 + [True]  # padding attends to itself only (no NaN rows)


def test_warm_start_lowers_the_loss_and_writes_a_loadable_checkpoint(tmp_path):
    cfg = WarmStartConfig(**TINY)
    stats = make_initial_checkpoint(tmp_path / "init", cfg)
    assert stats["steps"] == 40 and stats["stopped"] == "max_steps" and stats["params"] < 50_000
    assert stats["loss"] < 0.7 * stats["loss_first"]
    assert stats["evals"][-1]["step"] == 40 and 0.0 <= stats["reward"] <= 1.0
    model = CausalLM.from_pretrained(tmp_path / "init")
    tok = load_tokenizer(tmp_path / "init")
    assert isinstance(tok, CharTokenizer) and model.config.vocab_size == tok.vocab_size
    assert model.config.eos_token_id == tok.eos_id and model.config.num_hidden_layers == 1
    record = json.loads((tmp_path / "init" / "warmstart.json").read_text())
    assert record["config"]["hidden_size"] == 32 and record["stats"]["steps"] == 40
    result = evaluate(tmp_path / "init", held_out_problems(cfg), n=5, temperature=1.0, max_new_tokens=8)
    assert result["n"] == 5 and 0.0 <= result["reward"] <= 1.0 and 1 <= result["mean_response_len"] <= 8
    assert "samples" not in result and "samples" not in stats["evals"][-1]  # the warm start's log stays short
    each = evaluate(tmp_path / "init", held_out_problems(cfg), n=5, temperature=0.0, max_new_tokens=8,
                    per_sample=True)["samples"]  # every answer's response tokens and reward
    assert len(each) == 5 and all(1 <= n <= 8 and r in (0.0, 1.0) for n, r in each)
    assert torch.get_num_threads() >= 1


def test_warm_start_stops_at_the_target_reward(tmp_path):
    stats = make_initial_checkpoint(tmp_path, WarmStartConfig(**{**TINY, "max_steps": 10, "eval_every": 2,
                                                                  "target_reward": 0.0}))
    assert stats["stopped"] == "target_reward" and stats["steps"] == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"num_heads": 4, "num_kv_heads": 3}, "not a multiple"),
    ({"hidden_size": 36, "num_heads": 4}, "heads of even size"),
    ({"prompts": {"kind": "synthetic"}}, "no text and no reference"),
    ({"dtype": "float16"}, "dtype"),
])
def test_bad_warm_start_configs_are_refused(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        WarmStartConfig(**kwargs)


def test_a_stop_asked_for_ends_the_warm_start_between_steps_and_writes_nothing(tmp_path):
    """``april up`` asks its signal flag before every step (a Ctrl-C in the first minutes of the main
    job went unheard until the warm start's whole budget was spent)."""
    asked = []

    def stop():
        asked.append(1)
        return len(asked) > 2
    cfg = WarmStartConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_steps=50,
                          eval_problems=2, max_response_tokens=16)
    with pytest.raises(WarmStartStopped, match="after 2 steps"):
        write_initial_policy(tmp_path / "init", cfg, stop=stop)
    assert not (tmp_path / "init").exists() and not (tmp_path / "init.tmp").exists()


CALC = "april_async.tasks.addchain_calc:CalcEnvironment"


def test_pack_leaves_a_references_observations_out_of_the_targets():
    rows = [[([1, 10, 11, 20, 30, 31, 21, 2], 3, [(4, 2)])]]  # prompt 3, policy 20, observation 30 31, policy 21
    _, targets, _, _ = _pack(rows, 10)
    assert targets[0].tolist() == [IGNORE, IGNORE, 20, IGNORE, IGNORE, 21, 2, IGNORE, IGNORE, IGNORE]


def test_the_calculator_tasks_references_call_the_tool_on_half_the_problems():
    from april_async.tasks.addchain_calc import TASK, CalcEnvironment, uses_tool
    from april_async.tasks.source import PromptSource, PromptSourceConfig

    src = PromptSource(PromptSourceConfig(kind="addchain", task=TASK, seed=3))
    problems = [src.next() for _ in range(400)]
    calls = [p for p in problems if p.reference_turns is not None]
    assert all(p.task == TASK for p in problems) and 0.4 < len(calls) / len(problems) < 0.6
    assert all(uses_tool(p.prompt.strip()) == (p.reference_turns is not None) for p in problems)
    for p in calls[:20]:  # the reference's observation is what the environment answers its call
        call, observation, answer = p.reference_turns
        assert call == "calc{" + p.prompt.strip() + "}" and answer == f"#### {p.meta['answer']}"
        assert observation == CalcEnvironment().step(_trajectory(p, call)).observation
        assert p.reference == call + observation + answer
    plain = next(p for p in problems if p.reference_turns is None)
    assert plain.reference.endswith(f"#### {plain.meta['answer']}") and ")" in plain.reference


def _trajectory(p, text):
    from april_async.agents.env import Trajectory, Turn

    return Trajectory(sample_id=0, prompt_ids=[1], turns=[Turn([2], [], text)], finish_reason="stop", task=p.task,
                      meta=dict(p.meta))


def test_a_warm_start_with_an_environment_evaluates_whole_conversations(tmp_path):
    """A tiny model taught the calculator's references: its evaluations run each conversation with
    the environment (turns end at ``}``), and a policy that always calls the tool on the prompt's
    chain scores 1 on every problem: the reward is the environment's, after the observation."""
    from april_async.warmstart.sft import ToolUse, evaluate_model

    tok = CharTokenizer()
    close = tok.encode("}")[0]
    cfg = WarmStartConfig(**{**TINY, "max_steps": 4, "eval_every": 4}, prompts={"kind": "addchain",
                          "task": "addchain_calc"}, environment=CALC, turn_stop_token_ids=(close,), max_turns=3)
    stats = make_initial_checkpoint(tmp_path / "init", cfg)
    last = stats["evals"][-1]
    assert 1.0 <= last["turns_mean"] <= 3.0 and 0.0 <= last["tool_share"] <= 1.0 and 0.0 <= last["reward"] <= 1.0

    problems = held_out_problems(cfg)[:6]

    class Scripted:
        """Answers a first turn with ``calc{<the prompt's chain>}`` (cut at its ``}``: a turn stop) and
        a resumed one with ``#### <the number after '=' in what it resumes>``, end-of-sequence."""

        max_seq_len = 512

        def __init__(self):
            self.queue, self.resumes = [], []

        def active(self):
            return len(self.queue)

        def submit(self, req):
            assert close in req.stop_token_ids and tok.eos_id in req.stop_token_ids
            self.resumes.append(list(req.resume))
            if not req.resume:
                text = "calc{" + tok.decode(req.prompt).strip() + "}garbage after the stop"
                ids = tok.encode(text)
                ids = ids[:ids.index(close) + 1]
            else:
                ids = tok.encode("#### " + tok.decode(req.resume).split("= ")[1].strip()) + [tok.eos_id]
            self.queue.append(EngineOutput(req.lease_id, tokens=ids, finish="stop"))

        def step(self):
            out, self.queue = self.queue, []
            return out

    engine = Scripted()
    result = evaluate_model(None, tok, problems, temperature=1.0, max_new_tokens=64,
                            tools=ToolUse(CALC, (close,), 3), engine=engine, per_sample=True)
    assert result["reward"] == 1.0 and result["turns_mean"] == 2.0 and result["tool_share"] == 1.0, result
    for p in problems:  # the second turn resumed after the call and the observation, as the scorer encodes it
        chain, answer = p.prompt.strip(), p.meta["answer"]
        assert tok.encode(f"calc{{{chain}}}") + tok.encode(f"\n= {answer}\n") in engine.resumes
    single = evaluate_model(None, tok, problems, temperature=1.0, max_new_tokens=64, engine=Scripted(),
                            tools=ToolUse(CALC, (close,), 1))  # one turn allowed: the call is never answered
    assert single["reward"] == 0.0 and single["turns_mean"] == 1.0


def test_warm_start_tool_settings_need_an_environment():
    with pytest.raises(ValidationError, match="environment too"):
        WarmStartConfig(turn_stop_token_ids=(51,))
    with pytest.raises(ValidationError, match="package.module:Name"):
        WarmStartConfig(environment="no_colon")
