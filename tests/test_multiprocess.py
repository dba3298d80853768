"""A real two-process run on loopback (gloo CPU collectives) equals the single-process one."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np

import mp_forward_worker as worker
from jaxrlhf.config import MeshConfig
from jaxrlhf.mesh import make_mesh


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_form_one_mesh_and_match_single_process(tmp_path):
  port = _free_port()
  out = str(tmp_path / "h.npy")
  script = os.path.join(os.path.dirname(__file__), "mp_forward_worker.py")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, script, str(port), str(i), out], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=240)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  assert all(p.returncode == 0 for p in procs), "\n".join(logs)
  multi = np.load(out)
  single = worker.sharded_forward(make_mesh(MeshConfig(dp=2, tp=4), jax.devices()[:8]))
  _, mask = worker.inputs()
  np.testing.assert_allclose(np.where(mask[..., None], multi, 0),
                             np.where(mask[..., None], single, 0), atol=1e-5)
