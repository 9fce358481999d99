"""The broadcaster: the newest policy version, fanned out to the generators over a
``torch.distributed`` group (``actor``). The flat layout and the group membership it uses live
in ``april_async.weights``, shared with the learner and the generators."""
