# -*- coding: utf-8 -*-
"""The one parser of nvidia-smi's CSV query output used by this project.

Two query forms are supported::

    nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,memory.free \
               --format=csv,noheader,nounits
    nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory \
               --format=csv,noheader,nounits

The parser also accepts the same queries printed with a header line and/or with
units ("143771 MiB"), values nvidia-smi cannot read ("[N/A]", "[Not Supported]"),
extra columns when a header names them, and an empty process list (no lines, or
only the header). Everything here is a pure function of the text, so it is unit
tested on captured output from real GPUs.
"""

from __future__ import annotations

GPU_QUERY_FIELDS = ("index", "uuid", "name", "memory.total", "memory.used", "memory.free")
COMPUTE_APPS_QUERY_FIELDS = ("gpu_uuid", "pid", "process_name", "used_memory")

# nvidia-smi prints these when it cannot read a value (virtualised GPUs, MIG, old drivers).
_UNAVAILABLE_VALUES = frozenset(("[n/a]", "n/a", "[not supported]", "[unknown error]", "[insufficient permissions]", ""))

# The header spells some columns differently from the query key, e.g. the
# compute-apps query key "used_memory" is printed as "used_gpu_memory [MiB]".
_HEADER_ALIASES = {
    "used_gpu_memory": "used_memory",
}


class NvidiaSmiParseError(ValueError):
    """Raised when nvidia-smi output does not have the expected shape."""


def gpu_query_argv(nvidia_smi="nvidia-smi"):
    """Return the argv of the GPU memory query this parser reads."""
    return [nvidia_smi, "--query-gpu=" + ",".join(GPU_QUERY_FIELDS), "--format=csv,noheader,nounits"]


def compute_apps_query_argv(nvidia_smi="nvidia-smi"):
    """Return the argv of the compute-process query this parser reads."""
    return [nvidia_smi, "--query-compute-apps=" + ",".join(COMPUTE_APPS_QUERY_FIELDS), "--format=csv,noheader,nounits"]


def _header_key(cell):
    """'memory.total [MiB]' -> 'memory.total'; 'used_gpu_memory [MiB]' -> 'used_memory'."""
    key = cell.strip().split(" [", 1)[0].strip().lower()
    return _HEADER_ALIASES.get(key, key)


def _is_unavailable(value):
    return value.strip().lower() in _UNAVAILABLE_VALUES


def parse_mib(value):
    """Parse a memory value in MiB ('61958', '61958 MiB', '61958MiB'); None when unavailable."""
    text = value.strip()
    if _is_unavailable(text):
        return None
    if text.endswith("MiB"):
        text = text[:-3].strip()
    try:
        return int(text)
    except ValueError:
        raise NvidiaSmiParseError("expected a memory value in MiB, got %r" % value) from None


def _parse_int(value, what):
    text = value.strip()
    if _is_unavailable(text):
        return None
    try:
        return int(text)
    except ValueError:
        raise NvidiaSmiParseError("expected an integer %s, got %r" % (what, value)) from None


def _text_or_none(value):
    text = value.strip()
    return None if _is_unavailable(text) else text


def _meaningful_lines(text):
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        # Older drivers print this sentence instead of an empty CSV body.
        if line.lower().startswith("no running processes found"):
            continue
        yield line


def _split_row(line, columns, free_text_column):
    """Split one CSV row into a {column: cell} dict.

    nvidia-smi does not quote cells, so a comma inside the one free-text column
    (a GPU or process name) produces extra cells; they are joined back.
    """
    cells = [cell.strip() for cell in line.split(",")]
    extra = len(cells) - len(columns)
    if extra < 0:
        raise NvidiaSmiParseError(
            "expected %d comma-separated values (%s), got %d in line %r"
            % (len(columns), ", ".join(columns), len(cells), line)
        )
    if extra > 0:
        position = columns.index(free_text_column)
        joined = ", ".join(cells[position:position + extra + 1])
        cells = cells[:position] + [joined] + cells[position + extra + 1:]
    return dict(zip(columns, cells))


def _rows(text, fields, first_field, free_text_column):
    """Yield {field: cell} for each data row, with or without a header line."""
    columns = list(fields)
    for line in _meaningful_lines(text):
        first_cell = line.split(",", 1)[0].strip().lower()
        if first_cell == first_field:
            header = [_header_key(cell) for cell in line.split(",")]
            missing = [field for field in fields if field not in header]
            if missing:
                raise NvidiaSmiParseError(
                    "nvidia-smi header lacks column(s) %s: %r" % (", ".join(missing), line)
                )
            columns = header
            continue
        row = _split_row(line, columns, free_text_column)
        yield dict((field, row[field]) for field in fields)


def parse_gpu_query(text):
    """Parse --query-gpu=index,uuid,name,memory.total,memory.used,memory.free output.

    Returns a list of dicts ordered by GPU index:
    {index, uuid, name, total_mib, used_mib, free_mib}; memory values are None
    when nvidia-smi reports them as unavailable.
    """
    gpus = []
    for row in _rows(text, GPU_QUERY_FIELDS, "index", "name"):
        index = _parse_int(row["index"], "GPU index")
        if index is None:
            raise NvidiaSmiParseError("GPU index missing in row %r" % (row,))
        gpus.append({
            "index": index,
            "uuid": _text_or_none(row["uuid"]),
            "name": _text_or_none(row["name"]),
            "total_mib": parse_mib(row["memory.total"]),
            "used_mib": parse_mib(row["memory.used"]),
            "free_mib": parse_mib(row["memory.free"]),
        })
    gpus.sort(key=lambda gpu: gpu["index"])
    return gpus


def parse_compute_apps(text):
    """Parse --query-compute-apps=gpu_uuid,pid,process_name,used_memory output.

    Returns a list of dicts: {gpu_uuid, pid, name, used_mib}; an empty list when
    no process uses a GPU (empty output, or only the header line).
    """
    processes = []
    for row in _rows(text, COMPUTE_APPS_QUERY_FIELDS, "gpu_uuid", "process_name"):
        processes.append({
            "gpu_uuid": _text_or_none(row["gpu_uuid"]),
            "pid": _parse_int(row["pid"], "pid"),
            "name": _text_or_none(row["process_name"]),
            "used_mib": parse_mib(row["used_memory"]),
        })
    return processes


def attach_gpu_index(processes, gpus):
    """Return copies of processes with gpu_index set from the GPU whose uuid matches (None if unknown)."""
    index_by_uuid = dict((gpu["uuid"], gpu["index"]) for gpu in gpus if gpu.get("uuid"))
    attached = []
    for process in processes:
        item = dict(process)
        item["gpu_index"] = index_by_uuid.get(process.get("gpu_uuid"))
        attached.append(item)
    return attached
