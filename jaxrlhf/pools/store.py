"""The rollout store: Redis streams between the actor and critic pools.

Each direction is one stream (``NS:RUN:rollouts`` actor -> critic, ``NS:RUN:scores`` critic ->
actor) read through a consumer group, plus an index hash (batch id -> entry id):

* publishing is idempotent: a Lua script adds the entry only if the index has no entry for
  that batch id (a restarted producer that publishes batch ``b`` again is a no-op), so a
  batch id names exactly one entry, and foreign entries (``XADD *`` by someone else) cannot
  break the producer;
* back-pressure: the producer waits while the group's unread count (``lag``) is at
  ``max_queue``;
* acknowledgements: a consumer acks an entry only once a checkpoint that includes its effect
  is on disk (:meth:`Inbox.ack_through`); a consumer that dies re-reads its own pending
  entries on restart (and ``XAUTOCLAIM`` takes over those of a consumer gone for good), and
  skips batch ids its checkpoint already covers — exactly-once per batch id;
* retention: entries are trimmed (``XTRIM MINID``) only below both the group's oldest unacked
  entry and what the producer may still need to read back (the actor re-reads rollouts it
  published when it restarts);
* an unreachable Redis is retried with exponential back-off and one line per attempt, up to
  ``redis_wait_s``, then :class:`Unreachable` says what to check; an answer that retrying
  cannot change (wrong password, out of memory, an evicting memory policy) is a
  :class:`StoreError` at once.
"""

from __future__ import annotations

import enum
import ipaddress
import math
import os
import time
import urllib.parse
from typing import Callable, Optional

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from jaxrlhf.config import ConfigError
from jaxrlhf.pools import wire

DEFAULT_URL = "redis://127.0.0.1:6379/0"
URL_ENV, PASSWORD_ENV = "JAXRLHF_REDIS_URL", "JAXRLHF_REDIS_PASSWORD"

# KEYS: stream, index.  ARGV: batch id, then field/value pairs.  Returns {added, entry id}.
_PUBLISH = """
local have = redis.call('HGET', KEYS[2], ARGV[1])
if have then return {0, have} end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('HSET', KEYS[2], ARGV[1], id)
return {1, id}
"""


class Published(enum.Enum):
  """What :meth:`Store.publish` did.  ``PRESENT`` is not a failure: the batch id already names
  an entry — this producer's, published before a restart, or by this very call when Redis
  ran the script and the connection dropped before its reply (the retry then finds it)."""

  ADDED = "added"
  PRESENT = "present"
  STOPPED = "stopped"  # should_stop() said stop while the queue was full: nothing published

  @property
  def published(self) -> bool:
    return self is not Published.STOPPED


class Unreachable(RuntimeError):
  """Redis stayed unreachable for longer than ``pools.redis_wait_s``."""


class PeerTimeout(RuntimeError):
  """The other pool sent nothing for longer than ``pools.peer_wait_s``."""


class StoreError(RuntimeError):
  """Redis answered, and the answer means this run cannot go on as configured (a wrong
  password, out of memory, an evicting memory policy): retrying would not help."""


# ---------------------------------------------------------------------------- addressing


def settings(url: str = "") -> tuple[str, Optional[str]]:
  """``(url, password)``: the flag/config URL, else ``$JAXRLHF_REDIS_URL``, else loopback;
  the password from ``$JAXRLHF_REDIS_PASSWORD`` only.  Refuses unsafe addresses."""
  url = url or os.environ.get(URL_ENV, "") or DEFAULT_URL
  password = os.environ.get(PASSWORD_ENV) or None
  check_address(url, password)
  return url, password


def is_loopback(host: str) -> bool:
  if host in ("localhost",):
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


# Query-string keys redis-py reads as credentials (redis.connection.parse_url passes every
# query key on to the connection).
SECRET_KEYS = ("password",)


def redact(url: str) -> str:
  """``url`` fit to print or save: no user part, no query values (``?k=***``)."""
  try:
    p = urllib.parse.urlsplit(url)
    host = p.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{p.port}" if p.port else "")
  except ValueError:
    return "<unparsable redis url>"
  query = "&".join(f"{k}=***" for k, _ in urllib.parse.parse_qsl(p.query, keep_blank_values=True))
  return urllib.parse.urlunsplit((p.scheme, netloc, p.path, query, ""))


def check_url(url: str) -> None:
  """ConfigError for a URL that is not redis:// / rediss:// / unix:// or that carries a
  credential anywhere (user part or query string): URLs are printed and saved with the
  config.  Every message shows the URL redacted."""
  try:
    parsed = urllib.parse.urlsplit(url)
    parsed.port  # noqa: B018 - raises on a bad port
  except ValueError as e:
    raise ConfigError(f"redis url {redact(url)}: {e}; use redis://HOST:PORT/DB") from None
  if parsed.scheme not in ("redis", "rediss", "unix"):
    raise ConfigError(f"redis url {redact(url)}: use redis://HOST:PORT/DB (or rediss://, "
                      "unix://)")
  keys = {k.lower() for k, _ in urllib.parse.parse_qsl(parsed.query, keep_blank_values=True)}
  if parsed.password or keys & set(SECRET_KEYS):
    raise ConfigError(f"redis url {redact(url)}: do not put credentials in the URL (user part "
                      f"or ?password=); set ${PASSWORD_ENV} instead")


def check_address(url: str, password: Optional[str]) -> None:
  """:func:`check_url`, and for an address off this machine: a password and TLS."""
  check_url(url)
  parsed = urllib.parse.urlsplit(url)
  if parsed.scheme == "unix" or is_loopback(parsed.hostname or ""):
    return
  if not password:
    raise ConfigError(
        f"redis url {redact(url)} is not on this machine (loopback) and no password is set; "
        f"rollouts and weights-derived data would cross the network unauthenticated. Set "
        f"${PASSWORD_ENV} (and requirepass on the server), or use redis://127.0.0.1:PORT")
  if parsed.scheme != "rediss":
    raise ConfigError(
        f"redis url {redact(url)} is not on this machine: the password and the rollouts "
        f"would cross the network in clear text. Use rediss://HOST:PORT/DB (TLS; the server's "
        f"certificate is checked, ?ssl_ca_certs=FILE names the CA; ?ssl_cert_reqs=none turns "
        f"the check off, explicitly)")


def entry_key(entry_id) -> tuple[int, int]:
  """A stream entry id ``MS-SEQ`` as a comparable pair."""
  if isinstance(entry_id, bytes):
    entry_id = entry_id.decode()
  ms, _, seq = entry_id.partition("-")
  return int(ms), int(seq or 0)


# ------------------------------------------------------------------------------- the store


class Store:
  """One Redis connection with retry-with-back-off around every call."""

  def __init__(self, url: str, password: Optional[str] = None, *, wait_s: float = 300.0,
               log: Callable[[str], None] = print, socket_timeout: float = 5.0,
               claim_idle_ms: int = 60_000):
    check_address(url, password)
    parsed = urllib.parse.urlsplit(url)
    self.where = (parsed.path if parsed.scheme == "unix"
                  else f"{parsed.hostname}:{parsed.port or 6379}")
    self.url = redact(url)
    self.wait_s = wait_s
    self.log = log
    self.claim_idle_ms = claim_idle_ms
    # Our own retry loop below (with its messages) replaces redis-py's silent one.
    self.r = redis.Redis.from_url(url, password=password, socket_timeout=socket_timeout,
                                  socket_connect_timeout=socket_timeout,
                                  retry=Retry(NoBackoff(), 0))
    self._publish = self.r.register_script(_PUBLISH)
    self.interrupted = False  # a call failed and was retried since the flag was last cleared

  def call(self, what: str, fn, *args, **kwargs):
    t0 = time.monotonic()
    delay, attempts = 0.1, 0
    while True:
      try:
        out = fn(*args, **kwargs)
      except redis.AuthenticationError as e:  # a ConnectionError to redis-py; not to us
        raise StoreError(
            f"redis at {self.where} refused authentication ({e}). Set ${PASSWORD_ENV} to the "
            f"server's requirepass (it is read from the environment only)") from None
      except redis.exceptions.OutOfMemoryError as e:
        raise StoreError(
            f"redis at {self.where} is out of memory ({what}: {e}). Raise its maxmemory (CONFIG "
            f"SET maxmemory ...) or give the run its own server; keep maxmemory-policy "
            f"noeviction (an evicting policy drops the streams' index and loses batches). The "
            f"streams hold about (pools.max_queue + pools.max_staleness + 2) batches per "
            f"direction") from None
      except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as e:
        attempts += 1
        waited = time.monotonic() - t0
        if waited >= self.wait_s:
          raise Unreachable(
              f"redis at {self.where} has been unreachable for {waited:.0f}s ({what}: "
              f"{type(e).__name__}: {e}). Start redis-server there, or point --redis_url / "
              f"${URL_ENV} at a running one (${PASSWORD_ENV} if it needs a password); "
              f"pools.redis_wait_s sets how long to keep retrying") from None
        self.log(f"pools: redis at {self.where} unreachable ({type(e).__name__}: {e}); "
                 f"{what}: retry {attempts} in {delay:.1f}s ({waited:.1f}s of "
                 f"{self.wait_s:.0f}s waited)")
        self.interrupted = True
        time.sleep(delay)
        delay = min(delay * 2, 5.0)
        continue
      if attempts:
        self.log(f"pools: redis at {self.where} reachable again after "
                 f"{time.monotonic() - t0:.1f}s; {what} done")
      return out

  def check_server(self) -> None:
    """At start-up: the server's memory policy must never evict our keys.  An ``allkeys-*``
    policy can drop the streams or their index under memory pressure, and a consumer would
    then read genuine entries as forged; refused before anything is consumed."""
    try:
      policy = self.call("CONFIG GET", self.r.config_get, "maxmemory-policy")
    except redis.ResponseError:
      return  # CONFIG is disabled (managed Redis): nothing to check here
    policy = policy.get("maxmemory-policy", "noeviction")
    if policy.startswith("allkeys-"):
      raise StoreError(
          f"redis at {self.where} has maxmemory-policy {policy}: it may evict the pools' "
          f"streams or their index and lose batches. Use maxmemory-policy noeviction (or a "
          f"volatile-* policy: the pools' keys have no TTL)")

  def evicted(self) -> int:
    """Keys the server has evicted since it started (0 if it will not say)."""
    try:
      return int(self.call("INFO", self.r.info, "stats").get("evicted_keys", 0))
    except redis.ResponseError:
      return 0

  # ---------------------------------------------------------------------------- small ops
  def get_str(self, key: str) -> Optional[str]:
    v = self.call("GET", self.r.get, key)
    return None if v is None else v.decode()

  def set_str(self, key: str, value: str) -> None:
    self.call("SET", self.r.set, key, value)

  def ensure_group(self, stream: str, group: str) -> None:
    """Creates the consumer group (from the stream's start) and the stream if missing."""
    try:
      self.call("XGROUP CREATE", self.r.xgroup_create, stream, group, id="0", mkstream=True)
    except redis.ResponseError as e:
      if "BUSYGROUP" not in str(e):
        raise

  def group_info(self, stream: str, group: str) -> dict:
    for g in self.call("XINFO GROUPS", self.r.xinfo_groups, stream):
      name = g.get("name")
      if (name.decode() if isinstance(name, bytes) else name) == group:
        return g
    return {}

  def lag(self, stream: str, group: str) -> int:
    """Entries the group has not read yet."""
    g = self.group_info(stream, group)
    if g.get("lag") is not None:
      return int(g["lag"])
    # Redis cannot tell after some deletions: count what lies after the last delivered entry.
    last = g.get("last-delivered-id", b"0-0")
    last = last.decode() if isinstance(last, bytes) else last
    return len(self.call("XRANGE", self.r.xrange, stream, min="(" + last, max="+"))

  # ------------------------------------------------------------------------------ produce
  def publish(self, stream: str, index: str, batch: int, fields: dict, *, group: str,
              max_queue: int, should_stop: Callable[[], bool] = lambda: False,
              wait_s: float = 1e9) -> Published:
    """Adds ``fields`` as batch ``batch`` once, after waiting until the group has fewer than
    ``max_queue`` unread entries.  ``ADDED``; ``PRESENT`` if that batch id already names an
    entry (the caller's batch is in the stream either way); ``STOPPED`` if ``should_stop()``
    said stop first (nothing published: the caller must not count the batch as done)."""
    t0 = time.monotonic()
    said = False
    while self.lag(stream, group) >= max_queue:
      if should_stop():
        return Published.STOPPED
      if time.monotonic() - t0 > wait_s:
        raise PeerTimeout(f"{stream}: {max_queue} entries have stayed unread for {wait_s:.0f}s; "
                          f"is the consumer ({group}) running?")
      if not said:
        self.log(f"pools: {stream} holds {max_queue} unread entries (pools.max_queue); waiting "
                 f"for {group}")
        said = True
      time.sleep(0.02)
    args = [str(batch)]
    for k, v in fields.items():
      args += [k, v]
    added, _ = self.call("publish", self._publish, keys=[stream, index], args=args)
    return Published.ADDED if added else Published.PRESENT

  def entry_of(self, index: str, batch: int) -> Optional[bytes]:
    return self.call("HGET", self.r.hget, index, str(batch))

  def get(self, stream: str, index: str, batch: int):
    """``(entry id, fields)`` of batch ``batch``, or None if it was never published (or is
    trimmed)."""
    entry = self.entry_of(index, batch)
    if entry is None:
      return None
    got = self.call("XRANGE", self.r.xrange, stream, min=entry, max=entry)
    return (entry, got[0][1]) if got else None

  def trim(self, stream: str, index: str, group: str, keep_from: Optional[bytes] = None) -> None:
    """Drops entries every reader is done with: below the group's oldest unacked (or past its
    last delivered) entry and below ``keep_from`` (an entry the producer may re-read)."""
    g = self.group_info(stream, group)
    if not g:
      return
    # The consumer may ack between the two calls: only XPENDING's own answer says whether
    # anything is still pending (the group summary's count can be stale by then, and XPENDING
    # then has no oldest entry).  Its last-delivered id, read first, is a safe bound then.
    info = self.call("XPENDING", self.r.xpending, stream, group)
    if info and int(info.get("pending", 0)) and info.get("min") is not None:
      bound = entry_key(info["min"])
    else:
      ms, seq = entry_key(g.get("last-delivered-id", b"0-0"))
      bound = (ms, seq + 1)
    if keep_from is not None:
      bound = min(bound, entry_key(keep_from))
    if bound <= (0, 1):
      return
    self.call("XTRIM", self.r.xtrim, stream, minid=f"{bound[0]}-{bound[1]}", approximate=False)
    old = [b for b, e in self.call("HGETALL", self.r.hgetall, index).items()
           if entry_key(e) < bound]
    if old:
      self.call("HDEL", self.r.hdel, index, *old)

  # ------------------------------------------------------------------------------ consume
  def read(self, stream: str, group: str, consumer: str, *, pending: bool, count: int = 16,
           block_ms: int = 100) -> list:
    """``[(entry id, fields)]``: with ``pending``, first this consumer's delivered-but-unacked
    entries and those other consumers left idle for ``claim_idle_ms``; then new entries
    (blocking up to ``block_ms``)."""
    out = []
    try:
      if pending:
        # Paged: a restart re-reads at most ``count`` entries per call, however many the
        # consumer left pending.
        start = "0"
        while True:
          page = []
          for _, entries in self.call("XREADGROUP", self.r.xreadgroup, group, consumer,
                                      {stream: start}, count=count) or []:
            page += entries
          out += page
          if len(page) < count:
            break
          start = page[-1][0]
        start = "0-0"
        while True:
          claimed = self.call("XAUTOCLAIM", self.r.xautoclaim, stream, group, consumer,
                              self.claim_idle_ms, start_id=start, count=count)
          out += claimed[1]
          start = claimed[0]
          if start in (b"0-0", "0-0") or not claimed[1]:
            break
      for _, entries in self.call("XREADGROUP", self.r.xreadgroup, group, consumer,
                                  {stream: ">"}, count=count, block=block_ms) or []:
        out += entries
    except redis.ResponseError as e:
      if "NOGROUP" not in str(e):
        raise
      # Redis lost its data (restarted without persistence?) or someone deleted the stream.
      self.log(f"pools: {stream} lost its consumer group {group} ({e}); recreating it. Redis "
               "needs appendonly persistence for a run to survive a Redis restart")
      self.ensure_group(stream, group)
    return out

  def ack(self, stream: str, group: str, *entries) -> None:
    if entries:
      self.call("XACK", self.r.xack, stream, group, *entries)


MAX_READ_BYTES = 256 << 20


def max_entry_bytes(schema) -> int:
  """The largest stream entry a message of ``schema`` (one map, or a sequence of them: see
  :func:`jaxrlhf.pools.wire.decode`) can be: its arrays, their field names, and a header at its
  size limit."""
  if not isinstance(schema, dict):
    return max(max_entry_bytes(s) for s in schema)
  arrays = sum(math.prod(shape) * np.dtype(dtype).itemsize + len(name) + 2
               for name, (shape, dtype) in schema.items())
  return arrays + wire.MAX_HEADER_BYTES + 1


class Inbox:
  """Exactly-once, in-order delivery of one stream's batches to a pool.

  :meth:`take` returns the message of batch ``b`` (buffering later ones, dropping and acking
  malformed or foreign entries with a logged reason); :meth:`ack_through` acks what a
  checkpoint now covers.  A batch id below the pool's position is one its checkpoint already
  includes: it is acked, never applied again.
  """

  def __init__(self, store: Store, stream: str, index: str, group: str, consumer: str, *,
               kind: str, run: str, schema, log: Callable[[str], None] = print,
               event: Callable[..., None] = lambda **e: None,
               read_bytes: int = MAX_READ_BYTES):
    self.store, self.stream, self.index, self.group = store, stream, index, group
    self.consumer, self.kind, self.run, self.schema = consumer, kind, run, schema
    # A genuine entry is this big at most; a bigger one is rejected before decoding, and a
    # read asks for no more entries than fit in ``read_bytes`` at that size.
    self.max_entry = max_entry_bytes(schema)
    self.count = max(1, min(16, read_bytes // self.max_entry))
    self.log, self.event = log, event
    self.buffer: dict = {}  # batch -> (entry id, Message)
    self.unacked: dict = {}  # entry id -> batch, taken (or covered) but not yet acked
    self._reread = True  # the first read collects entries delivered before a restart
    store.ensure_group(stream, group)

  def _reject(self, entry, why: str) -> None:
    self.log(f"pools: rejected {self.stream} entry {entry.decode()}: {why}")
    self.event(event="rejected", stream=self.stream, entry=entry.decode(), reason=why)
    self.store.ack(self.stream, self.group, entry)

  def _accept(self, entry, fields, position: int) -> None:
    if entry in self.unacked or any(e == entry for e, _ in self.buffer.values()):
      return  # re-read of an entry we already hold
    size = wire.entry_bytes(fields or {})
    if size > self.max_entry:
      return self._reject(entry, f"{size} bytes; a {self.kind} of this run is at most "
                                 f"{self.max_entry}")
    try:
      msg = wire.decode(fields, kind=self.kind, run=self.run, schema=self.schema)
    except wire.WireError as e:
      return self._reject(entry, str(e))
    if msg.batch < position:
      # Its effect is in the restored state already: ack with the next checkpoint.
      self.log(f"pools: {self.stream} batch {msg.batch} already applied (position {position}); "
               "skipped")
      self.event(event="duplicate", stream=self.stream, batch=msg.batch)
      self.unacked[entry] = msg.batch
      return
    # Publishing adds the entry and its index line in one script, so a real entry is always
    # the one the index names for its batch.
    registered = self.store.entry_of(self.index, msg.batch)
    if registered is None and self.store.evicted():
      raise StoreError(
          f"{self.stream}: batch {msg.batch}'s entry {entry.decode()} is not in the index "
          f"{self.index}, and redis at {self.store.where} has evicted keys: the index was "
          "evicted (maxmemory-policy), not forged. Use maxmemory-policy noeviction and more "
          "maxmemory; this run's streams are incomplete, start it again")
    if registered != entry:
      where = registered.decode() if registered is not None else "not published"
      return self._reject(entry, f"batch {msg.batch} is {where}, not this entry (a duplicate "
                                 "or forged entry)")
    self.buffer[msg.batch] = (entry, msg)

  def take(self, batch: int, *, timeout: float, should_stop: Callable[[], bool] = lambda: False,
           idle: Callable[[], None] = lambda: None):
    """The message of ``batch``; None if ``should_stop()`` says stop first."""
    t0 = time.monotonic()
    while batch not in self.buffer:
      if should_stop():
        return None
      if time.monotonic() - t0 > timeout:
        raise PeerTimeout(f"no {self.kind} for batch {batch} on {self.stream} for {timeout:.0f}s;"
                          f" is the other pool running? (pools.peer_wait_s)")
      reread = self._reread or self.store.interrupted
      self._reread = False
      self.store.interrupted = False
      for entry, fields in self.store.read(self.stream, self.group, self.consumer,
                                           pending=reread, count=self.count):
        self._accept(entry, fields, batch)
      idle()
    entry, msg = self.buffer.pop(batch)
    self.unacked[entry] = batch
    return msg

  def ack_through(self, batch: int) -> None:
    """Acks every taken entry of batch id <= ``batch`` (a checkpoint now covers them)."""
    done = [e for e, b in self.unacked.items() if b <= batch]
    self.store.ack(self.stream, self.group, *done)
    for e in done:
      del self.unacked[e]
