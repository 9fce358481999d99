"""``plan_step``: how a batch's rows are dealt out over minibatches, ranks and micro-batches."""

from hypothesis import given
from hypothesis import strategies as st

from april_async.learner.step import plan_step


@given(tokens=st.lists(st.integers(1, 64), min_size=1, max_size=40), minibatches=st.integers(1, 4),
       ranks=st.integers(1, 4), budget=st.none() | st.integers(1, 256))
def test_every_row_once_in_lockstep_within_the_budget_and_balanced(tokens, minibatches, ranks, budget):
    plan = plan_step(tokens, minibatches=minibatches, ranks=ranks, max_tokens=budget)
    assert len(plan) == ranks
    steps = len(plan[0])
    assert all(len(per_rank) == steps for per_rank in plan)  # every rank takes every optimizer step
    assert steps == min(minibatches, len(tokens))
    seen = []
    for k in range(steps):
        counts = {len(per_rank[k]) for per_rank in plan}
        assert len(counts) == 1 and counts.pop() >= 1  # the same number of forwards on every rank
        rows = [i for per_rank in plan for mb in per_rank[k] for i in mb]
        assert rows and (not seen or min(rows) > max(seen))  # minibatches keep the batch's order
        seen += rows
        loads = [sum(tokens[i] for mb in per_rank[k] for i in mb) for per_rank in plan]
        assert max(loads) - min(loads) <= max(tokens[i] for i in rows)  # balanced to within one row
        for per_rank in plan:
            for mb in per_rank[k]:
                if budget is not None and len(mb) > 1:
                    assert len(mb) * max(tokens[i] for i in mb) <= budget
    assert sorted(seen) == list(range(len(tokens)))
