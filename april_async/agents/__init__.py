"""Multi-turn, tool-using rollouts (issue 45): a trajectory is token ids end to end, from the
prompt through every turn the policy sampled and every tool answer inserted between two turns.
``chat`` renders a conversation with the checkpoint's own chat template and turns a tool's answer
into the ids to append after the sampled ones (the template's delta for the tool message, the
sampled ids never re-tokenized), and reads the tool calls out of an assistant turn. The design is
``docs/agents.md``. Nothing here imports torch or an actor.
"""
