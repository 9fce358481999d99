"""The generator actor (``actor``) and the engines only it uses (``scripted``, ``sglang_engine``); the
embedded PyTorch engine is shared, in ``april_async.engines``."""
