"""Inference engines shared by the generator, the warm start and the benchmarks: the engine base
and its capabilities (``base``), their settings (``config``, no torch), the embedded PyTorch engine
(``torch_engine``), SGLang servers over HTTP (``sglang_engine``), the scripted test engine
(``scripted``) and the factory that makes the one a config names (``factory``). Nothing here imports
an actor."""
