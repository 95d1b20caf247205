"""Command line: python -m moe_bench_report build --run-dir DIR --host HOST [options].

Exit codes: 0 report written (a regression is reported, not an error); 2 bad arguments;
3 the report could not be written (message on stderr says what and where).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .figures import DEFAULT_KNEE_GROWTH, DEFAULT_REGRESSION_THRESHOLD


def _value(text: str):
    """A key=value value: JSON when it parses (numbers, objects), the plain string otherwise."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 10:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction > 0 (0.10 means 10%)")
    return value


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m moe_bench_report", description=__doc__.splitlines()[0])
    commands = top.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="write the report of one fetched run")
    build.add_argument("--run-dir", required=True, type=Path, help="controller folder of the run: results/<host>/<run id>")
    build.add_argument("--host", required=True, help="inventory hostname of the benchmarked host")
    build.add_argument("--results", type=Path, help="results JSON (default RUN_DIR/results.json)")
    build.add_argument("--results-root", type=Path, help="folder holding one folder per host (default: two levels above RUN_DIR)")
    build.add_argument("--run-id", help="run id (default: moe_bench_plan.run_id from the timeline, else RUN_DIR's name)")
    build.add_argument("--timeline-json", type=Path,
                       help="JSON object: the timeline facts, moe_bench_plan and launch variables; "
                            "'-' reads it from standard input and records it as RUN_DIR/timeline.json")
    build.add_argument("--timeline", nargs="*", default=[], metavar="KEY=VALUE", help="timeline facts as key=value (override --timeline-json)")
    build.add_argument("--threshold", type=_fraction, default=DEFAULT_REGRESSION_THRESHOLD,
                       help="flag a slowdown beyond this fraction at any M (default 0.10)")
    build.add_argument("--knee-growth", type=_fraction, default=DEFAULT_KNEE_GROWTH,
                       help="knee rule: time growth per doubling of M below which the plateau starts (default 0.10)")
    build.add_argument("--project-dir", type=Path, help="project checkout whose git commit the manifest records")
    build.add_argument("--tp-results", type=Path,
                       help="the tensor-parallel run's results JSON (default RUN_DIR/results-tp.json when it exists)")
    build.add_argument("--gpu-outlier", type=_fraction, default=0.10,
                       help="one payload per GPU: flag a GPU this fraction over the host's median GPU at any M (default 0.10)")
    build.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    build.add_argument("--print", dest="print_format", choices=("text", "json"), default="text",
                       help="stdout: the console summary (text) or the headline and console lines (json)")
    fleet = commands.add_parser("fleet", help="write the fleet report of a rollout")
    fleet.add_argument("--fleet-dir", required=True, type=Path, help="controller folder of the fleet report")
    fleet.add_argument("--hosts-json", required=True, type=Path,
                       help="JSON list: one {host, outcome, why, run_dir, run_id} per targeted host; '-' reads "
                            "it from standard input and records it as FLEET_DIR/hosts.json")
    fleet.add_argument("--fleet-id", help="the rollout's id (shown in the titles)")
    fleet.add_argument("--outlier", type=_fraction, default=0.10,
                       help="flag a host/GPU this fraction over the fleet's median at any M (default 0.10)")
    fleet.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    fleet.add_argument("--print", dest="print_format", choices=("text", "json"), default="text")
    return top


def fleet_main(arguments) -> int:
    from .build import schema_module
    from .fleet import build_fleet

    try:
        if str(arguments.hosts_json) == "-":
            hosts = json.loads(sys.stdin.read())
            arguments.fleet_dir.mkdir(parents=True, exist_ok=True)
            (arguments.fleet_dir / "hosts.json").write_text(json.dumps(hosts, indent=2) + "\n", encoding="utf-8")
        else:
            hosts = json.loads(arguments.hosts_json.read_text(encoding="utf-8"))
        fleet = build_fleet(arguments.fleet_dir, hosts, schema_module().load_results, arguments.outlier,
                            plots=not arguments.no_plots, fleet_id=arguments.fleet_id)
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"moe_bench_report: the fleet report in {arguments.fleet_dir} could not be written: {error}. "
              "The host reports are untouched.", file=sys.stderr)
        return 3
    if arguments.print_format == "json":
        print(json.dumps({key: fleet[key] for key in ("fleet_id", "counts", "hosts", "outliers", "console")}))
    else:
        print("\n".join(fleet["console"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    arguments = parser().parse_args(argv)
    if arguments.command == "fleet":
        return fleet_main(arguments)
    given: dict = {}
    if arguments.timeline_json is not None:
        from_stdin = str(arguments.timeline_json) == "-"
        try:
            given = json.loads(sys.stdin.read() if from_stdin else arguments.timeline_json.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            print(f"moe_bench_report: cannot read --timeline-json {arguments.timeline_json}: {error}", file=sys.stderr)
            return 2
        if not isinstance(given, dict):
            print(f"moe_bench_report: --timeline-json {arguments.timeline_json} is not a JSON object", file=sys.stderr)
            return 2
        if from_stdin:
            # The playbook hands the facts over on stdin; they are kept beside the results (the
            # fleet report and a later rebuild read them there).
            arguments.run_dir.mkdir(parents=True, exist_ok=True)
            (arguments.run_dir / "timeline.json").write_text(json.dumps(given, indent=2, sort_keys=True) + "\n",
                                                             encoding="utf-8")
    for pair in arguments.timeline:
        key, separator, value = pair.partition("=")
        if not separator or not key:
            print(f"moe_bench_report: --timeline wants KEY=VALUE, got {pair!r}", file=sys.stderr)
            return 2
        given[key] = _value(value)

    from .build import build_report

    try:
        summary = build_report(
            arguments.run_dir,
            arguments.host,
            given,
            results_path=arguments.results,
            results_root=arguments.results_root,
            run_id=arguments.run_id,
            threshold=arguments.threshold,
            knee_growth=arguments.knee_growth,
            project_dir=arguments.project_dir,
            plots=not arguments.no_plots,
            tp_results_path=arguments.tp_results,
            gpu_outlier=arguments.gpu_outlier,
        )
    except (OSError, ValueError) as error:
        print(
            f"moe_bench_report: the report of host {arguments.host} in {arguments.run_dir} could not be written: {error}. "
            "The benchmark results on disk are untouched; fix the cause and rerun: "
            f"python -m moe_bench_report build --run-dir {arguments.run_dir} --host {arguments.host}",
            file=sys.stderr,
        )
        return 3
    if arguments.print_format == "json":
        print(json.dumps({"headline": summary["headline"], "console": summary["console"]}))
    else:
        print("\n".join(summary["console"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
