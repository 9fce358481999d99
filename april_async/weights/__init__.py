"""Moving weights between processes, shared by the learner, the broadcaster, the generators and the
benchmarks (so that no actor imports another's module): the flat byte layout of a state dict
(``flat``), the ``torch.distributed`` group it is broadcast over (``group``, and SGLang's recipe in
``custom_group``), the hand-off from the learner to the broadcaster (its sending half ``handoff``,
its receiving half ``handoff_recv``), a member's receiving side (``subscriber``) and where a
generator's versions come from (``link``)."""
