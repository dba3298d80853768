"""``--plan`` / ``--plan_search`` from jaxrlhf.main, and ``python -m jaxrlhf.plan --compare``."""

from __future__ import annotations

import sys

from jaxrlhf import hardware
from jaxrlhf.config import ConfigError, ExperimentConfig, MeshConfig
from jaxrlhf.train.preflight import gb
from jaxrlhf.plan.cluster import USABLE_FRACTION, enable_compile_cache, simulate_devices
from jaxrlhf.plan.build import build_plan
from jaxrlhf.plan.report import format_plan, write_json
from jaxrlhf.plan.search import SEARCH_COUNTS, find_smallest
from jaxrlhf.plan.compare import compare


def main(cfg: ExperimentConfig, workdir: str, search: bool = False) -> int:
  """``--plan`` / ``--plan_search`` from jaxrlhf.main.  Returns the exit status."""
  acc = hardware.get_accelerator(cfg.plan.accelerator)
  if acc.measured:
    raise ConfigError("--accelerator=cpu cannot be planned for; choose one of "
                      + ", ".join(repr(k) for k in hardware.ACCELERATORS))
  n = max(SEARCH_COUNTS) if search else cfg.plan.devices
  if n < 1:
    raise ConfigError(f"plan.devices={n}: must be at least 1 (--devices=N)")
  simulate_devices(n)
  enable_compile_cache()
  if search:
    print(f"searching the smallest {acc.name} cluster for {cfg.name} "
          f"(usable {gb(acc.memory_bytes * USABLE_FRACTION)} GB/device):")
    found, _ = find_smallest(cfg, acc)
    if found is None:
      print(f"error: {cfg.name} does not fit on up to {max(SEARCH_COUNTS)} {acc.name} "
            f"devices with these settings", file=sys.stderr)
      return 1
    mesh_cfg = MeshConfig(**found.mesh)
    print(f"smallest: {found.devices} x {acc.name}, mesh tp={mesh_cfg.tp} "
          f"fsdp={mesh_cfg.fsdp} dp={mesh_cfg.dp}; full plan:\n")
    # The configuration that fitted: its decode layout may be the training one.
    plan = build_plan(found.cfg, found.devices, acc, mesh_cfg=mesh_cfg)
  else:
    plan = build_plan(cfg, n, acc)
  print(format_plan(plan))
  print(f"wrote {write_json(plan, workdir)}")
  return 0


def _cli(argv=None) -> int:
  from jaxrlhf.cli import argument_parser
  ap = argument_parser("jaxrlhf.plan", "Plan the 70B experiments next to the seed figures.")
  ap.add_argument("--compare", action="store_true", help="plan sft70b, dpo70b, grpo70b, ppo70b")
  ap.add_argument("--accelerator", default="h100", help="h100, h200, b200 or tpu-v5p")
  ap.add_argument("--workdir", default="runs/compare70b")
  ap.add_argument("--no_search", action="store_true",
                  help="skip finding each experiment's smallest cluster (faster)")
  args = ap.parse_args(argv)
  if not args.compare:
    ap.print_help()
    return 0
  try:
    compare(args.accelerator, args.workdir, search=not args.no_search)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0
