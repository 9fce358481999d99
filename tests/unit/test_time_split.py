"""tools/time_split.py: a run's learner time split into waiting for rollouts, training and hand-off."""

import json

import pytest

from april_async.testing.procs import load_tool


def _row(wait, train, step, reward=0.5, lens=(40.0, 900)):
    return {"wait_s": wait, "train_s": train, "step_s": step, "reward_mean": reward, "response_len_mean": lens[0],
            "response_len_max": lens[1], "tokens": 2560}


def test_the_split_leaves_out_start_up_and_adds_up_to_one(tmp_path, capsys):
    tool = load_tool("time_split")
    rows = [_row(30.0, 1.0, 1.2, 0.1), _row(8.0, 1.5, 2.0, 0.2), _row(7.0, 2.0, 2.5, 0.4, (60.0, 1400))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"half a line')
    split = tool.time_split(tool.read_metrics(tmp_path))
    assert split["steps"] == 2 and split["seconds"] == pytest.approx(19.5)
    assert (split["wait_frac"], split["train_frac"], split["handoff_frac"]) == (round(15 / 19.5, 4),
                                                                                round(3.5 / 19.5, 4), round(1 / 19.5, 4))
    assert (split["response_len_max"], split["reward_first"], split["reward_last"]) == (1400, 0.2, 0.4)
    assert tool.main([str(tmp_path), "--json", str(tmp_path / "split.json")]) == 0
    assert "wait (rollout) 76.9%, train 17.9%, hand-off 5.1%" in capsys.readouterr().out
    assert json.loads((tmp_path / "split.json").read_text()) == split
    with pytest.raises(ValueError, match="3 learner steps: none left after skipping 3"):
        tool.time_split(rows, skip=3)
