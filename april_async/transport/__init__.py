"""ZeroMQ transport: the broker's ROUTER (``Hub``) and every actor's DEALER (``Peer``).

Sockets live here and nowhere else; message building and parsing live in ``april_async.wire``.
"""
