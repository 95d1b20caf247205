"""The nvidia-smi parser against every real capture in tests/fixtures/nvidia-smi/.

The CSV captures are parsed directly; the XML (-q -x) and table captures of the same
moments are read independently here and must agree with what the parser returns.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree

import pytest

from moe_bench_testlib import FIXTURES, fixture_text

from ansible.module_utils.nvidia_smi import (
    NvidiaSmiParseError,
    attach_gpu_index,
    compute_apps_query_argv,
    gpu_query_argv,
    parse_compute_apps,
    parse_gpu_query,
    parse_mib,
)

H200_UUID = "GPU-33b36c28-f7d1-d867-b2a9-c29c88a09e61"
X2_UUIDS = ["GPU-ba2fb2e1-e13f-855e-a2da-7a7eab16b60f", "GPU-fedd8f2c-0670-9980-b400-024569efb1fb"]


def test_query_argv_is_the_documented_csv_form():
    assert gpu_query_argv("/usr/bin/nvidia-smi") == [
        "/usr/bin/nvidia-smi",
        "--query-gpu=index,uuid,name,memory.total,memory.used,memory.free",
        "--format=csv,noheader,nounits",
    ]
    assert compute_apps_query_argv() == [
        "nvidia-smi",
        "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
        "--format=csv,noheader,nounits",
    ]


def test_busy_h200_noheader_nounits():
    assert parse_gpu_query(fixture_text("query-gpu_busy.csv")) == [{
        "index": 0, "uuid": H200_UUID, "name": "NVIDIA H200",
        "total_mib": 143771, "used_mib": 61967, "free_mib": 81190,
    }]


def test_idle_h200_with_header_units_and_extra_columns():
    # This capture asked for more columns (utilization, power, clocks) with a header and units.
    assert parse_gpu_query(fixture_text("query-gpu_idle.csv")) == [{
        "index": 0, "uuid": H200_UUID, "name": "NVIDIA H200",
        "total_mib": 143771, "used_mib": 0, "free_mib": 143156,
    }]


def test_two_gpus_busy_and_idle():
    busy = parse_gpu_query(fixture_text("x2_query-gpu_busy.csv"))
    idle = parse_gpu_query(fixture_text("x2_query-gpu_idle.csv"))
    assert [(gpu["index"], gpu["uuid"], gpu["used_mib"], gpu["free_mib"]) for gpu in busy] == [
        (0, X2_UUIDS[0], 41487, 101670), (1, X2_UUIDS[1], 46607, 96550)]
    assert [(gpu["index"], gpu["used_mib"], gpu["free_mib"], gpu["total_mib"]) for gpu in idle] == [
        (0, 0, 143156, 143771), (1, 0, 143156, 143771)]


def test_compute_apps_with_header_and_units():
    assert parse_compute_apps(fixture_text("query-compute-apps_busy.csv")) == [
        {"gpu_uuid": H200_UUID, "pid": 452, "name": "python3", "used_mib": 61958}]
    assert parse_compute_apps(fixture_text("x2_query-compute-apps_busy.csv")) == [
        {"gpu_uuid": X2_UUIDS[0], "pid": 558, "name": "python3", "used_mib": 41478},
        {"gpu_uuid": X2_UUIDS[1], "pid": 559, "name": "python3", "used_mib": 46598},
    ]


def test_compute_apps_empty_forms():
    assert parse_compute_apps(fixture_text("x2_query-compute-apps_idle.csv")) == []  # header only
    assert parse_compute_apps("") == []  # noheader form with no process
    assert parse_compute_apps("\n\n") == []
    assert parse_compute_apps("No running processes found\n") == []


def test_noheader_form_of_compute_apps_derived_from_capture():
    # The capture has a header and units; the module asks for neither. Same numbers.
    with_header = fixture_text("x2_query-compute-apps_busy.csv").splitlines()
    noheader_nounits = "\n".join(line.replace(" MiB", "") for line in with_header[1:]) + "\n"
    assert parse_compute_apps(noheader_nounits) == parse_compute_apps("\n".join(with_header))


def test_unavailable_values_become_none():
    gpus = parse_gpu_query("0, GPU-abc, NVIDIA H200, [N/A], [N/A], [Not Supported]\n")
    assert gpus == [{"index": 0, "uuid": "GPU-abc", "name": "NVIDIA H200",
                     "total_mib": None, "used_mib": None, "free_mib": None}]
    processes = parse_compute_apps("GPU-abc, 77, python3, [N/A]\n")
    assert processes == [{"gpu_uuid": "GPU-abc", "pid": 77, "name": "python3", "used_mib": None}]


def test_comma_in_process_name_is_kept():
    processes = parse_compute_apps("GPU-abc, 77, /opt/app,v2/bin/server, 1024\n")
    assert processes == [{"gpu_uuid": "GPU-abc", "pid": 77, "name": "/opt/app, v2/bin/server", "used_mib": 1024}]


def test_gpus_sorted_by_index():
    text = "1, GPU-b, B, 10, 1, 9\n0, GPU-a, A, 10, 2, 8\n"
    assert [gpu["index"] for gpu in parse_gpu_query(text)] == [0, 1]


@pytest.mark.parametrize("text, message", [
    ("0, GPU-a, NVIDIA H200, 143771, 0\n", "expected 6 comma-separated values"),
    ("0, GPU-a, NVIDIA H200, lots, 0, 1\n", "expected a memory value in MiB"),
    ("x, GPU-a, NVIDIA H200, 1, 0, 1\n", "expected an integer GPU index"),
    ("index, uuid, name, memory.total [MiB]\n", "header lacks column(s) memory.used, memory.free"),
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", "expected 6"),
])
def test_malformed_gpu_query_raises_clear_error(text, message):
    with pytest.raises(NvidiaSmiParseError, match=re.escape(message)):
        parse_gpu_query(text)


def test_malformed_pid_raises():
    with pytest.raises(NvidiaSmiParseError, match="expected an integer pid"):
        parse_compute_apps("GPU-a, abc, python3, 10\n")


def test_parse_mib_forms():
    assert parse_mib("61958") == 61958
    assert parse_mib(" 61958 MiB ") == 61958
    assert parse_mib("61958MiB") == 61958
    assert parse_mib("[N/A]") is None
    with pytest.raises(NvidiaSmiParseError):
        parse_mib("60 GiB")


def test_attach_gpu_index_by_uuid():
    gpus = parse_gpu_query(fixture_text("x2_query-gpu_busy.csv"))
    processes = parse_compute_apps(fixture_text("x2_query-compute-apps_busy.csv"))
    processes.append({"gpu_uuid": "GPU-unknown", "pid": 1, "name": "x", "used_mib": 1})
    attached = attach_gpu_index(processes, gpus)
    assert [(p["pid"], p["gpu_index"]) for p in attached] == [(558, 0), (559, 1), (1, None)]
    assert "gpu_index" not in processes[0]  # inputs are not mutated


def _xml_gpus(name):
    root = ElementTree.parse(FIXTURES / name).getroot()
    gpus = []
    for gpu in root.findall("gpu"):
        memory = gpu.find("fb_memory_usage")
        gpus.append({
            "index": int(gpu.findtext("minor_number")),
            "uuid": gpu.findtext("uuid"),
            "name": gpu.findtext("product_name"),
            "total_mib": int(memory.findtext("total").split()[0]),
            "used_mib": int(memory.findtext("used").split()[0]),
            "free_mib": int(memory.findtext("free").split()[0]),
            "processes": [
                (int(process.findtext("pid")), process.findtext("process_name"),
                 int(process.findtext("used_memory").split()[0]))
                for process in gpu.find("processes").findall("process_info")
            ],
        })
    return gpus


@pytest.mark.parametrize("xml_name, gpu_csv, apps_csv", [
    ("nvidia-smi-q-x_busy.xml", "query-gpu_busy.csv", "query-compute-apps_busy.csv"),
    ("nvidia-smi-q-x_idle.xml", "query-gpu_idle.csv", None),
    ("x2_nvidia-smi-q-x_busy.xml", "x2_query-gpu_busy.csv", "x2_query-compute-apps_busy.csv"),
])
def test_csv_parse_agrees_with_xml_capture(xml_name, gpu_csv, apps_csv):
    expected = _xml_gpus(xml_name)
    gpus = parse_gpu_query(fixture_text(gpu_csv))
    processes = attach_gpu_index(parse_compute_apps(fixture_text(apps_csv) if apps_csv else ""), gpus)
    assert [dict((k, gpu[k]) for k in ("index", "uuid", "name", "total_mib", "used_mib", "free_mib"))
            for gpu in expected] == gpus
    for gpu in expected:
        assert sorted((p["pid"], p["name"], p["used_mib"]) for p in processes if p["gpu_index"] == gpu["index"]) \
            == sorted(gpu["processes"])


@pytest.mark.parametrize("table_name, gpu_csv, apps_csv", [
    ("nvidia-smi_busy.txt", "query-gpu_busy.csv", "query-compute-apps_busy.csv"),
    ("x2_nvidia-smi_busy.txt", "x2_query-gpu_busy.csv", "x2_query-compute-apps_busy.csv"),
])
def test_csv_parse_agrees_with_table_capture(table_name, gpu_csv, apps_csv):
    table = fixture_text(table_name)
    memory_usage = [(int(used), int(total)) for used, total in re.findall(r"(\d+)MiB / (\d+)MiB", table)]
    holders = [(int(gpu), int(pid), name, int(mib))
               for gpu, pid, name, mib in re.findall(r"\|\s+(\d+)\s+N/A\s+N/A\s+(\d+)\s+C\s+(\S+)\s+(\d+)MiB", table)]
    gpus = parse_gpu_query(fixture_text(gpu_csv))
    processes = attach_gpu_index(parse_compute_apps(fixture_text(apps_csv)), gpus)
    assert [(gpu["used_mib"], gpu["total_mib"]) for gpu in gpus] == memory_usage
    assert sorted((p["gpu_index"], p["pid"], p["name"], p["used_mib"]) for p in processes) == sorted(holders)


def test_every_fixture_file_is_covered():
    covered = {
        "README.md", "x2_topo.txt",  # documentation and topology: not memory data
        "query-gpu_busy.csv", "query-gpu_idle.csv", "x2_query-gpu_busy.csv", "x2_query-gpu_idle.csv",
        "query-compute-apps_busy.csv", "x2_query-compute-apps_busy.csv", "x2_query-compute-apps_idle.csv",
        "nvidia-smi-q-x_busy.xml", "nvidia-smi-q-x_idle.xml", "x2_nvidia-smi-q-x_busy.xml",
        "nvidia-smi_busy.txt", "nvidia-smi_idle.txt", "x2_nvidia-smi_busy.txt",
    }
    assert {path.name for path in FIXTURES.iterdir()} <= covered


def test_idle_table_shows_no_process_and_zero_used():
    table = fixture_text("nvidia-smi_idle.txt")
    assert re.findall(r"(\d+)MiB / (\d+)MiB", table) == [("0", "143771")]
    assert parse_gpu_query(fixture_text("query-gpu_idle.csv"))[0]["used_mib"] == 0
