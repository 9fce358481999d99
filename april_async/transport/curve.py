"""CurveZMQ on the hubs and their peers: who may talk to the broker and the broadcaster.

The rule (``proto/SPEC.md``, *Security*):

- With keys (``link.keys``, or the environment's ``APRIL_KEYS``), every hub is a CURVE server
  and every peer a CURVE client: traffic is encrypted, and a ZAP handler admits only clients
  whose public key is in the keys directory's ``authorized/``. A peer without keys, with a key
  not listed, or expecting another server key is refused at the handshake. The hub logs each
  refusal (``auth_refused``, with the reason) and counts it; so does the refused peer, once per
  streak of refusals (``REFUSED_BY_HUB`` says why, as the peer sees it).
- Without keys sockets are open, and a hub refuses to bind anything but a loopback address
  (``127.0.0.0/8``, ``localhost``, ``[::1]``, ``ipc://``, ``inproc://``) unless
  ``link.allow_open`` says the network is trusted. Loopback runs (``april up`` on one machine,
  the tests) stay open by default: there the operating system's users are the boundary.

Two layouts. ``april keys DIR`` makes one directory for a run whose hosts all trust each other
(or one machine)::

    DIR/server.key, DIR/server.key_secret     the hubs' key pair
    DIR/client.key, DIR/client.key_secret     the actors' key pair (shared by every host)
    DIR/authorized/client.key                 public keys the hubs admit (add others' here)

Copy it to every host and point ``APRIL_KEYS`` at it. Every host then holds the hubs' secret
(any host could pose as the hub) and the one client key (no host can be locked out alone).

``april keys DIR --hosts HEAD,NAME,...`` makes one directory per host instead; the first name
is the head, the host that runs the hubs (the broker and the broadcaster)::

    DIR/HEAD/server.key, server.key_secret    the hubs' key pair: the secret is on the head only
    DIR/HEAD/client.key, client.key_secret    the head's own actors' key pair
    DIR/HEAD/authorized/NAME.key              every host's client public key, the head's included
    DIR/NAME/server.key                       a member: the hubs' public key, to know the hub by
    DIR/NAME/client.key, client.key_secret    the member's own key pair

    DIR/HEAD/roles.toml                       the roles each host's key may claim in ``hello``

Copy ``DIR/NAME/`` to host NAME only and point its ``APRIL_KEYS`` there (``launch/cluster.sh``
with ``APRIL_KEYS=DIR`` gives each host ``DIR/NAME``: keep that path). A member's directory
cannot serve a hub (``KeysError``): the hub's secret stays on the head. To lock one host out,
delete ``authorized/NAME.key`` from the head's directory and restart the hubs: pyzmq's
``ThreadAuthenticator`` reads ``authorized/`` when a hub is set up (``configure_curve``) and
never again, and a connection already made is not checked again either.

Roles. In the head's directory ``roles.toml`` says which roles each host's key may claim: the head
every actor's role, any other host ``generator`` and ``scorer`` unless ``april keys --roles
NAME=ROLE,...`` says otherwise (or the file is edited; it is read when a hub is set up, like
``authorized/``). A hub with that file learns each message's client key from CurveZMQ (the ZAP
handler's User-Id: the key's Z85 text) and refuses (``refused``) a ``hello`` claiming a role that
key may not claim, and any later message of that sender under another key (``KeyRoles``), so a
generator host cannot say hello as the learner, nor speak in the learner's name. A key of
``authorized/`` with no line in the file may claim no role. Without the file (the one-directory
layout, whose one client key every host shares) any admitted key may claim any role.

Secret files are written mode 0600 (host directories 0700). The weights group's rendezvous runs
over CurveZMQ too (``weights.zstore``), but the gloo/NCCL traffic itself is not encrypted, and
the TCPStore that SGLang servers' weight-update group meets on is open to whoever reaches its port
(``proto/SPEC.md``, known weaknesses).
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import json
import os
import shutil
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from april_async.wire.roles import ACTORS

SERVER, CLIENT, AUTHORIZED = "server", "client", "authorized"
ROLES_FILE = "roles.toml"
MEMBER_ROLES = ("generator", "scorer")
"""The roles a host other than the head may claim unless ``april keys --roles`` says otherwise."""
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
    """Write a new one-directory keys layout (refusing to overwrite one); returns the files written."""
    directory = Path(directory)
    if (directory / f"{SERVER}.key").exists() or (directory / f"{CLIENT}.key").exists():
        raise KeysError(f"{directory} already holds keys: remove them first, or use another directory")
    directory.mkdir(parents=True, exist_ok=True)
    written = _pair(directory, SERVER) + _pair(directory, CLIENT)
    (directory / AUTHORIZED).mkdir(exist_ok=True)
    written.append(_copy(directory / f"{CLIENT}.key", directory / AUTHORIZED / f"{CLIENT}.key"))
    return written


def check_hosts(names: list[str]) -> list[str]:
    """The names of ``--hosts``, each of which becomes a directory and a file ``authorized/NAME.key``:
    a name that is empty, hidden, holds a path separator, a space or a control character, or that
    repeats another (ignoring case, as a case-insensitive filesystem would) is refused."""
    if not names:
        raise KeysError("--hosts names no host: give the head first, e.g. --hosts node1,node2")
    seen: dict[str, str] = {}
    for name in names:
        if (not name or name.startswith(".") or any(c in name for c in "/\\")
                or any(c.isspace() or not c.isprintable() for c in name)):
            raise KeysError(f"host name {name!r} cannot name a keys directory: it must be non-empty, must not "
                            f"start with '.', and must hold no path separator, space or control character")
        if name.casefold() in seen:
            raise KeysError(f"host name {name!r} is given twice (as {seen[name.casefold()]!r}): one name per host")
        seen[name.casefold()] = name
    return list(names)


def host_roles(hosts: list[str], roles: dict[str, list[str]] | None = None) -> dict[str, tuple[str, ...]]:
    """The roles each host's key may claim: the head (the first) every actor's, the others
    ``MEMBER_ROLES``, except where ``roles`` (host → roles, from ``--roles``) names a host. A host
    ``roles`` names that is not one of ``hosts``, or a role that is no actor's, is refused."""
    out = {name: ACTORS if i == 0 else MEMBER_ROLES for i, name in enumerate(hosts)}
    for name, claimed in (roles or {}).items():
        if name not in out:
            raise KeysError(f"--roles names host {name!r}, which is not one of --hosts ({', '.join(hosts)})")
        bad = [r for r in claimed if r not in ACTORS]
        if bad or not claimed:
            raise KeysError(f"--roles {name}={','.join(claimed)}: {bad[0] if bad else 'nothing'!r} is no role a "
                            f"host may claim (one or more of {', '.join(ACTORS)})")
        out[name] = tuple(r for r in ACTORS if r in claimed)
    return out


def _write_roles(directory: Path, table: dict[str, tuple[str, ...]]) -> Path:
    path = directory / ROLES_FILE
    lines = ["# The roles each host's client key (authorized/NAME.key) may claim in hello: a hub refuses any",
             "# other (proto/SPEC.md, Security). Read when a hub starts: edit, then restart the broker and the",
             "# broadcaster. A key with no line here may claim no role.", "[hosts]"]
    lines += [f"{json.dumps(name)} = {json.dumps(list(roles))}" for name, roles in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def make_host_keys(directory: Path, hosts: list[str],
                   roles: dict[str, list[str]] | None = None) -> dict[str, list[Path]]:
    """Write one keys directory per host, ``DIR/NAME/``, the first host being the head; returns the
    files written for each host. Each host gets a client key of its own, so that one can be locked
    out alone, and only the head gets the hubs' secret, so that no other host can pose as the hub.
    The head's ``roles.toml`` binds each host's key to the roles it may claim (``host_roles``)."""
    hosts, directory = check_hosts(list(hosts)), Path(directory)
    table = host_roles(hosts, roles)
    _refuse_existing(directory, hosts)
    head = hosts[0]
    head_dir = _private_dir(directory / head)
    written = {name: [] for name in hosts}
    written[head] += _pair(head_dir, SERVER)
    authorized = head_dir / AUTHORIZED
    authorized.mkdir()
    for name in hosts:
        own = _private_dir(directory / name)
        if name != head:
            written[name].append(_copy(head_dir / f"{SERVER}.key", own / f"{SERVER}.key"))
        public, secret = _pair(own, CLIENT)
        written[name] += [public, secret]
        written[head].append(_copy(public, authorized / f"{name}.key"))
    written[head].append(_write_roles(head_dir, table))
    return written


class KeyRoles:
    """Which roles each admitted client key may claim (a hub's ``roles.toml``, read by ``load_roles``).
    Keys are named by the ZAP handler's User-Id for them, their Z85 text."""

    def __init__(self, path: Path, hosts: dict[str, str], roles: dict[str, frozenset[str]]):
        self.path = path
        self.hosts = hosts  # key (Z85) -> host name (its file in authorized/)
        self.roles = roles  # host name -> the roles it may claim

    def host(self, key: str | None) -> str:
        return self.hosts.get(key or "", "(a key not in authorized/)")

    def refusal(self, key: str | None, role: str) -> str | None:
        """Why a ``hello`` claiming ``role`` under client ``key`` is refused, or None."""
        host = self.host(key)
        allowed = self.roles.get(host, frozenset())
        if role in allowed:
            return None
        may = ", ".join(r for r in ACTORS if r in allowed) or "no role"
        return (f"host {host!r} may not claim the role {role!r}: its key may claim {may} ({self.path}; "
                f"'april keys --roles' writes it, and the hubs read it when they start)")


def load_roles(keys: Path) -> KeyRoles | None:
    """The head's ``roles.toml`` with the keys of its ``authorized/``, or None when there is no such
    file (any admitted key may then claim any role). A file that is not TOML, or names a role that is
    no actor's, is a ``KeysError``."""
    path = Path(keys) / ROLES_FILE
    if not path.is_file():
        return None
    try:
        table = tomllib.loads(path.read_text()).get("hosts", {})
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise KeysError(f"{path} is not a roles file: {e}") from None
    roles = {}
    for host, claimed in table.items():
        if not isinstance(claimed, list) or any(r not in ACTORS for r in claimed):
            raise KeysError(f"{path}: host {host!r} = {claimed!r}: a list of roles is expected, each one of "
                            f"{', '.join(ACTORS)}")
        roles[host] = frozenset(claimed)
    hosts = {}
    for public in sorted(_authorized(keys).glob("*.key")):
        key, _ = _load(public.parent, public.stem, secret=False)
        hosts[key.decode()] = public.stem
    return KeyRoles(path, hosts, roles)


def _refuse_existing(directory: Path, hosts: list[str]) -> None:
    """Keys are never overwritten (a host would silently lose the key its hub admits), nor mixed
    with another layout or run in one directory (which head's ``authorized/`` would count?)."""
    if directory.exists() and any(directory.iterdir()):
        raise KeysError(f"{directory} is not empty: 'april keys DIR --hosts' writes a new directory, DIR/NAME/ per "
                        f"host; use another directory")


def _private_dir(path: Path) -> Path:
    """A directory only its owner can read: the secret files written into it are never exposed,
    not even between their creation and their chmod."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _pair(directory: Path, name: str) -> list[Path]:
    """Write ``name.key`` and ``name.key_secret`` (mode 0600) in ``directory``."""
    public, secret = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret, 0o600)
    return [Path(public), Path(secret)]


def _copy(source: Path, target: Path) -> Path:
    return Path(shutil.copy(source, target))


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


_authenticators: dict[int, ThreadAuthenticator] = {}  # one ZAP handler per context


def _zap_domain(allowed: str) -> str:
    """One ZAP domain per ``authorized/`` directory, so that hubs of one process (the tests, a
    process that serves two runs) may each admit their own list; hashed because libzmq caps a
    domain's length."""
    return f"{ZAP_DOMAIN}-{hashlib.sha256(allowed.encode()).hexdigest()[:16]}"


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``sock`` to ``endpoint`` (a port of 0: a free one) and return the address bound. A failure
    is ZeroMQ's ``ZMQError``, for the caller to name in its own terms."""
    if endpoint.endswith(":0"):
        sock.bind_to_random_port(endpoint.rsplit(":", 1)[0])
    else:
        sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def serve(sock: zmq.Socket, ctx: zmq.Context, keys: Path | None, bind: str, *, allow_open: bool) -> bool:
    """Make ``sock`` (before it binds ``bind``) a CURVE server when there are keys; refuse an open
    non-loopback bind. True when the socket is secured. Every call reads ``authorized/`` afresh,
    so that a hub set up again (a restart) admits exactly the keys listed then."""
    if keys is None:
        if not is_loopback(bind) and not allow_open:
            raise KeysError(f"{bind} is reachable from other hosts and no keys are set: make them with "
                            f"'april keys DIR' and set APRIL_KEYS=DIR (or link.keys), or set link.allow_open "
                            f"on a trusted network")
        return False
    _refuse_member(keys)
    public, secret = _load(keys, SERVER, secret=True)
    allowed = str(_authorized(keys).resolve())
    auth = _authenticators.get(id(ctx))
    if auth is None:
        auth = _authenticators[id(ctx)] = ThreadAuthenticator(ctx)
        auth.start()
    domain = _zap_domain(allowed)
    auth.configure_curve(domain=domain, location=allowed)  # reads the directory now, and only now
    sock.curve_secretkey, sock.curve_publickey = secret, public
    sock.zap_domain = domain.encode()
    sock.curve_server = True
    return True


def _refuse_member(keys: Path) -> None:
    """A member's directory (``april keys --hosts``) has the hubs' public key but not their secret,
    by design: say that, rather than that a file is missing, so that nobody copies the secret over."""
    keys = Path(keys)
    if (keys / f"{SERVER}.key").is_file() and not (keys / f"{SERVER}.key_secret").exists():
        raise KeysError(f"keys directory {str(keys)!r} is a member's, not the head's: it has server.key but not "
                        f"server.key_secret, which stays on the head. Serve the hubs (broker, broadcaster) on the "
                        f"head, with APRIL_KEYS at the head's directory (the first of 'april keys DIR --hosts')")


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
"""Why the hub refused a handshake, by monitor event, as the hub sees it."""

REFUSED_BY_HUB = {
    # libzmq >= 4.3: the hub's ZAP handler said no and the hub sent an ERROR command.
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the hub refused this peer's key (it is not in the hub's authorized/)",
    # The hub dropped the connection mid-handshake: it could not read our HELLO, which was
    # encrypted for another server key.
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed: the hub hung up (is its server key another one?)",
}
"""Why a hub refused this peer, by monitor event, as the peer sees it (see ``refused_by_hub``)."""


def refused_by_hub(event: int, value: int, *, secure: bool) -> str:
    """The reason a peer gives for a handshake its hub refused: a mechanism mismatch means that
    one side has keys and the other none, and the peer knows which side it is."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value != zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return f"handshake failed (protocol error {value:#x})"
        if secure:
            return "handshake failed (no CURVE: the hub has no keys)"
        return "handshake failed (no CURVE: the hub has keys and this peer has none; set APRIL_KEYS)"
    return REFUSED_BY_HUB.get(event, "handshake failed")


HANDSHAKE_FAILED = sum(REFUSALS)
"""The monitor events of a refused handshake (either side)."""
REFUSAL_LOG_EVERY_S = 10.0
"""A server logs a refused handshake at most this often per reason (ZeroMQ retries every 100 ms)."""


class HandshakeMonitor:
    """The handshake events of one socket (a ZeroMQ socket monitor), read without waiting.

    Every socket that must learn of refused handshakes has one: a hub or the rendezvous store
    (a server: whom it refused), a peer or a store client (a client: that it was refused). Made
    before the socket connects or binds; ``close`` before the socket closes."""

    _ids = itertools.count()  # a fresh inproc address per monitor: pyzmq's default reuses the socket's fd

    def __init__(self, sock: zmq.Socket, events: int = HANDSHAKE_FAILED):
        self.sock = sock
        self.socket = sock.get_monitor_socket(events, addr=f"inproc://april-handshakes-{next(self._ids)}")

    def events(self) -> Iterator[dict]:
        """The events since the last call (``event``, ``value``, ``endpoint``), oldest first."""
        from zmq.utils.monitor import recv_monitor_message

        while self.socket.poll(0):
            yield recv_monitor_message(self.socket)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.socket.close(linger=0)


class RefusalLog:
    """A server's account of the handshakes it refused: every one counted, one ``auth_refused``
    line per reason every ``REFUSAL_LOG_EVERY_S`` (with how many went unlogged since)."""

    def __init__(self, log, clock: Callable[[], float]):
        self.log, self.clock = log, clock
        self.count = 0
        self._lines: dict[str, tuple[float, int]] = {}  # reason -> (last logged, refusals since)

    def note(self, event: dict) -> None:
        self.count += 1
        reason = REFUSALS.get(event["event"], "handshake failed")
        last, since = self._lines.get(reason, (float("-inf"), 0))
        now = self.clock()
        if now - last < REFUSAL_LOG_EVERY_S:
            self._lines[reason] = (last, since + 1)
            return
        self._lines[reason] = (now, 0)
        self.log.warning("auth_refused", reason=reason, detail=str(event["value"]),
                         endpoint=event["endpoint"].decode(errors="replace"), since_last_line=since,
                         refused=self.count)

