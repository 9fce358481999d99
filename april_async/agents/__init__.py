"""Multi-turn, tool-using rollouts (issue 45): a trajectory is token ids end to end, from the
prompt through every turn the policy sampled and every tool answer inserted between two turns.
``env`` is the environment a finished turn is stepped in (an observation for the next turn, or the
reward); ``chat`` renders a conversation with the checkpoint's own chat template, turns a tool's
answer into the ids to append after the sampled ones (the template's delta for the tool message,
the sampled ids never re-tokenized) and reads the tool calls out of an assistant turn; ``sandbox``
runs model-written Python as a tool. The design is ``docs/agents.md``. Nothing here imports torch.
"""
