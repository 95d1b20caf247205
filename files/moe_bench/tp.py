"""The tensor-parallel MoE layer: `--tp-ranks N` runs the layer over N ranks, one process per device.

Rank r holds 1/N of every expert's intermediate size (the `--tp N` shard: gate and up rows
[r I/N, (r + 1) I/N) of W13 and the same K range of W2), computes its partial [M, hidden]
output, and the ranks sum the partials with one all-reduce of the activation dtype, as a
tensor-parallel serving engine runs the layer. Per M three things are timed, each on its own:
the shard's MoE, the all-reduce of the output, and the whole layer (MoE, then all-reduce).

The shards are cut from one full layer built from the seed, so their sum is checked against the
single-device float32 reference of that whole layer (rank 0 keeps the full layer for the check),
per output row as in the one-device run.

Processes: the process the operator starts (the launcher) spawns the ranks, owns the results
file and is the only one writing it; the ranks send it what to record through a queue. A rank
that fails reports why and exits; the launcher then stops the others, which may be waiting in a
collective that can no longer complete. Collectives: NCCL between CUDA devices (rank r on
cuda:r of the visible devices), gloo on the CPU.

NVLink multicast stays off: the launcher sets MULTICAST_OFF in its own environment before any
rank starts (ranks and whatever they start inherit it) and each rank sets it again before
NCCL starts, whatever the operator's environment said. On the shared machines this runs on, a
program using multicast can put all of a host's GPUs out of service.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta

from . import cli, perfmodel, presets
from .quant import MoEShape

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# Samples per phase and M, the same count on every rank: a time budget (as the one-device run
# uses) would let ranks stop after different counts and leave one waiting in a collective.
SAMPLES = {"cuda": 100, "cpu": 5}
WARMUP_ROUNDS = {"cuda": 3, "cpu": 1}
# How long a collective may wait for a peer before torch gives up. The launcher notices a dead
# rank within a poll and stops the others long before this.
COLLECTIVE_TIMEOUT_S = 900
# After one rank reported a failure, how long the others get to exit on their own before the
# launcher stops them (they may be blocked in a collective with the failed rank).
RANK_EXIT_GRACE_S = 5.0
POLL_S = 0.2


def allreduce_bandwidth_gbps(nbytes: int, us: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of an all-reduce of `nbytes` per rank taking `us`, as nccl-tests
    define them: algbw = bytes / time; busbw = algbw * 2 (n - 1) / n, the bytes each rank's link
    carries in a ring all-reduce (a reduce-scatter and an all-gather, each moving (n - 1) / n
    of the buffer), so figures at different rank counts compare against the link's bandwidth."""
    if ranks < 1 or us <= 0:
        raise ValueError(f"need ranks >= 1 and a positive time, got ranks={ranks}, us={us}")
    algbw = nbytes / (us * 1e-6) / 1e9
    return algbw, algbw * 2 * (ranks - 1) / ranks


def full_layer_shape(settings: cli.Settings) -> MoEShape:
    """The whole layer the ranks share: the shard's shape with inter times the rank count."""
    shard = settings.shape
    return MoEShape(experts=shard.experts, hidden=shard.hidden, inter=shard.inter * settings.args.tp_ranks,
                    topk=shard.topk, group_size=shard.group_size)


def rank_devices(settings: cli.Settings) -> list[str]:
    ranks = settings.args.tp_ranks
    return ["cpu"] * ranks if settings.device_kind == "cpu" else [f"cuda:{rank}" for rank in range(ranks)]


def collective_backend(settings: cli.Settings) -> str:
    return "gloo" if settings.device_kind == "cpu" else "nccl"


# ---- the shard of one rank -----------------------------------------------------------------

def shard_weights(full, rank: int, ranks: int):
    """Rank `rank`'s part of the full layer's weights (quant.MoEWeights), in the same packed
    layout: W13's gate and up output columns [r I/N, (r + 1) I/N) (each half's slice, gate
    first), W2's reduction rows of the same range, and their scales. Re-packed one expert at a
    time from the int4 values, so any shard boundary allowed by --tp works (the pairing of
    nibbles follows the shard's own K)."""
    import torch

    from . import quant

    shape = full.shape
    shard = presets.shard_shape(shape, ranks)
    part, group = shard.inter, shape.group_size
    low, high = rank * part, (rank + 1) * part
    device = full.w13.packed.device
    columns = torch.cat([torch.arange(low, high), torch.arange(shape.inter + low, shape.inter + high)]).to(device)
    w13_packed = torch.empty((shape.experts, *quant.stored_shape(2 * part, shape.hidden)), dtype=torch.uint8,
                             device=device)
    w2_packed = torch.empty((shape.experts, *quant.stored_shape(shape.hidden, part)), dtype=torch.uint8, device=device)
    for expert in range(shape.experts):
        w13_values = quant.unpack_int4(full.w13.rows(expert))  # [hidden, 2 * inter]
        w13_packed[expert] = quant.tile_packed(quant.pack_int4(w13_values[:, columns]))
        w2_values = quant.unpack_int4(full.w2.rows(expert))  # [inter, hidden]
        w2_packed[expert] = quant.tile_packed(quant.pack_int4(w2_values[low:high]))
    w13 = quant.PackedLinear(packed=w13_packed, scales=full.w13.scales[:, :, columns].contiguous(), group_size=group)
    w2 = quant.PackedLinear(packed=w2_packed, scales=full.w2.scales[:, low // group:high // group].contiguous(),
                            group_size=group)
    return quant.MoEWeights(shape=shard, w13=w13, w2=w2)


def estimate_per_rank(settings: cli.Settings) -> dict:
    """Device bytes each rank's device needs: its shard's run (as one device would need it),
    the full layer's packed weights that every rank builds to cut its shard from (rank 0 keeps
    them through the correctness check), and the all-reduce phase's own output buffers."""
    estimate = perfmodel.estimate(settings.shape, settings.args.backend, settings.max_m,
                                  cli.ROUTINGS[settings.device_kind], settings.device_kind,
                                  config=dict(settings.config(), device=rank_devices(settings)[0]),
                                  dtype=settings.dtype_name)
    from .quant import weights_bytes

    full_weights = weights_bytes(full_layer_shape(settings))
    reduce_buffers = (cli.ROUTINGS[settings.device_kind] * settings.max_m * settings.shape.hidden
                      * perfmodel.DTYPE_BYTES[settings.dtype_name])
    estimate["full_layer_weights_bytes"] = int(full_weights)
    estimate["allreduce_buffers_bytes"] = int(reduce_buffers)
    estimate["total_bytes"] = int(estimate["total_bytes"] + full_weights + reduce_buffers)
    estimate["total_mib"] = int(-(-estimate["total_bytes"] // perfmodel.MIB))
    estimate["tp_ranks"] = settings.args.tp_ranks
    estimate["devices"] = rank_devices(settings)
    estimate["per_rank"] = True  # total_mib is what each of `devices` needs
    return estimate


# ---- one rank --------------------------------------------------------------------------------

class _Rank:
    """One rank's process: its device, the process group, its shard's backend."""

    def __init__(self, rank: int, settings: cli.Settings, rendezvous: str, messages):
        self.rank = rank
        self.ranks = settings.args.tp_ranks
        self.settings = settings
        self.rendezvous = rendezvous  # the file the process group meets at
        self.messages = messages
        self.phase = "starting"
        self.ceilings = None  # rank 0's, for the rows it composes

    def log(self, message: str) -> None:
        print(f"[moe_bench rank {self.rank}] {message}", flush=True)

    def send(self, *message) -> None:
        self.messages.put(message)

    def run(self) -> int:
        """The rank's whole run; its exit code. A failure is reported before the process group
        is torn down: the peers' errors about this rank's closed connection come after it."""
        import torch.distributed as dist

        try:
            return self._run()
        except BaseException as error:
            return self.report(error)
        finally:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # a failed peer can leave the group unable to shut down cleanly
                pass

    def report(self, error: BaseException) -> int:
        import torch.distributed as dist

        if isinstance(error, cli.HarnessError):
            kind, text, code = error.kind, f"rank {self.rank}: {error}", error.exit_code
        else:  # out of memory, CUDA and NCCL errors, a peer gone
            traceback.print_exc(file=sys.stderr)
            kind_text = "out of memory" if "out of memory" in str(error).lower() else type(error).__name__
            kind, code = "runtime", cli.EXIT_RUNTIME
            text = f"rank {self.rank} on {getattr(self, 'device', 'its device')}: {kind_text} while {self.phase}: {error}".strip()
        # A collective that broke because a peer went away: the peer's own report is the cause.
        follows_a_peer = isinstance(error, getattr(dist, "DistError", ()))
        self.send("failed", self.rank, kind, text, code, follows_a_peer)
        return code

    def _run(self) -> int:
        import torch
        import torch.distributed as dist

        from . import quant
        from .backends import BackendUnavailable, create_backend

        settings = self.settings
        self.phase = "opening the device"
        if settings.device_kind == "cuda":
            self.device = torch.device("cuda", self.rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            if "OMP_NUM_THREADS" not in os.environ:
                # N ranks share the cores: each taking all of them would oversubscribe N-fold.
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.ranks))
        self.dtype = getattr(torch, settings.dtype_name)
        self.phase = f"joining the {collective_backend(settings)} process group"
        dist.init_process_group(collective_backend(settings), init_method=f"file://{self.rendezvous}",
                                rank=self.rank, world_size=self.ranks, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self.dist = dist
        if self.rank == 0:
            self.send("environment", cli.collect_environment(self.device))
            self.phase = "measuring ceilings"
            # Rank 0's device stands for all: the ranks' devices are one model.
            self.ceilings = cli.resolve_ceilings(settings, self.device)
            self.send("ceilings", self.ceilings)
        names = [None] * self.ranks
        local_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        # Each rank's own view of the multicast switches: what NCCL reads in that process.
        seen = {name: os.environ.get(name) for name in MULTICAST_OFF}
        dist.all_gather_object(names, (str(self.device), local_name, seen))
        if self.rank == 0:
            self.send("devices", names)

        self.phase = "building weights"
        full = quant.random_weights(full_layer_shape(settings), self.device, seed=settings.args.seed)
        shard = shard_weights(full, self.rank, self.ranks)
        self.full = full if self.rank == 0 else None  # the reference's weights: rank 0 alone
        del full
        self.phase = f"preparing backend {settings.args.backend}"
        try:
            self.backend = create_backend(settings.args.backend, shard, settings.max_m, self.dtype)
        except BackendUnavailable as error:
            raise cli.EnvironmentFailure(str(error)) from None
        except ValueError as error:
            raise cli.EnvironmentFailure(f"backend {settings.args.backend} cannot run this shape: {error}") from None

        self.phase = "checking correctness"
        if not self.check_correctness():
            return cli.EXIT_CORRECTNESS
        self.full = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

        fail_at = os.environ.get(cli._FAULT_INJECTION_ENV)
        for m in settings.m_list:
            # The last rank fails in tests: the launcher must stop the others, which wait for it.
            if fail_at is not None and m == int(fail_at) and self.rank == self.ranks - 1:
                raise cli.RuntimeFailure(f"injected failure at M={m} on rank {self.rank} ({cli._FAULT_INJECTION_ENV})")
            self.phase = f"timing M={m}"
            self.time_one_m(m)
        if self.rank == 0:
            self.send("done")
        return cli.EXIT_OK

    def synchronize(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shared_inputs(self, m: int, seed: int):
        """Rank 0's inputs for M tokens, the same on every rank (broadcast: one device's random
        numbers, whatever the others' generators would give)."""
        import torch

        shape = self.settings.shape
        if self.rank == 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            x, topk_ids, topk_weights = cli.make_inputs(shape, m, self.dtype, self.device, generator)
        else:
            x = torch.empty((m, shape.hidden), dtype=self.dtype, device=self.device)
            topk_ids = torch.empty((m, shape.topk), dtype=torch.int32, device=self.device)
            topk_weights = torch.empty((m, shape.topk), dtype=torch.float32, device=self.device)
        for tensor in (x, topk_ids, topk_weights):
            self.dist.broadcast(tensor, src=0)
        return x, topk_ids, topk_weights

    def check_correctness(self) -> bool:
        """The reduced output of every checked M against the float32 reference of the whole
        layer, per row; rank 0 judges and tells the others. False: stop, no timing."""
        import torch

        from .backends import reference_moe

        settings = self.settings
        bound = cli.RELATIVE_ERROR_BOUND[settings.dtype_name]
        for m in cli.correctness_ms(self.backend, settings.m_list):
            x, topk_ids, topk_weights = self.shared_inputs(m, settings.args.seed * 1_000_003 + 7919 * m + 1)
            self.synchronize()
            started = time.perf_counter()
            out = cli.poisoned_call(self.backend, x, topk_ids, topk_weights, settings.shape.hidden)
            self.synchronize()
            call_s = time.perf_counter() - started
            self.dist.all_reduce(out)
            verdict = torch.zeros(1, dtype=torch.int32, device=self.device)
            if self.rank == 0:
                ref = reference_moe(self.full, x, topk_ids, topk_weights)
                error = cli.relative_error(out, ref)
                worst = cli.worst_row_error(out, ref)
                ok = worst is not None and worst[0] <= bound
                config = self.backend.configs_used(m)
                self.send("correctness", {
                    "m": m, "rel_err": error, "worst_row_rel_err": None if worst is None else worst[0],
                    "worst_row": None if worst is None else worst[1], "bound": bound, "ok": ok, "config": config,
                    "call_s": round(call_s, 3), "checked": f"sum of {self.ranks} ranks against the whole layer",
                })
                shown = ("NaN/Inf in the reduced output" if worst is None
                         else f"relative error {error:.2e}, worst row {worst[1]} {worst[0]:.2e}")
                self.log(f"check M={m}: {shown} (bound {bound:.0e} per row) {'ok' if ok else 'FAILED'}")
                if not ok:
                    self.send("failed", self.rank, "correctness",
                              f"the {self.ranks}-rank layer (backend {self.backend.name}) is wrong at M={m}: {shown} "
                              f"against the float32 reference of the whole layer, bound {bound:.0e} per row; "
                              "no timing was done", cli.EXIT_CORRECTNESS, False)
                verdict.fill_(1 if ok else 0)
            self.dist.broadcast(verdict, src=0)
            if int(verdict.item()) != 1:
                return False
        return True

    def time_one_m(self, m: int) -> None:
        import torch

        from . import timing

        settings, dist = self.settings, self.dist
        routings = cli.ROUTINGS[settings.device_kind]
        inputs = [self.shared_inputs(m, settings.args.seed * 1_000_003 + m + 104_729 * r) for r in range(routings)]
        # Zeros to reduce in the all-reduce phase: summed over and over they stay zero (a real
        # output would grow N-fold per call into Inf), and the collective's time does not
        # depend on the values.
        partials = [torch.zeros((m, settings.shape.hidden), dtype=self.dtype, device=self.device)
                    for _ in range(routings)]
        self.synchronize()
        started = time.perf_counter()
        self.backend(*inputs[0])  # the first call at an M compiles its tile config: timed apart
        self.synchronize()
        compile_s = time.perf_counter() - started

        def moe(r):
            return self.backend(*inputs[r])

        def allreduce(r):
            dist.all_reduce(partials[r])
            return partials[r]

        def layer(r):
            out = self.backend(*inputs[r])
            dist.all_reduce(out)
            return out

        capturable = bool(getattr(self.backend, "capturable", False))
        moe_timing = self.time_phase(moe, routings, capture=capturable, collective=False)
        allreduce_timing = self.time_phase(allreduce, routings, capture=True, collective=True)
        layer_timing = self.time_phase(layer, routings, capture=capturable, collective=True)
        mine = {"moe": timing.summarize(moe_timing[0]), "allreduce": timing.summarize(allreduce_timing[0]),
                "layer": timing.summarize(layer_timing[0]), "compile_s": compile_s,
                "methods": [moe_timing[1], allreduce_timing[1], layer_timing[1]],
                "notes": moe_timing[2] + allreduce_timing[2] + layer_timing[2]}
        everyone = [None] * self.ranks
        dist.all_gather_object(everyone, mine)
        if self.rank == 0:
            self.send("result", *self.rows(m, everyone))
        del inputs, partials

    def time_phase(self, call, routings: int, capture: bool, collective: bool) -> tuple[list[float], str, list[str]]:
        """(samples in us, method, notes): SAMPLES calls over the routings in turn, the same
        count on every rank. CUDA: one graph per routing where every rank could capture one
        (else eager on all ranks), CUDA events around each replay. CPU: perf_counter, the ranks
        lined up by a barrier before each collective call so a sample is not a wait for a peer."""
        kind = self.settings.device_kind
        count = max(SAMPLES[kind], routings)
        if kind == "cpu":
            for _ in range(WARMUP_ROUNDS["cpu"]):
                for r in range(routings):
                    call(r)
            samples = []
            for index in range(count):
                if collective:
                    self.dist.barrier()
                started = time.perf_counter()
                call(index % routings)
                samples.append((time.perf_counter() - started) * 1e6)
            return samples, "cpu-perf-counter", []
        return self._time_phase_cuda(call, routings, count, capture)

    def _time_phase_cuda(self, call, routings: int, count: int, capture: bool):
        import torch

        device, notes, graphs, outputs = self.device, [], [], []
        failed = torch.zeros(1, dtype=torch.int32, device=device)
        if capture:
            try:
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for r in range(routings):
                        call(r)
                torch.cuda.current_stream(device).wait_stream(side)
                pool = torch.cuda.graph_pool_handle()
                for r in range(routings):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        outputs.append(call(r))
                    graphs.append(graph)
                torch.cuda.synchronize(device)
            except Exception as error:
                graphs.clear()
                outputs.clear()
                torch.cuda.synchronize(device)
                failed.fill_(1)
                notes.append(f"rank {self.rank}: CUDA graph capture failed ({type(error).__name__}: {error})")
            # A graph holding a collective replayed on some ranks and an eager call on others
            # would pair wrongly: all ranks take graphs, or none does.
            self.dist.all_reduce(failed, op=self.dist.ReduceOp.MAX)
            if int(failed.item()):
                graphs.clear()
                outputs.clear()
                notes.append("a rank could not capture a CUDA graph: timed eagerly on every rank")
        if graphs:
            replay, method = (lambda r: graphs[r].replay()), "cuda-graph"
        else:
            replay, method = call, "cuda-events-eager"
        for _ in range(WARMUP_ROUNDS["cuda"]):
            for r in range(routings):
                replay(r)
        torch.cuda.synchronize(device)
        self.dist.barrier()
        pairs = []
        for index in range(count):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay(index % routings)
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(device)
        samples = [start.elapsed_time(end) * 1e3 for start, end in pairs]
        del graphs, outputs
        return samples, method, notes

    def rows(self, m: int, everyone: list[dict]) -> tuple[dict, dict, dict]:
        """(the shard's results row, the tensor-parallel row, timing info) from every rank's
        figures. The layer waits for its slowest rank: each phase reports that rank's."""
        settings = self.settings

        def slowest(phase):
            return max((figures[phase] for figures in everyone), key=lambda summary: summary["us"])

        moe, allreduce, layer = slowest("moe"), slowest("allreduce"), slowest("layer")
        compile_s = max(figures["compile_s"] for figures in everyone)
        ceilings = self.ceilings
        result = perfmodel.result_row(settings.shape, m, moe["us"], moe["us_p20"], moe["us_p80"], compile_s,
                                      ceilings["bandwidth_gbps"], ceilings["tflops"])
        nbytes = m * settings.shape.hidden * perfmodel.DTYPE_BYTES[settings.dtype_name]
        algbw, busbw = allreduce_bandwidth_gbps(nbytes, allreduce["us"], self.ranks)
        tp_row = {"m": m, "ranks": self.ranks}
        for phase, figures in (("layer", layer), ("moe", moe), ("allreduce", allreduce)):
            for statistic in ("us", "us_p20", "us_p80"):
                tp_row[f"{phase}_{statistic}"] = round(figures[statistic], 3)
        tp_row.update({
            "allreduce_bytes": nbytes,
            # Not rounded: a CPU's gloo all-reduce of a few KB reaches MB/s, not GB/s.
            "algbw_gbps": algbw, "busbw_gbps": busbw,
            "moe_us_by_rank": [round(figures["moe"]["us"], 3) for figures in everyone],
            "allreduce_us_by_rank": [round(figures["allreduce"]["us"], 3) for figures in everyone],
            "samples": moe["samples"],
        })
        methods = sorted({method for figures in everyone for method in figures["methods"]})
        notes = [note for figures in everyone for note in figures["notes"]]
        return result, tp_row, {"method": "+".join(methods), "notes": notes}


def _rank_main(rank: int, settings: cli.Settings, rendezvous: str, messages) -> None:
    """The entry of a spawned rank process: run it, report a failure to the launcher, exit with
    the harness's exit code."""
    os.environ.update(MULTICAST_OFF)
    worker = _Rank(rank, settings, rendezvous, messages)
    code = cli.EXIT_RUNTIME
    try:
        code = worker.run()
    finally:
        messages.close()
        messages.join_thread()  # what was sent reaches the launcher before this process is gone
    sys.exit(code)


# ---- the launcher ----------------------------------------------------------------------------

def run_tensor_parallel(settings: cli.Settings) -> int:
    """The --tp-ranks run: the exit codes of the one-device run (docs/design.md)."""
    from .schema import ResultsWriter

    started = time.perf_counter()
    writer = None
    processes: list = []
    previous_sigterm = signal.signal(signal.SIGTERM, cli._raise_on_sigterm)
    try:
        ranks = settings.args.tp_ranks
        devices = rank_devices(settings)
        cli.log(f"starting: {ranks} ranks ({collective_backend(settings)}) on {', '.join(devices)}, backend "
                f"{settings.args.backend}, shard {settings.shape} of a layer with inter "
                f"{full_layer_shape(settings).inter}, dtype {settings.dtype_name}, M {','.join(map(str, settings.m_list))}")
        os.environ.update(MULTICAST_OFF)
        if settings.args.backend == "triton" and settings.device_kind == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")  # read by every rank's first triton import
        writer = ResultsWriter(settings.args.out, cli.collect_environment(None), settings.config())
        writer.set_tp({"ranks": ranks, "collective": collective_backend(settings), "devices": devices,
                       "device_names": None, "environment": dict(MULTICAST_OFF), "environment_by_rank": None,
                       "full_inter": full_layer_shape(settings).inter, "samples_per_phase": SAMPLES[settings.device_kind]})
        from .backends import BackendUnavailable, check_backend_available

        try:
            check_backend_available(settings.args.backend)
        except BackendUnavailable as error:
            raise cli.EnvironmentFailure(str(error)) from None
        if settings.device_kind == "cuda":
            _check_cuda_devices(ranks)

        with tempfile.TemporaryDirectory(prefix="moe_bench_tp_") as folder:
            context = multiprocessing.get_context("spawn")
            messages = context.Queue()
            for rank in range(ranks):
                process = context.Process(target=_rank_main, name=f"moe_bench-rank-{rank}",
                                          args=(rank, settings, os.path.join(folder, "rendezvous"), messages))
                process.start()
                processes.append(process)
            _supervise(processes, messages, writer, devices)
        writer.complete()
        cli.log(f"complete: {len(settings.m_list)} M values on {ranks} ranks in {time.perf_counter() - started:.1f} s"
                + (f", results in {settings.args.out}" if settings.args.out else ""))
        return cli.EXIT_OK
    except cli.HarnessError as error:
        return cli._fail(writer, error.kind, str(error), error.exit_code)
    except KeyboardInterrupt:
        return cli._fail(writer, "runtime", "interrupted", cli.EXIT_RUNTIME)
    except Exception as error:
        traceback.print_exc(file=sys.stderr)
        return cli._fail(writer, "runtime", f"{type(error).__name__} in the launcher: {error}", cli.EXIT_RUNTIME)
    finally:
        _stop(processes)
        signal.signal(signal.SIGTERM, previous_sigterm)


def _check_cuda_devices(ranks: int) -> None:
    import torch

    if not torch.cuda.is_available():
        raise cli.EnvironmentFailure(
            f"--tp-ranks {ranks} on CUDA requested but torch {torch.__version__} sees no CUDA device "
            "(CPU-only torch build, driver problem, or CUDA_VISIBLE_DEVICES empty)")
    count = torch.cuda.device_count()
    if count < ranks:
        raise cli.EnvironmentFailure(
            f"--tp-ranks {ranks} needs {ranks} CUDA devices (one per rank) but {count} are visible; "
            "set CUDA_VISIBLE_DEVICES to the GPUs to use or lower --tp-ranks")


def _supervise(processes: list, messages, writer, devices: list[str]) -> None:
    """Record what the ranks send until rank 0 says done and every rank has exited. On a
    failure: give the other ranks RANK_EXIT_GRACE_S to exit (then the caller stops them), read
    what they still sent, and raise the cause: a rank's own failure rather than a peer's
    broken collective, or a rank's death without a word."""
    recorder = _Recorder(writer, devices)
    failed_at = None
    while True:
        recorder.take(messages)
        exits = [process.exitcode for process in processes]
        if failed_at is None:
            silent = [(rank, code) for rank, code in enumerate(exits) if code not in (None, 0)]
            if recorder.failures or silent:
                failed_at = time.monotonic()
        if failed_at is not None:
            if all(code is not None for code in exits) or time.monotonic() - failed_at > RANK_EXIT_GRACE_S:
                recorder.drain(messages)
                raise recorder.cause(exits)
            continue
        if all(code is not None for code in exits):
            recorder.drain(messages)
            if recorder.done:
                return
            raise cli.RuntimeFailure("every rank exited but rank 0 never reported the end of the run")


class _Recorder:
    """The launcher's side of the queue: writes what the ranks report into the results."""

    def __init__(self, writer, devices: list[str]):
        self.writer = writer
        self.devices = devices
        self.failures: list[tuple[bool, cli.HarnessError]] = []  # (follows a peer's failure, error)
        self.done = False
        self.total = len(writer.document["config"]["m_list"] or [])
        self.routings = cli.ROUTINGS["cpu" if devices[0] == "cpu" else "cuda"]
        self.timing_notes: list[str] = []

    def take(self, messages, timeout: float = POLL_S) -> bool:
        """Handle one message if one comes within `timeout`; False when none came."""
        try:
            message = messages.get(timeout=timeout)
        except queue_module.Empty:
            return False
        kind, writer = message[0], self.writer
        if kind == "environment":
            writer.set_environment(message[1])
        elif kind == "ceilings":
            ceilings = message[1]
            writer.set_ceilings(ceilings)
            cli.log(f"ceilings (rank 0): {ceilings['bandwidth_gbps']} GB/s, {ceilings['tflops']} TFLOP/s "
                    f"({ceilings['source']})")
        elif kind == "devices":
            writer.set_tp(dict(writer.document["tp"], device_names=[name for _, name, _ in message[1]],
                               environment_by_rank=[seen for _, _, seen in message[1]]))
        elif kind == "correctness":
            writer.add_correctness(message[1])
        elif kind == "result":
            result, tp_row, timing_info = message[1], message[2], message[3]
            self.timing_notes += [f"M={result['m']}: {note}" for note in timing_info["notes"]]
            writer.set_timing({"method": timing_info["method"], "routings": self.routings, "notes": self.timing_notes})
            writer.add_result(result)
            writer.add_tp_result(tp_row)
            cli.log(f"M={tp_row['m']} ({len(writer.document['tp_results'])}/{self.total}) layer "
                    f"{tp_row['layer_us']:.1f} us: MoE {tp_row['moe_us']:.1f} us, all-reduce {tp_row['allreduce_us']:.1f} us "
                    f"(bus {tp_row['busbw_gbps']:.3g} GB/s)")
        elif kind == "failed":
            _, rank, error_kind, text, exit_code, follows_a_peer = message
            self.failures.append((follows_a_peer, _harness_error(error_kind, text, exit_code)))
        elif kind == "done":
            self.done = True
        return True

    def drain(self, messages) -> None:
        while self.take(messages):
            pass

    def cause(self, exits: list) -> cli.HarnessError:
        for follows_a_peer, error in self.failures:
            if not follows_a_peer:
                return error
        # No rank said it failed on its own: one that died without a word is the likelier cause.
        for rank, code in enumerate(exits):
            if code not in (None, 0) and not any(f"rank {rank}" in str(error) for _, error in self.failures):
                return cli.RuntimeFailure(
                    f"rank {rank} on {self.devices[rank]} exited with code {code} without reporting why"
                    + (f" (killed by signal {signal.Signals(-code).name})" if code < 0 else "")
                    + "; the other ranks were stopped")
        if self.failures:
            return self.failures[0][1]
        return cli.RuntimeFailure("a rank stopped without reporting why; the other ranks were stopped")


def _harness_error(kind: str, text: str, exit_code: int) -> cli.HarnessError:
    by_kind = {"environment": cli.EnvironmentFailure, "correctness": cli.CorrectnessFailure,
               "runtime": cli.RuntimeFailure}
    error = by_kind.get(kind, cli.RuntimeFailure)(text)
    error.exit_code = exit_code
    return error


def _stop(processes: list) -> None:
    """Stop every rank still running (SIGTERM, then SIGKILL), and reap them all."""
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    deadline = time.monotonic() + RANK_EXIT_GRACE_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join()
