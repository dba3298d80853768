"""The planner: memory, FLOPs, time and dollars of an experiment on a cluster, from a laptop.

``python -m jaxrlhf.main --experiment=NAME --plan --devices=N --accelerator=h100`` builds every
stage's train state and batch as ``jax.ShapeDtypeStruct``s with their shardings on a mesh of
N *simulated* CPU devices, lowers and compiles the programs the trainer runs (an RL step's
generation, scoring and update phases, and the one-program step), and reads the answer off
XLA.  Nothing is allocated.  ``--plan_search`` finds the smallest device count and mesh on
which the experiment fits; ``python -m jaxrlhf.plan --compare`` plans the four 70B
experiments next to the seed analysis's figures.

Where each figure comes from (details and caveats in docs/plan.md):

* **Memory per device** is XLA's memory analysis of the compiled program: arguments + outputs +
  temporaries - donated (aliased) bytes.  The CPU compiler multiplies bf16 in f32 and hoists
  f32 copies of whole stacked weights and residuals out of the layer loops; a GPU does not, so
  we subtract the copies' share of the peak (`jaxrlhf.plan.hlo.cpu_upcast_bytes`) and
  report the raw CPU figure beside it.  A phase program also counts what stays resident while
  it runs without being its argument (the rest of the train state, frozen models, rollouts).
* **FLOPs and HBM bytes** are analytic (:func:`jaxrlhf.perf.decoder_flops` and the formulas
  in :func:`workload`): XLA's cost analysis counts a loop body once, and every program here
  loops (scanned layers, the decoding loop, minibatches).  XLA's raw figures are kept as
  ``xla_flops`` / ``xla_bytes_accessed``.
* **Collective traffic** is read from the compiled HLO with loops multiplied out
  (`jaxrlhf.plan.hlo.collective_traffic`), split into traffic inside an 8-device node
  (NVLink) and across nodes (the network, :data:`NODES`).
* **Time** per program is a roofline: the slowest of compute, HBM and collectives, assuming
  they overlap perfectly -- a lower bound.  Phases run one after another, so an RL step's
  time is the sum of its phases' times; the decoding loop is assumed to run all
  ``max_new_tokens`` steps.
  Compiled by the target's own compiler, the plan also reads how much of the collectives'
  time its schedule hides behind computation (`jaxrlhf.plan.hlo.schedule`) and reports the
  step as scheduled and with nothing overlapped; the cost stays on the roofline.

The package, one concern a module, each importing only the ones above it:

- ``cluster``: node topology, usable memory, the simulated devices;
- ``cost``: dollars and the build-vs-API bands;
- ``workload``: the analytic FLOPs and HBM bytes of each program;
- ``hlo``: reading the compiled HLO (collectives, loop trip counts, CPU upcasts);
- ``programs``: compiling a stage's programs and reading memory, traffic and a roofline;
- ``build``: a whole experiment's plan;  ``report``: its text and plan.json;
- ``search``: the smallest cluster;  ``compare``: the 70B experiments against the seeds;
- ``cli``: ``--plan`` / ``--plan_search`` and ``python -m jaxrlhf.plan --compare``.

The runtime guard that stops a run on the wrong machine (and the byte counts it shares with
the planner) lives below the training loop, in :mod:`jaxrlhf.train.preflight`.
"""

from jaxrlhf.plan.build import Plan, build_plan
from jaxrlhf.plan.cli import main
from jaxrlhf.plan.cluster import USABLE_FRACTION, node_of, simulate_devices
from jaxrlhf.plan.compare import compare, format_compare
from jaxrlhf.plan.programs import ProgramPlan, StagePlan, plan_stage
from jaxrlhf.plan.report import format_plan, to_json, write_json
from jaxrlhf.plan.search import candidate_meshes, find_smallest
from jaxrlhf.plan.workload import Work, train_bytes, workload
from jaxrlhf.train.preflight import preflight, state_bytes

__all__ = ["Plan", "ProgramPlan", "StagePlan", "USABLE_FRACTION", "Work", "build_plan",
           "candidate_meshes", "compare", "find_smallest", "format_compare", "format_plan",
           "main", "node_of", "plan_stage", "preflight", "simulate_devices", "state_bytes",
           "to_json", "train_bytes", "workload", "write_json"]
