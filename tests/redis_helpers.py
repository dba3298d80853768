"""A real redis-server on a free loopback port, for the pools tests."""

import os
import shutil
import socket
import subprocess
import time

import pytest


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class RedisServer:
  """``redis-server`` in ``directory`` on ``port``; :meth:`stop` / :meth:`start` to take it
  away and bring it back (with ``appendonly``, its streams survive)."""

  def __init__(self, directory, appendonly=False, password=None):
    self.exe = shutil.which("redis-server")
    if self.exe is None:
      pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    self.dir = str(directory)
    self.port = free_port()
    self.appendonly = appendonly
    self.password = password
    self.proc = None
    self.url = f"redis://127.0.0.1:{self.port}/0"

  def start(self):
    args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
            "--save", "", "--appendonly", "yes" if self.appendonly else "no"]
    if self.appendonly:
      args += ["--appendfsync", "always"]
    if self.password:
      args += ["--requirepass", self.password]
    self.proc = subprocess.Popen(args, stdout=open(os.path.join(self.dir, "redis.log"), "a"),
                                 stderr=subprocess.STDOUT)
    import redis
    t0 = time.time()
    while time.time() - t0 < 20:
      try:
        if redis.Redis(port=self.port, password=self.password, socket_timeout=0.5).ping():
          return self
      except redis.ConnectionError:
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")

  def stop(self):
    if self.proc is not None and self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait(timeout=10)
    self.proc = None
