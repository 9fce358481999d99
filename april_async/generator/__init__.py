"""The generator actor (``actor``); its engines are ``april_async.engines``'s, made by
``engines.factory.build_engine``."""
