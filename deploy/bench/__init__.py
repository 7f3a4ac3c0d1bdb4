"""hstu-bench and the other benchmarks: `python -m deploy.bench` (cli), phases, results, report, plots,
perf_analyzer; the compute, store, control-plane and scale-out benchmarks (`python -m deploy.bench.<name>`)."""
