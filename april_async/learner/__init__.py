"""The learner side: the batch client (the learner actor itself arrives with issue 5)."""
