"""What a Python-backend step costs on this host, with no work in it: the floor under the
ensemble's three steps (not a test).

    python -m deploy.bench.hops [--concurrency 1 32] [--interval-ms 4000] [--report-dir deploy/reports]

Builds a model repository of identity Python-backend models in a temp dir, configured as the
lifecycle steps are (dynamic batching, no queue delay, ragged input, one instance), starts
tritonserver on loopback, and runs perf_analyzer on two ensembles of them: one step
(`hops_1`) and three steps in a chain (`hops_3`, as `hstu_ranking` chains kv_lookup_alloc,
hstu_compute and kv_offload). Half the difference of their p50 at c=1 is what one added step
costs when its model does nothing: each step's own work comes on top.

A third ensemble is `hstu_ranking` with no work in it (`hstu_ranking` in the output): the
served configs (`deploy.make_configs.render`: the same tensors, batching and instances) over
models that only read their inputs and answer outputs of the real sizes (a plan of about the
real one's size, the sealed scores, the scores), driven by the profile's synthetic trace (128
users, about 300 events). Its throughput is the ceiling of the served shape on this host: what
`hstu_ranking` would serve if its steps' own work cost nothing. Prints each point and writes
`hops-<date>-<machine>.json`.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from deploy import trace as trace_module
from deploy.bench.perf_analyzer import run_perf_analyzer
from deploy.bench.profile import ms_per_execute
from deploy.bench.report import write_dated_report
from deploy.launcher import wait_until_ready
from deploy.make_configs import render, write
from deploy.processes import free_loopback_ports
from deploy.runtime import schema
from deploy.server_stats import hop_stats, read_model_stats
from deploy.triton_env import find_triton, install_stub, triton_env

REPORTS = Path(__file__).resolve().parents[1] / "reports"
RANKING_STEPS = (schema.LOOKUP, schema.COMPUTE, schema.OFFLOAD)
STEPS = ("hop_a", "hop_b", "hop_c")
INPUT_LEN = 64  # int64 ids per request, about a compute plan's size class

# Passes its input through by DLPack, as the serving models read and answer.
IDENTITY_MODEL = '''
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = torch.from_dlpack(pb_utils.get_input_tensor_by_name(request, "x").to_dlpack()).clone()
            y = pb_utils.Tensor.from_dlpack("y", torch.utils.dlpack.to_dlpack(x))
            responses.append(pb_utils.InferenceResponse(output_tensors=[y]))
        return responses
'''

# The served steps with no work: each reads its inputs as the serving model does
# (`deploy.runtime.triton_io.input_tensors`) and answers an output of the real size.
EMPTY_STEP = '''
import torch
import triton_python_backend_utils as pb_utils

from deploy.runtime.triton_io import input_tensors, output_tensor

INPUTS = {inputs!r}
NUM_TASKS = {num_tasks}


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[output_tensor({output!r}, self.answer(*input_tensors(r, INPUTS)))])
                for r in requests]

    @staticmethod
    def answer(*inputs):
{answer}
'''
EMPTY_ANSWERS = {
    # a plan: its candidates' count, the candidates, and a page row's worth of ids (1 per 16 events)
    schema.LOOKUP: ((*schema.ENSEMBLE_INPUTS,), "compute_plan",
                    "        user, items, actions, candidates = inputs\n"
                    "        c = candidates.reshape(-1)\n"
                    "        return torch.cat([torch.tensor([c.numel()]), c, torch.zeros(items.numel() // 16, dtype=torch.int64)]).reshape(1, -1)"),
    # the sealed scores: c rows and the checksum row
    schema.COMPUTE: ((schema.COMPUTE_PLAN,), "candidate_scores",
                     "        (plan,) = inputs\n"
                     "        return torch.zeros(1, int(plan[0, 0]) + 1, NUM_TASKS)"),
    schema.OFFLOAD: (None, "scores",
                     "        sealed = inputs[0]\n"
                     "        return sealed[:, :-1]"),
}

STEP_CONFIG = '''name: "{name}"
backend: "python"
max_batch_size: 64
input [ {{ name: "x" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true }} ]
output [ {{ name: "y" data_type: TYPE_INT64 dims: [ -1 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 0 }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
'''


def ensemble_config(name: str, steps: tuple[str, ...]) -> str:
    tensors = ["x", *(f"_t{i}" for i in range(1, len(steps))), "y"]
    step_lines = ",\n".join(
        f'  {{ model_name: "{step}" model_version: -1 input_map {{ key: "x" value: "{tensors[i]}" }} '
        f'output_map {{ key: "y" value: "{tensors[i + 1]}" }} }}' for i, step in enumerate(steps))
    return (f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 0\n'
            'input [ { name: "x" data_type: TYPE_INT64 dims: [ 1, -1 ] } ]\n'
            'output [ { name: "y" data_type: TYPE_INT64 dims: [ 1, -1 ] } ]\n'
            f"ensemble_scheduling {{ step [\n{step_lines}\n] }}\n")


def write_repository(root: Path) -> dict[str, int]:
    """The models under `root`; returns each ensemble's number of steps."""
    for step in STEPS:
        (root / step / "1").mkdir(parents=True)
        (root / step / "1" / "model.py").write_text(IDENTITY_MODEL)
        (root / step / "config.pbtxt").write_text(STEP_CONFIG.format(name=step))
    ensembles = {"hops_1": STEPS[:1], "hops_3": STEPS}
    for name, steps in ensembles.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(ensemble_config(name, steps))
    return {name: len(steps) for name, steps in ensembles.items()}


def write_empty_ranking(root: Path, num_tasks: int = 3) -> None:
    """`hstu_ranking` and its three steps under `root`, the steps' models doing no work."""
    configs = render(num_tasks)
    write(root, {name: configs[name] for name in (schema.ENSEMBLE, schema.LOOKUP, schema.COMPUTE, schema.OFFLOAD)})
    offload_inputs = (*schema.compute_outputs(num_tasks), schema.COMPUTE_PLAN, *schema.OFFLOAD_HISTORY_INPUTS)
    for name, (inputs, output, answer) in EMPTY_ANSWERS.items():
        names = tuple(spec.name for spec in (inputs or offload_inputs))
        (root / name / "1" / "model.py").write_text(EMPTY_STEP.format(inputs=names, num_tasks=num_tasks, output=output,
                                                                      answer=answer))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--interval-ms", type=int, default=4000, help="perf_analyzer's measurement window")
    p.add_argument("--rounds", type=int, default=2, help="each ensemble is measured this often, interleaved")
    p.add_argument("--report-dir", type=Path, default=REPORTS)
    a = p.parse_args(argv)
    install = find_triton()
    install_stub(install)
    env = triton_env(install)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hstu-hops-") as tmp:
        root = Path(tmp)
        steps = write_repository(root / "models")
        write_empty_ranking(root / "models")
        steps[schema.ENSEMBLE] = 3
        data = root / "data.json"
        data.write_text(json.dumps({"data": [{"x": {"content": list(range(1, INPUT_LEN + 1)), "shape": [1, INPUT_LEN]}}]}))
        ranking_data = root / "ranking-data.json"  # the profile's trace (deploy.bench.profile)
        ranking_data.write_text(json.dumps(trace_module.perf_analyzer_data(trace_module.generate(
            trace_module.TraceConfig(num_users=128, num_requests=2048, initial_events_median=300)))))
        http, grpc, metrics = free_loopback_ports(3)
        log = root / "tritonserver.log"
        with log.open("w") as log_file:
            triton = subprocess.Popen(
                [str(install.binary), f"--model-repository={root / 'models'}", f"--backend-directory={install.backend_dir}",
                 "--http-address=127.0.0.1", f"--http-port={http}", "--grpc-address=127.0.0.1", f"--grpc-port={grpc}",
                 "--metrics-address=127.0.0.1", f"--metrics-port={metrics}", "--log-verbose=0"],
                env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            def check_alive() -> None:
                if triton.poll() is not None:
                    raise RuntimeError(f"tritonserver exited with {triton.returncode}; see {log}:\n{log.read_text()[-2000:]}")

            if not wait_until_ready(f"http://127.0.0.1:{http}/v2/health/ready", 120, check_alive):
                raise TimeoutError(f"tritonserver not ready after 120 s:\n{log.read_text()[-2000:]}")
            for concurrency in a.concurrency:
                for _ in range(a.rounds):
                    for model in steps:
                        before = read_model_stats(f"127.0.0.1:{http}")
                        r = run_perf_analyzer(f"127.0.0.1:{grpc}", model, concurrency,
                                              ranking_data if model == schema.ENSEMBLE else data,
                                              root / f"{model}-c{concurrency}.csv", a.interval_ms)
                        if r.error:
                            raise RuntimeError(f"perf_analyzer {model} c={concurrency}: {r.error}")
                        row = {"model": model, "steps": steps[model], "concurrency": concurrency,
                               "req_s": r.throughput, "p50_ms": r.percentile_ms[50], "p99_ms": r.p99_ms}
                        print(f"{model} ({steps[model]} step{'s' if steps[model] > 1 else ''}) c={concurrency}: "
                              f"{r.throughput:.0f} req/s, p50 {r.percentile_ms[50]:.3f} ms, p99 {r.p99_ms:.3f} ms")
                        if model == schema.ENSEMBLE:  # each empty step's batches, as deploy.bench.profile prints
                            by_step = hop_stats(before, read_model_stats(f"127.0.0.1:{http}"), RANKING_STEPS)
                            row["steps_batch"] = {name: {"mean_batch": hop.mean_batch_size, "ms_per_execute": ms_per_execute(hop)}
                                                  for name, hop in by_step.items()}
                            print("   " + "; ".join(f"{name} batch {hop.mean_batch_size:.1f}, {ms_per_execute(hop):.2f} ms "
                                                    "per execute" for name, hop in by_step.items()))
                        results.append(row)
        finally:
            triton.terminate()
            triton.wait(timeout=60)
    c1 = {row["model"]: row["p50_ms"] for row in results if row["concurrency"] == 1}  # the last round's
    summary = {}
    if "hops_1" in c1 and "hops_3" in c1:
        summary["ms_per_added_step_c1"] = (c1["hops_3"] - c1["hops_1"]) / 2
        print(f"one added step costs {summary['ms_per_added_step_c1']:.3f} ms at c=1 (p50, last round)")
    write_dated_report(a.report_dir, "hops", platform.machine(),
                       {"machine": platform.processor() or platform.machine(), "command": sys.argv,
                        "input_len": INPUT_LEN, "results": results, **summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
