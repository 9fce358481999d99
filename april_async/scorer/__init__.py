"""The scorer actor: rewards finished samples with a task's reward function."""
