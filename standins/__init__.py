"""Stand-ins for what these machines lack, for tests and tools in a checkout; never shipped (the
wheel holds ``april_async`` only).

    sglang_server  a stand-in SGLang server: SGLang's HTTP contract on the embedded torch engine
    flags          its command line, and the flags ``/standin/configure`` sets on a running one
    launch         starting and stopping that server as a process (``start_standin``), and
                   keeping unchanged ones for reuse between tests (``StandinPool``)
"""
