"""State of the simulated GPUs of the test host: which GPUs exist and which processes hold memory.

One JSON file (``/var/lib/fake-gpu/state.json``, or ``$FAKE_GPU_STATE``) is the driver's truth:

    {
      "driver_version": "580.159.04", "cuda_version": "13.0",
      "gpus": [{"index": 0, "uuid": "GPU-...", "name": "NVIDIA H200", "total_mib": 143771,
                "reserved_mib": 615, "bus_id": "00000000:00:06.0", ...}],
      "processes": [{"pid": 123, "start_ticks": 4567, "gpu": 0, "used_mib": 130000,
                     "name": "python3"}]
    }

Like the real driver, a process's memory counts only while that process lives: an entry whose
pid is gone (or was reused by another process, told apart by its start time) is ignored by every
reader, so a crashed or killed holder frees its memory without cleaning up.

Used by the fake ``nvidia-smi`` (reads), ``fake-gpu-hold`` and ``fake-inference`` (register
and unregister), and the ``fake-gpu`` command line (``python3 -m fake_gpu``).
"""

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import sys
import tempfile

STATE_PATH_DEFAULT = "/var/lib/fake-gpu/state.json"

# Figures of a real idle H200 (driver 580.159.04): 143771 MiB in total, 615 MiB of them reserved
# by the driver, so an idle GPU shows 0 MiB used and 143156 MiB free.
H200_TOTAL_MIB = 143771
H200_RESERVED_MIB = 615
# A process that holds memory also costs the driver a small context: with one 61958 MiB process
# the real GPU reports 61967 MiB used, and used + free is one MiB larger than when idle (the
# driver rounds its reserved share down once a context exists).
CONTEXT_OVERHEAD_MIB = 9
RESERVED_ROUNDING_WITH_CONTEXT_MIB = 1


def state_path():
    return os.environ.get("FAKE_GPU_STATE", STATE_PATH_DEFAULT)


def fake_uuid(index, seed="moe-bench-simhost"):
    digest = hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()
    return f"GPU-{digest[0:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def default_gpu(index, name="NVIDIA H200", total_mib=H200_TOTAL_MIB, reserved_mib=H200_RESERVED_MIB):
    return {
        "index": index,
        "uuid": fake_uuid(index),
        "name": name,
        "total_mib": total_mib,
        "reserved_mib": reserved_mib,
        "bus_id": f"00000000:00:{6 + index:02X}.0",
        "persistence_mode": "On",
        "pstate": "P0",
        "temperature_idle_c": 35 + index % 2,
        "temperature_busy_c": 36 + index % 2,
        "power_idle_w": 76.62,
        "power_busy_w": 119.37,
        "power_limit_w": 700.0,
        "clocks_sm_mhz": 345,
        "clocks_mem_mhz": 3201,
        "utilization_pct": 0,
    }


def default_state(count=8, name="NVIDIA H200", total_mib=H200_TOTAL_MIB, reserved_mib=H200_RESERVED_MIB):
    return {
        "driver_version": "580.159.04",
        "cuda_version": "13.0",
        "gpus": [default_gpu(i, name, total_mib, reserved_mib) for i in range(count)],
        "processes": [],
    }


class NoDriver(Exception):
    """The state file is missing or unreadable: nvidia-smi answers like a host without a driver."""


def load_state(path=None):
    path = path or state_path()
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError) as exc:
        raise NoDriver(f"{path}: {exc}") from exc


def _write_state(state, path):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # Readers never take the lock, so they must only ever see a whole file: write beside, rename.
    fd, tmp = tempfile.mkstemp(prefix=".state-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(state, handle, indent=2)
            handle.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked_state(path=None):
    """Read, let the caller change, and write back the state under an exclusive lock."""
    path = path or state_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".lock", "a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = load_state(path)
        yield state
        _write_state(state, path)


def process_start_ticks(pid):
    """Start time of a process (clock ticks after boot), or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19])


def is_alive(entry):
    ticks = process_start_ticks(entry["pid"])
    if ticks is None:
        return False
    return entry.get("start_ticks") in (None, ticks)


def live_processes(state):
    return [p for p in state.get("processes", []) if is_alive(p)]


def gpu_memory(state, gpu, processes):
    """(used, free) MiB of one GPU as the real driver reports them."""
    held = [p["used_mib"] for p in processes if p["gpu"] == gpu["index"]]
    if held:
        used = sum(held) + CONTEXT_OVERHEAD_MIB
        reserved = gpu["reserved_mib"] - RESERVED_ROUNDING_WITH_CONTEXT_MIB
    else:
        used, reserved = 0, gpu["reserved_mib"]
    free = max(gpu["total_mib"] - reserved - used, 0)
    return used, free


def register(pid, gpus, used_mib, name, path=None):
    """Record that process ``pid`` holds ``used_mib`` MiB on each GPU index in ``gpus``."""
    ticks = process_start_ticks(pid)
    if ticks is None:
        raise ValueError(f"process {pid} does not exist")
    with locked_state(path) as state:
        known = {g["index"] for g in state["gpus"]}
        missing = sorted(set(gpus) - known)
        if missing:
            raise ValueError(f"no GPU with index {missing} (GPUs: {sorted(known)})")
        # Drop this pid's earlier entries and every entry of a process that is gone.
        state["processes"] = [
            p for p in state["processes"] if p["pid"] != pid and is_alive(p)
        ]
        for gpu in gpus:
            state["processes"].append(
                {"pid": pid, "start_ticks": ticks, "gpu": gpu, "used_mib": int(used_mib), "name": name}
            )


def unregister(pid, path=None):
    with locked_state(path) as state:
        state["processes"] = [p for p in state["processes"] if p["pid"] != pid and is_alive(p)]


def init(count, name, total_mib, reserved_mib, path=None):
    """Set the GPUs; keep the registrations of live processes on GPUs that still exist."""
    path = path or state_path()
    fresh = default_state(count, name, total_mib, reserved_mib)
    try:
        with locked_state(path) as state:
            fresh["processes"] = [p for p in live_processes(state) if p["gpu"] < count]
            state.clear()
            state.update(fresh)
    except NoDriver:
        _write_state(fresh, path)


def set_unreadable(gpus, fields, path=None):
    """Make nvidia-smi print [N/A] for these query fields of these GPUs (an empty list: none)."""
    with locked_state(path) as state:
        known = {g["index"] for g in state["gpus"]}
        missing = sorted(set(gpus) - known)
        if missing:
            raise ValueError(f"no GPU with index {missing} (GPUs: {sorted(known)})")
        for gpu in state["gpus"]:
            if gpu["index"] in gpus:
                gpu["na_fields"] = list(fields)


def parse_gpu_list(text):
    try:
        return [int(part) for part in str(text).split(",") if part.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indexes such as 0 or 0,1,2, got {text!r}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="fake-gpu", description="Manage the simulated GPU state.")
    parser.add_argument("--state", help=f"state file (default ${{FAKE_GPU_STATE}} or {STATE_PATH_DEFAULT})")
    sub = parser.add_subparsers(dest="command", required=True)
    p_init = sub.add_parser("init", help="(re)create the GPUs, keeping live holders")
    p_init.add_argument("--count", type=int, default=8)
    p_init.add_argument("--name", default="NVIDIA H200")
    p_init.add_argument("--total-mib", type=int, default=H200_TOTAL_MIB)
    p_init.add_argument("--reserved-mib", type=int, default=H200_RESERVED_MIB)
    p_reg = sub.add_parser("register", help="record that a process holds memory")
    p_reg.add_argument("--pid", type=int, required=True)
    p_reg.add_argument("--gpus", type=parse_gpu_list, required=True, help="e.g. 0 or 0,1")
    p_reg.add_argument("--mib", type=int, required=True)
    p_reg.add_argument("--name", default="python3")
    p_unreg = sub.add_parser("unregister", help="forget a process")
    p_unreg.add_argument("--pid", type=int, required=True)
    p_na = sub.add_parser("unreadable", help="nvidia-smi prints [N/A] for these fields of these GPUs")
    p_na.add_argument("--gpus", type=parse_gpu_list, required=True, help="e.g. 0 or 0,1")
    p_na.add_argument("--fields", default="", help="query fields, e.g. memory.used,memory.free,used_memory; empty: none")
    sub.add_parser("show", help="print GPUs with used/free MiB and the live holders as JSON")
    args = parser.parse_args(argv)

    try:
        if args.command == "init":
            if args.count < 0:
                parser.error("--count must be 0 or more")
            init(args.count, args.name, args.total_mib, args.reserved_mib, args.state)
        elif args.command == "register":
            register(args.pid, args.gpus, args.mib, args.name, args.state)
        elif args.command == "unregister":
            unregister(args.pid, args.state)
        elif args.command == "unreadable":
            set_unreadable(args.gpus, [f.strip() for f in args.fields.split(",") if f.strip()], args.state)
        elif args.command == "show":
            state = load_state(args.state)
            processes = live_processes(state)
            report = {"gpus": [], "processes": processes}
            for gpu in state["gpus"]:
                used, free = gpu_memory(state, gpu, processes)
                report["gpus"].append({"index": gpu["index"], "uuid": gpu["uuid"], "used_mib": used,
                                       "free_mib": free, "total_mib": gpu["total_mib"]})
            json.dump(report, sys.stdout, indent=2)
            print()
    except (ValueError, NoDriver) as exc:
        print(f"fake-gpu: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
