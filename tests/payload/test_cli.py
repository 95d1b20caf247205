"""Command line: bad arguments (exit 2), --estimate, --preflight, refusals (exit 3)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_bench import cli, perfmodel, presets, quant

from conftest import payload_env


def run_main(capsys, *argv: str):
    """The payload's main() in this process (no interpreter start-up): (exit code, stdout, stderr)."""
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--m-list", "0"], "must be positive"),
        (["--m-list", "1,two"], "not an integer"),
        (["--m-list", ","], "empty M list"),
        (["--tp", "3"], "not divisible by --tp 3"),
        (["--inter", "2048", "--tp", "128"], "not a multiple of group size"),
        (["--experts", "4", "--topk", "8"], "cannot exceed experts"),
        (["--hidden", "100"], "multiple of group size"),
        (["--device", "gpu0"], "expected cuda:N or cpu"),
        (["--bandwidth-gbps", "4300"], "give both --bandwidth-gbps and --tflops"),
        (["--bandwidth-gbps", "-1", "--tflops", "790"], "positive"),
        (["--preset", "llama"], "invalid choice"),
        (["--backend", "cutlass"], "invalid choice"),
        (["--device", "cpu", "--backend", "triton", "--dtype", "bfloat16"], "computes bf16 dots"),
        (["--device", "cpu", "--backend", "vllm-marlin"], "CUDA devices only"),
        (["--estimate", "--preflight"], "not allowed with"),
        # A shape the triton kernels cannot run is refused with the arguments, so the playbook's
        # --estimate / --preflight (before the stop) catch it; the torch backend runs it.
        (["--backend", "triton", "--group-size", "16", "--estimate"], "group size of at least 32"),
        (["--backend", "triton", "--group-size", "16", "--preflight"], "group size of at least 32"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    assert cli.main(argv) == cli.EXIT_BAD_ARGUMENTS
    assert message in capsys.readouterr().err


def test_group_size_16_is_refused_for_triton_only(capsys):
    assert cli.main(["--backend", "torch", "--group-size", "16", "--estimate"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["group_size"] == 16


def test_bad_arguments_exit_2_from_the_command_line(run_payload):
    result = run_payload("--tp", "3", "--estimate")
    assert result.returncode == 2
    assert "not divisible by --tp 3" in result.stderr
    assert result.stdout == ""


def test_exit_codes_are_distinct():
    codes = [cli.EXIT_OK, cli.EXIT_BAD_ARGUMENTS, cli.EXIT_ENVIRONMENT, cli.EXIT_CORRECTNESS, cli.EXIT_RUNTIME]
    assert codes == [0, 2, 3, 4, 5]


def test_estimate_prints_the_contract_json(capsys):
    code, out, err = run_main(capsys, "--estimate", "--backend", "triton", "--m-list", "1,2048")
    assert code == 0, err
    estimate = json.loads(out)
    assert set(estimate) == {"weights_bytes", "activations_bytes", "workspace_bytes", "context_bytes",
                             "total_bytes", "total_mib", "config"}
    k26 = presets.PRESETS["kimi-k2.6"].shape()
    assert estimate["weights_bytes"] == quant.weights_bytes(k26)
    assert estimate["total_bytes"] == sum(estimate[k] for k in ("weights_bytes", "activations_bytes",
                                                                 "workspace_bytes", "context_bytes"))
    assert estimate["total_mib"] * 2**20 >= estimate["total_bytes"] > (estimate["total_mib"] - 1) * 2**20
    assert estimate["context_bytes"] > 0
    assert estimate["config"]["experts"] == 384 and estimate["config"]["m_list"] == [1, 2048]
    # The int4 layer fits beside nothing else on a 96 GB card, and must not pretend to be tiny.
    assert 10 * 2**30 < estimate["total_bytes"] < 16 * 2**30


def test_estimate_counts_the_torch_backends_dequantized_copy(capsys):
    triton = json.loads(run_main(capsys, "--estimate", "--backend", "triton")[1])
    torch_ = json.loads(run_main(capsys, "--estimate", "--backend", "torch")[1])
    k26 = presets.PRESETS["kimi-k2.6"].shape()
    assert torch_["weights_bytes"] - triton["weights_bytes"] == perfmodel.dequantized_weights_bytes(k26)


def test_estimate_counts_marlins_repacked_copy(capsys):
    triton = json.loads(run_main(capsys, "--estimate", "--backend", "triton")[1])
    marlin = json.loads(run_main(capsys, "--estimate", "--backend", "vllm-marlin")[1])
    assert marlin["weights_bytes"] == 2 * triton["weights_bytes"]


def test_estimate_grows_with_m_and_shrinks_with_tp(capsys):
    small = json.loads(run_main(capsys, "--estimate", "--m-list", "1")[1])
    large = json.loads(run_main(capsys, "--estimate", "--m-list", "1,4096")[1])
    tp8 = json.loads(run_main(capsys, "--estimate", "--tp", "8")[1])
    full = json.loads(run_main(capsys, "--estimate")[1])
    assert large["activations_bytes"] > small["activations_bytes"]
    assert large["workspace_bytes"] > small["workspace_bytes"]
    assert tp8["weights_bytes"] * 8 == pytest.approx(full["weights_bytes"], rel=1e-9)


def test_estimate_imports_no_triton_and_touches_no_gpu():
    code = (
        "import sys, torch\n"
        "from moe_bench.cli import main\n"
        "rc = main(['--estimate', '--backend', 'triton', '--device', 'cuda:0'])\n"
        "print('triton' in sys.modules, torch.cuda.is_initialized(), rc, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=payload_env(),
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "False False 0"


def test_estimate_is_an_upper_bound_of_the_triton_kernels_workspace():
    triton_moe = pytest.importorskip("moe_bench.triton_moe", exc_type=ImportError)
    for shape in (presets.PRESETS["kimi-k2.6"].shape(), presets.PRESETS["kimi-k2.6"].shape(tp=8),
                  presets.PRESETS["mixtral-8x7b"].shape(), presets.PRESETS["tiny"].shape()):
        for m in (1, 7, 64, 2048, 4096):
            assert perfmodel.fused_moe_workspace_bytes(shape, m) >= triton_moe.workspace_bytes(shape, m)


def test_preflight_on_cpu_reports_memory_against_the_estimate(capsys):
    code, out, err = run_main(capsys, "--preflight", "--device", "cpu", "--backend", "torch", "--preset", "tiny")
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] is True
    assert report["device"] == "cpu"
    assert 0 < report["free_mib"] <= report["total_mib"]
    estimate = json.loads(run_main(capsys, "--estimate", "--device", "cpu", "--backend", "torch",
                                   "--preset", "tiny")[1])
    assert report["need_mib"] == estimate["total_mib"]
    # The playbook reads the estimate from the preflight: the same object as --estimate prints.
    assert report["estimate"] == estimate
    assert report["fits_now"] is True


def test_preflight_fails_in_one_line_without_a_cuda_device(capsys):
    code, out, err = run_main(capsys, "--preflight", "--device", "cuda:0", "--backend", "torch")
    assert code == 3
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("preflight failed: cuda:0 requested")
    assert out == ""


def test_preflight_refuses_triton_backend_when_triton_is_missing(run_payload, without_triton):
    result = run_payload("--preflight", "--device", "cpu", "--backend", "triton", "--dtype", "float32",
                         "--preset", "tiny", path_first=without_triton)
    assert result.returncode == 3
    assert result.stderr.startswith("preflight failed: backend 'triton' needs the triton package")


def test_preflight_for_torch_backend_needs_no_triton(run_payload, without_triton):
    result = run_payload("--preflight", "--device", "cpu", "--backend", "torch", "--preset", "tiny",
                         path_first=without_triton)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ok"] is True


@pytest.mark.parametrize("backend,package", [("vllm-marlin", "vllm"), ("sglang-marlin", "sglang")])
def test_marlin_backends_are_refused_when_their_package_is_missing(capsys, tmp_path, monkeypatch, backend, package):
    # Absent whether or not this Python has it: a None entry makes `import package` fail.
    monkeypatch.setitem(sys.modules, package, None)
    out = tmp_path / "results.json"
    code, _, err = run_main(capsys, "--backend", backend, "--device", "cuda:0", "--out", str(out))
    assert code == 3
    assert f"backend '{backend}' needs the {package} package" in err
    assert "choose --backend triton or torch" in err
    from moe_bench.schema import load_results

    loaded = load_results(out)
    assert loaded["status"] == "failed" and loaded["error"]["kind"] == "environment"
    assert loaded["error"]["exit_code"] == 3
    code, _, err = run_main(capsys, "--preflight", "--backend", backend, "--device", "cuda:0")
    assert code == 3
    assert err.startswith(f"preflight failed: backend '{backend}' needs the {package} package")


def test_a_run_on_a_missing_cuda_device_is_an_environment_failure(capsys, tmp_path):
    out = tmp_path / "results.json"
    code, _, err = run_main(capsys, "--backend", "torch", "--device", "cuda:0", "--preset", "tiny", "--out", str(out))
    assert code == 3
    assert "sees no CUDA device" in err
    from moe_bench.schema import load_results

    assert load_results(out)["error"]["kind"] == "environment"
