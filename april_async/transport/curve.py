"""CurveZMQ on the hubs and their peers: who may talk to the broker and the broadcaster.

The rule (``proto/SPEC.md``, *Security*):

- With keys (``link.keys``, or the environment's ``APRIL_KEYS``), every hub is a CURVE server
  and every peer a CURVE client: traffic is encrypted, and a ZAP handler admits only clients
  whose public key is in the keys directory's ``authorized/``. A peer without keys, with a key
  not listed, or expecting another server key is refused at the handshake; the hub logs each
  refusal (``auth_refused``, with the reason) and counts it.
- Without keys sockets are open, and a hub refuses to bind anything but a loopback address
  (``127.0.0.0/8``, ``localhost``, ``[::1]``, ``ipc://``, ``inproc://``) unless
  ``link.allow_open`` says the network is trusted. Loopback runs (``april up`` on one machine,
  the tests) stay open by default: there the operating system's users are the boundary.

``april keys DIR`` makes a keys directory::

    DIR/server.key, DIR/server.key_secret     the hubs' key pair
    DIR/client.key, DIR/client.key_secret     the actors' key pair
    DIR/authorized/client.key                 public keys the hubs admit (add others' here)

Copy it to every host of a run and point ``APRIL_KEYS`` (or ``[run] keys``) at it. The secret
files are written mode 0600. torch.distributed's TCPStore and gloo/NCCL traffic between the
broadcaster and the generators are not covered by CurveZMQ.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER, CLIENT, AUTHORIZED = "server", "client", "authorized"
ZAP_DOMAIN = "april"


class KeysError(ValueError):
    """A keys directory that is missing, incomplete or unreadable, or an open bind refused."""


def is_loopback(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint can only be reached from this machine."""
    scheme = endpoint.split("://", 1)[0]
    if scheme in ("ipc", "inproc"):
        return True
    host = urlsplit(endpoint.replace("tcp://", "http://", 1)).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name: reachable from elsewhere
        return False


def make_keys(directory: Path) -> list[Path]:
    """Write a new keys directory (refusing to overwrite one); returns the files written."""
    directory = Path(directory)
    if (directory / f"{SERVER}.key").exists() or (directory / f"{CLIENT}.key").exists():
        raise KeysError(f"{directory} already holds keys: remove them first, or use another directory")
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in (SERVER, CLIENT):
        public, secret = zmq.auth.create_certificates(str(directory), name)
        os.chmod(secret, 0o600)
        written += [Path(public), Path(secret)]
    (directory / AUTHORIZED).mkdir(exist_ok=True)
    written.append(Path(shutil.copy(directory / f"{CLIENT}.key", directory / AUTHORIZED / f"{CLIENT}.key")))
    return written


def _load(directory: Path, name: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    path = Path(directory) / (f"{name}.key_secret" if secret else f"{name}.key")
    if not path.is_file():
        raise KeysError(f"keys directory {str(directory)!r} has no {path.name} (make one with: april keys DIR)")
    try:
        public, private = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise KeysError(f"{path} is not a CurveZMQ certificate: {e}") from None
    return public, private


def _authorized(directory: Path) -> Path:
    path = Path(directory) / AUTHORIZED
    if not path.is_dir() or not any(path.glob("*.key")):
        raise KeysError(f"keys directory {str(directory)!r} admits nobody: {path} holds no public keys")
    return path


_authenticators: dict[int, tuple[ThreadAuthenticator, str]] = {}  # one ZAP handler per context


def serve(sock: zmq.Socket, ctx: zmq.Context, keys: Path | None, bind: str, *, allow_open: bool) -> bool:
    """Make ``sock`` (before it binds ``bind``) a CURVE server when there are keys; refuse an open
    non-loopback bind. True when the socket is secured."""
    if keys is None:
        if not is_loopback(bind) and not allow_open:
            raise KeysError(f"{bind} is reachable from other hosts and no keys are set: make them with "
                            f"'april keys DIR' and set APRIL_KEYS=DIR (or link.keys), or set link.allow_open "
                            f"on a trusted network")
        return False
    public, secret = _load(keys, SERVER, secret=True)
    allowed = str(_authorized(keys).resolve())
    auth, location = _authenticators.get(id(ctx), (None, None))
    if auth is None:
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain=ZAP_DOMAIN, location=allowed)
        _authenticators[id(ctx)] = (auth, allowed)
    elif location != allowed:
        raise KeysError(f"this process already serves keys from {location}; one keys directory per process")
    sock.curve_secretkey, sock.curve_publickey = secret, public
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.curve_server = True
    return True


def connect(sock: zmq.Socket, keys: Path | None) -> bool:
    """Make ``sock`` (before it connects) a CURVE client of the hubs when there are keys."""
    if keys is None:
        return False
    public, secret = _load(keys, CLIENT, secret=True)
    server_public, _ = _load(keys, SERVER, secret=False)
    sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, server_public
    return True


REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key not admitted",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (no CURVE, or another server key)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
}
