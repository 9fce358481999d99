"""Stand-ins for what these machines lack, for tests and tools in a checkout; never shipped (the
wheel holds ``april_async`` only).

    sglang_server  a stand-in SGLang server: SGLang's HTTP contract on the embedded torch engine
    launch         starting and stopping that server as a process (``start_standin``), and
                   keeping unchanged ones for reuse between tests (``StandinPool``)
"""

RUNTIME_FLAGS = {"--stream-interval": 1, "--incremental-streaming-output": 0, "--weight-update-session": 0,
                 "--sglang-version": 1, "--kv-tokens": 1, "--group-timeout-s": 1, "--health-check-timeout": 1,
                 "--step-delay-s": 1}
"""The stand-in's flags that ``/standin/configure`` may set on a running server (each with the
number of values it takes): what the server reads per request or per decode step. The others
shape the process (the engine's slots and length, the checkpoint, the address, threads)."""
