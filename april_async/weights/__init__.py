"""Moving weights between processes: the flat byte layout of a state dict (``flat``) and the
``torch.distributed`` group it is broadcast over (``group``). Shared by the learner, the
broadcaster and the generators, so no actor imports another's module."""
