"""The broadcaster: the newest policy version, fanned out to the generators over a
``torch.distributed`` group. The round logic is a pure planner (``rounds``); the actor (``actor``) does
the I/O. The flat layout, the group and both ends of the hand-off live in ``april_async.weights``."""
