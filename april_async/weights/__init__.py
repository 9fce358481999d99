"""Moving weights between processes, shared by the learner, the broadcaster, the generators and the
benchmarks (so that no actor imports another's module): the flat byte layout of a state dict
(``flat``), the ``torch.distributed`` group it is broadcast over (``group``, and SGLang's recipe in
``custom_group``), the learner's hand-off to the broadcaster (``handoff``) and a member's receiving
side (``subscriber``)."""
