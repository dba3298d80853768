"""The learning matrix of issue 30: the tiny experiments over seeds x CPU codegens.

    python -m benchmarks.learning_matrix                      # 3 seeds x {AVX2, native}, all 5
    python -m benchmarks.learning_matrix --experiments=tiny_grpo --seeds=0 --set=grpo.steps=90
    python -m benchmarks.learning_matrix --write              # also rewrite the documented figures
    python -m benchmarks.learning_matrix --markdown           # docs/results.md's and the README's tables

Each run is its own ``python -m jaxrlhf.main`` subprocess (under ``nice``) with the codegen set
by ``XLA_FLAGS`` (``jaxrlhf.results.ISAS``) and a compilation cache of its own per codegen.
Runs go to ``OUT/EXPERIMENT/sSEED-ISA`` (default OUT: runs/matrix) and a finished one is not
run again, so an interrupted matrix continues where it stopped.  ``tiny_dpo`` starts from the
finished SFT of ``tiny_grpo`` of the same seed and codegen when the two SFT settings are the
same (they are: both are ``TINY_SFT``), so each SFT is trained once.

Prints, per metric, the value of every run, the median and range, and whether each run meets
the claims of ``jaxrlhf.results.CLAIMS``; ``--write`` stores the values in
``jaxrlhf/learning_results.json``, where the README's table and ``python -m jaxrlhf.report``
read them (the experiments measured replace their own figures; the others keep theirs).  Exit
status 1 when a claim is not met.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrlhf import results as R  # noqa: E402

EXPERIMENTS = ("tiny_ppo", "tiny_grpo", "tiny_dpo", "tiny_grpo_calc", "tiny_grpo_guess")
# experiment -> the experiment whose finished SFT it starts from (when the settings agree).
SHARES_SFT = {"tiny_dpo": "tiny_grpo"}


def run_dir(out, experiment, seed, isa):
  return os.path.join(out, experiment, f"s{seed}-{isa}")


def _sft_settings(experiment, seed, overrides):
  """What a finished SFT result depends on: its own section, model, data and seed."""
  from jaxrlhf import registry
  from jaxrlhf.config import to_dict
  from jaxrlhf.config.overrides import apply_overrides
  import experiments  # noqa: F401  (registers the tiny experiments)
  cfg = apply_overrides(registry.get(experiment), [*overrides, f"seed={seed}"])
  d = to_dict(cfg)
  return {k: d[k] for k in ("sft", "model", "data", "seed")}


class Job:
  def __init__(self, experiment, seed, isa, out, overrides):
    self.experiment, self.seed, self.isa = experiment, seed, isa
    self.dir = run_dir(out, experiment, seed, isa)
    self.overrides = overrides
    self.proc = None
    self.t0 = None
    self.after = None  # the Job whose SFT this one reuses

  @property
  def name(self):
    return f"{self.experiment} seed {self.seed} {self.isa}"

  def done(self):
    return os.path.exists(os.path.join(self.dir, "summary.json"))

  def start(self, cache_root, reuse_from=None, reuse=("sft",)):
    os.makedirs(self.dir, exist_ok=True)
    copies = {}
    if self.after is not None:
      copies["sft"] = os.path.join(self.after.dir, "sft", "final")
    elif reuse_from:  # finished stages of the same seed and codegen from another matrix
      for stage in reuse:
        for e in (self.experiment, *[k for k, v in SHARES_SFT.items() if v == self.experiment],
                  SHARES_SFT.get(self.experiment)):
          cand = os.path.join(run_dir(reuse_from, e, self.seed, self.isa), stage, "final") if e \
              else ""
          if stage in ("sft",) or e == self.experiment:
            if cand and os.path.exists(cand):
              copies[stage] = cand
              break
    for stage, src in copies.items():
      dst = os.path.join(self.dir, stage, "final")
      if not os.path.exists(dst):
        shutil.copytree(src, dst)
        print(f"         {self.name}: {stage} from {src}", flush=True)
    env = dict(os.environ)
    env["XLA_FLAGS"] = R.ISAS[self.isa]
    env["JAXRLHF_COMPILATION_CACHE"] = os.path.join(cache_root, self.isa)
    cmd = ["nice", "-n", "5", sys.executable, "-m", "jaxrlhf.main",
           f"--experiment={self.experiment}", f"--workdir={self.dir}",
           f"--set=seed={self.seed}", *[f"--set={o}" for o in self.overrides]]
    self.log = open(os.path.join(self.dir, "log.txt"), "w")
    self.t0 = time.time()
    self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
    print(f"started  {self.name}: {' '.join(cmd[3:])}", flush=True)


def run_all(jobs, n_parallel, cache_root, reuse_from=None, reuse=("sft",)):
  pending = [j for j in jobs if not j.done()]
  running = []
  failed = []
  while pending or running:
    for j in list(running):
      if j.proc.poll() is not None:
        running.remove(j)
        j.log.close()
        took = time.time() - j.t0
        ok = j.proc.returncode == 0 and j.done()
        print(f"{'finished' if ok else 'FAILED  '} {j.name} in {took:.0f} s"
              + ("" if ok else f" (exit {j.proc.returncode}; see {j.dir}/log.txt)"), flush=True)
        if not ok:
          failed.append(j)
    for j in list(pending):
      if len(running) >= n_parallel:
        break
      if j.after is not None and not j.after.done():
        if j.after in failed or (j.after not in running and j.after not in pending):
          pending.remove(j)
          failed.append(j)
        continue
      pending.remove(j)
      j.start(cache_root, reuse_from, reuse)
      running.append(j)
    time.sleep(2)
  return failed


def collect(out, experiments, seeds, isas):
  """``(runs, shas)``: each finished run's metrics, and each experiment's settings fingerprint
  (the same for all its runs, or an error)."""
  runs, shas = {}, {}
  for e in experiments:
    for s in seeds:
      for isa in isas:
        d = run_dir(out, e, s, isa)
        if os.path.exists(os.path.join(d, "summary.json")):
          with open(os.path.join(d, "summary.json")) as f:
            runs.setdefault(e, {})[f"{s}/{isa}"] = R.measure(json.load(f))
          with open(os.path.join(d, "config.json")) as f:
            sha = R.config_sha(json.load(f))
          if shas.setdefault(e, sha) != sha:
            raise SystemExit(f"{d}: trained with other settings than the other runs of {e} "
                             f"in {out}; rerun it in a fresh --out")
  return runs, shas


def table(runs, seeds, isas) -> tuple[str, bool]:
  """The per-run table with medians, ranges and claims; and whether every claim held."""
  lines, all_ok = [], True
  cols = [f"{s}/{isa}" for s in seeds for isa in isas]
  lines.append(f"{'experiment':10s} {'metric':20s} " + " ".join(f"{c:>10s}" for c in cols)
               + "   median [range]")
  for e, by_run in runs.items():
    metrics = [m for m in R.METRICS if any(m in r for r in by_run.values())]
    for m in metrics:
      vals = [R.fmt(m, by_run[c][m]) if c in by_run and m in by_run[c] else "-" for c in cols]
      sp = R.spread({"runs": runs}, e, m)
      lines.append(f"{e:10s} {m:20s} " + " ".join(f"{v:>10s}" for v in vals)
                   + f"   {R.fmt_spread(m, sp)} (n={sp[3]})")
    for c in cols:
      if c not in by_run:
        continue
      for metric, value, needed, rule, ok in R.check_claims(e, by_run[c]):
        if not ok:
          all_ok = False
          lines.append(f"  CLAIM NOT MET: {e} {c} {metric} {R.fmt(metric, value)} < "
                       f"{R.fmt(metric, needed)} ({rule})")
  return "\n".join(lines), all_ok


def markdown(measured, claims_only: bool = False) -> str:
  """The results table of docs/results.md, from the documented figures; ``claims_only``: the
  README's, only the rows that carry a claim."""
  rows = ["| experiment | metric | median [range over the runs] | claim | runs meeting it |",
          "|---|---|---|---|---|"]
  for e, by_run in measured["runs"].items():
    claims = {m: rule for m, _, rule in R.CLAIMS.get(e, [])}
    met = {}
    for r in by_run.values():
      for metric, _, _, _, ok in R.check_claims(e, r):
        met.setdefault(metric, []).append(ok)
    for m in R.METRICS:
      sp = R.spread(measured, e, m)
      if sp is None or (claims_only and m not in claims):
        continue
      count = f"{sum(met[m])} of {len(met[m])}" if m in met else ""
      rows.append(f"| `{e}` | {R.label(e, m)} | {R.fmt_spread(m, sp)} | {claims.get(m, '')} "
                  f"| {count} |")
  return "\n".join(rows)


def cells_markdown(runs, seeds, isas) -> str:
  """Every run's value (seed x codegen), one row per experiment and metric."""
  cols = [f"{s}/{isa}" for s in seeds for isa in isas]
  rows = ["| experiment | metric | " + " | ".join(f"seed {c.replace('/', ' ')}" for c in cols)
          + " | median [range] |", "|---|---|" + "---|" * (len(cols) + 1)]
  for e, by_run in runs.items():
    for m in R.METRICS:
      if not any(m in r for r in by_run.values()):
        continue
      vals = [R.fmt(m, by_run[c][m]) if c in by_run and m in by_run[c] else "-" for c in cols]
      sp = R.spread({"runs": runs}, e, m)
      rows.append(f"| `{e}` | {m} | " + " | ".join(vals) + f" | {R.fmt_spread(m, sp)} |")
  return "\n".join(rows)


def native_isa() -> str:
  """The best vector ISA this CPU offers XLA (what the "native" codegen uses)."""
  try:
    with open("/proc/cpuinfo") as f:
      flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
  except OSError:
    return "unknown"
  for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sse4_2", "SSE4.2")):
    if flag in flags:
      return name
  return "unknown"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="runs/matrix")
  p.add_argument("--experiments", default=",".join(EXPERIMENTS))
  p.add_argument("--seeds", default=",".join(map(str, R.SEEDS)))
  p.add_argument("--isas", default=",".join(R.ISAS))
  p.add_argument("--jobs", type=int, default=2, help="runs at a time")
  p.add_argument("--set", action="append", default=[], help="override for every run")
  p.add_argument("--write", action="store_true",
                 help=f"store the figures in {os.path.relpath(R.MEASURED_FILE)}")
  p.add_argument("--markdown", action="store_true",
                 help="print the README's table from the stored figures and exit")
  p.add_argument("--no-run", action="store_true", help="only tabulate finished runs")
  p.add_argument("--cells", action="store_true",
                 help="also print every run's figures as a markdown table")
  p.add_argument("--reuse-from", default=None,
                 help="another matrix's OUT: start each run from its finished stages (--reuse) "
                      "of the same seed and codegen, to tune a later stage; the trainer "
                      "refuses a reused stage whose settings changed in a way that matters")
  p.add_argument("--reuse", default="sft", help="the stages --reuse-from copies (e.g. sft,rm)")
  args = p.parse_args(argv)
  if args.markdown:
    print(markdown(R.load_measured()))
    print()
    print(markdown(R.load_measured(), claims_only=True))
    return 0
  experiments = [e for e in args.experiments.split(",") if e]
  seeds = [int(s) for s in args.seeds.split(",")]
  isas = [i for i in args.isas.split(",") if i]
  for isa in isas:
    if isa not in R.ISAS:
      p.error(f"--isas: {isa!r} is not one of {', '.join(R.ISAS)}")
  jobs, by_key = [], {}
  for e in experiments:
    for s in seeds:
      for isa in isas:
        j = Job(e, s, isa, args.out, args.set)
        by_key[(e, s, isa)] = j
        jobs.append(j)
  for j in jobs:
    src = SHARES_SFT.get(j.experiment)
    if src and (src, j.seed, j.isa) in by_key and (
        _sft_settings(src, j.seed, j.overrides) == _sft_settings(j.experiment, j.seed,
                                                                 j.overrides)):
      j.after = by_key[(src, j.seed, j.isa)]
  # Interleave so that the runs a later one waits for come first.
  jobs.sort(key=lambda j: (j.after is not None, j.seed, j.isa))
  failed = [] if args.no_run else run_all(jobs, args.jobs, os.path.join(args.out, "xla_cache"),
                                            args.reuse_from, tuple(args.reuse.split(",")))
  runs, shas = collect(args.out, experiments, seeds, isas)
  text, ok = table(runs, seeds, isas)
  print(text)
  if args.cells:
    print(cells_markdown(runs, seeds, isas))
  with open(os.path.join(args.out, "matrix.json"), "w") as f:
    json.dump({"overrides": args.set, "runs": runs}, f, indent=2)
  if args.write:
    setup = {"seeds": seeds, "isas": {i: R.ISAS[i] for i in isas}, "native_isa": native_isa(),
             "cpus": os.cpu_count(),
             "command": "python -m benchmarks.learning_matrix --write"}
    # The experiments measured here replace their documented figures; the others keep theirs.
    old = R.load_measured() if os.path.exists(R.MEASURED_FILE) else {}
    if old and {k: v for k, v in old["setup"].items() if k != "command"} != {
        k: v for k, v in setup.items() if k != "command"}:
      raise SystemExit(f"--write: this matrix's set-up {setup} differs from the one of "
                       f"{R.MEASURED_FILE} ({old['setup']}); measure every experiment again")
    shas = {**old.get("config_sha", {}), **shas}
    runs = {**old.get("runs", {}), **runs}
    with open(R.MEASURED_FILE, "w") as f:
      json.dump({"setup": setup, "config_sha": shas, "runs": runs}, f, indent=1,
                sort_keys=True)
      f.write("\n")
    print(f"wrote {R.MEASURED_FILE}")
  if failed:
    print("failed runs: " + ", ".join(j.name for j in failed))
  return 0 if ok and not failed else 1


if __name__ == "__main__":
  sys.exit(main())
