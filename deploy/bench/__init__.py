"""hstu-bench and the other benchmarks: `python -m deploy.bench` (cli), config, phases, metric_waits, results, report, plots,
perf_analyzer; the compute, store, control-plane and scale-out benchmarks (`python -m deploy.bench.<name>`)."""
