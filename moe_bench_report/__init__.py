"""The controller-side report of one benchmark run.

From the fetched results folder `results/<host>/<run id>/` it writes:

- `manifest.json`: what ran where (project commit, host, GPU, driver, torch/triton, the
  payload config) and when (service stopped, benchmark start/end, service ready again), with
  the downtime computed from those timestamps, and who launched the run;
- `summary.md` and `summary.json`: the per-M table, the knee, the ceilings, the downtime and
  the comparison with the previous run of the same host and configuration;
- `per_token.png` and `total_time.png`;
- and, one level up, `history.json` and `index.md` of the host, and `results/index.md`.

Results are read only through `moe_bench.schema.load_results` (files/moe_bench/schema.py).
Run it as `python -m moe_bench_report build --run-dir DIR --host HOST ...`.
"""

REPORT_VERSION = 1
