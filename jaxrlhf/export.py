"""Writes a trained model of a run as a Hugging Face folder.

    python -m jaxrlhf.export --workdir=DIR --out=OUT [--stage=S] [--role=policy] [--dtype=D]

reads the run's saved config (``DIR/config.json``), loads the role's parameters from the
stage's result (``DIR/STAGE/final``; default stage: the last of the run's stages that
finished) and writes ``OUT`` with :func:`jaxrlhf.model.hf.export_hf`: ``config.json`` (both
transformers 4.x and 5.x rotary fields), safetensors and the tokenizer files (from
``data.tokenizer`` when it is a folder, else the model's ``hf_path``), chat template included.
The policy (and a PPO policy with a shared value head, whose head is dropped) is written as
``*ForCausalLM``, a reward or value model as ``*ForSequenceClassification``.

Runs in one process on this machine's devices (the mesh is all of them, data-parallel); the
result loads onto it whatever mesh trained it.
"""

from __future__ import annotations

import os
import sys

from jaxrlhf.cli import argument_parser, guarded
from jaxrlhf.config import ConfigError


def _stage_to_export(cfg, workdir: str, stage: str) -> str:
  from jaxrlhf import checkpoint as ckpt
  finished = [s for s in cfg.stages if ckpt.stage_result_exists(workdir, s)]
  if stage:
    if stage not in cfg.stages:
      raise ConfigError(f"--stage={stage}: the run in {workdir} has stages "
                        f"{', '.join(cfg.stages)}")
    if stage not in finished:
      raise ConfigError(f"--stage={stage} has not finished in {workdir} (no "
                        f"{ckpt.stage_result_dir(workdir, stage)}); finished: "
                        f"{', '.join(finished) or 'none'}")
    return stage
  if not finished:
    raise ConfigError(f"no stage of the run in {workdir} has finished ({', '.join(cfg.stages)}"
                      "); export needs a finished stage's result (STAGE/final)")
  return finished[-1]


def export_run(workdir: str, out: str, stage: str = "", role: str = "policy",
               dtype: str = "") -> tuple[str, str]:
  """Exports ``role`` of ``stage`` (default: the last finished) of the run in ``workdir`` to
  ``out``; returns (out, the stage exported).  ConfigError for what the run does not have."""
  if not os.path.isdir(workdir):
    raise ConfigError(f"--workdir={workdir} is not a directory")
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise ConfigError(f"--workdir={workdir} has no config.json: not the folder of a jaxrlhf run")
  import jax

  from jaxrlhf import checkpoint as ckpt
  from jaxrlhf import model as M
  from jaxrlhf.config import MeshConfig, load_config_file
  from jaxrlhf.mesh import PARAM_RULES, make_mesh
  from jaxrlhf.model import hf
  from jaxrlhf.train import spec

  cfg = load_config_file(path)
  stage = _stage_to_export(cfg, workdir, stage)
  roles = ckpt.stage_result_info(workdir, stage)["roles"]
  if role not in roles:
    raise ConfigError(f"--role={role}: stage {stage!r} of {workdir} trained "
                      f"{', '.join(roles)}")
  if dtype and dtype not in ("float32", "bfloat16", "float16"):
    raise ConfigError(f"--dtype={dtype}: use float32, bfloat16 or float16")
  # The architecture as the run built it: read from model.hf_path with the run's tp (which
  # pads the vocabulary the result was saved with).
  cfg = hf.resolve_models(cfg, max(cfg.mesh.tp, 1))
  model_cfg = cfg.role_model(role)
  head = spec.get(stage).roles(cfg)[role].head
  mesh = make_mesh(MeshConfig(dp=-1))
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          M.abstract_params(model_cfg, head),
                          M.param_shardings(model_cfg, mesh, head, PARAM_RULES))
  params = ckpt.load_stage_result(workdir, stage, {role: abstract})[role]
  tokenizer = cfg.data.tokenizer if os.path.isdir(cfg.data.tokenizer or "") else None
  hf.export_hf(params, model_cfg, out, tokenizer_path=tokenizer,
               head="scalar" if head == "scalar" else "lm", dtype=dtype or None)
  return out, stage


def main(argv=None) -> int:
  parser = argument_parser("jaxrlhf.export", __doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="the run's output folder")
  parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
  parser.add_argument("--stage", default="",
                      help="the stage whose result to export (default: the last finished)")
  parser.add_argument("--role", default="policy",
                      help="policy (default), or reward / value where the stage trained them")
  parser.add_argument("--dtype", default="",
                      help="tensor dtype: float32, bfloat16, float16 (default: the model's "
                           "param_dtype)")
  args = parser.parse_args(argv)

  def run() -> int:
    out, stage = export_run(args.workdir, args.out, args.stage, args.role, args.dtype)
    print(f"exported {args.role} of stage {stage} to {out}: {', '.join(sorted(os.listdir(out)))}")
    return 0

  return guarded(run)

if __name__ == "__main__":
  sys.exit(main())
