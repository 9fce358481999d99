"""Inference engines shared by the generator, the warm start and the benchmarks: the engine
interface (``base``) and the embedded PyTorch engine (``torch_engine``). Nothing here imports an actor."""
