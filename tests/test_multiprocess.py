"""A real two-process run on loopback (gloo CPU collectives) equals the single-process one."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import mp_forward_worker as worker
import mp_rl_worker
from jaxrlhf.config import MeshConfig
from jaxrlhf.mesh import make_mesh


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_processes(worker_file: str, *args: str):
  """Runs ``worker_file`` as processes 0 and 1 of one cluster (4 simulated devices each)."""
  port = _free_port()
  script = os.path.join(os.path.dirname(__file__), worker_file)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, script, str(port), str(i), *args], env=env,
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


def test_two_processes_form_one_mesh_and_match_single_process(tmp_path):
  out = str(tmp_path / "h.npy")
  _two_processes("mp_forward_worker.py", out)
  multi = np.load(out)
  single = worker.sharded_forward(make_mesh(MeshConfig(dp=2, tp=4), jax.devices()[:8]))
  _, mask = worker.inputs()
  np.testing.assert_allclose(np.where(mask[..., None], multi, 0),
                             np.where(mask[..., None], single, 0), atol=1e-5)


@pytest.mark.parametrize("mode", ["pack", pytest.param("host", marks=pytest.mark.slow)])
def test_grpo_steps_split_at_the_host_on_two_processes_match_one_process(tmp_path, mode):
  """The RL step cut at the host with the rollout's rows split between two processes: for
  packed forwards (rollout.pack) each host gathers the whole mask and makes the same layout;
  for a host reward each scores the whole batch.  Two GRPO steps equal the single-process
  run's on the same dp=2 x tp=4 mesh shape."""
  out = str(tmp_path / "m.json")
  _two_processes("mp_rl_worker.py", out, mode)
  with open(out) as f:
    multi = json.load(f)
  single, sq = mp_rl_worker.run(make_mesh(MeshConfig(dp=2, tp=4), jax.devices()[:8]), mode)
  if mode == "pack":
    assert all(m["pack/rows"] < 16 for m in single)  # the rows were really packed
  for a, b in zip(multi["metrics"], single):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_allclose(a[k], b[k], rtol=2e-4, atol=2e-5, err_msg=k)
  np.testing.assert_allclose(multi["params_sq"], sq, rtol=1e-5)
