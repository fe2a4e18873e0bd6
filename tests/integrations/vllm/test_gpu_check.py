"""The GPU kit (`benchmarks/vllm/gpu_check/`) up to the device boundary, on CPU: the check's dry
run (arguments, model, every step's script parses), a real run refused without a GPU, and the
staging mechanics with a small stand-in wheel: parts made and sized, each received with its hash
checked, reassembly checked (a damaged or missing part named), `pip install --no-index
--no-deps --target` of the reassembled wheels for the GPU image's CPython 3.12. The full staging
(vLLM 0.26's CUDA wheel and its packages, several hundred MB) runs only in `gpu_check.sh stage`."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
import torch

KIT = Path(__file__).resolve().parents[3] / "benchmarks" / "vllm" / "gpu_check"
SCRIPT = KIT / "gpu_check.sh"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return run("--python", sys.executable, *args)


def _stage_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_kit_stage", KIT / "stage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_checks_every_step() -> None:
    proc = check("--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [line.split(":")[1].strip() for line in proc.stdout.splitlines()
             if line.startswith("dry run: ") and "ok (" not in line]
    assert steps == ["unit", "bench", "pe", "pd_tp1", "pd_tp2"]
    assert "--cuda-graphs" in proc.stdout and "--device cuda" in proc.stdout
    assert "--attention-backend FLASH_ATTN" in proc.stdout


def test_the_kits_model_runs_dry_with_random_weights(tmp_path: Path) -> None:
    """The kit's own command line: the Llama-shaped config (a folder with it and a tokenizer),
    `--load-format dummy`, two servers' shares of one GPU, FlashAttention, 16-token blocks."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes((KIT / "llama-3b-shape.json").read_bytes())
    from dualpath.runtime.model.weights import smollm2_folder

    (model / "tokenizer.json").write_bytes((Path(smollm2_folder()) / "tokenizer.json")
                                           .read_bytes())
    proc = check("--dry-run", "--model", str(model), "--load-format", "dummy", "--steps",
                 "unit,bench,pd", "--dtype", "float16", "--turn1-tokens", "512")
    assert proc.returncode == 0, proc.stderr[-3000:]
    pd = next(line for line in proc.stdout.splitlines() if "pd_tp1" in line)
    for flag in ("--load-format dummy", "--block-size 16", "--gpu-memory-utilization 0.3",
                 "--attention-backend FLASH_ATTN", "--cuda-graphs", "--dtype float16"):
        assert flag in pd, flag
    proc = check("--dry-run", "--model", str(model), "--load-format", "dummy")
    assert proc.returncode == 2 and "step pe loads real weights" in proc.stderr


def test_bad_arguments_are_refused_by_name() -> None:
    proc = check("--dry-run", "--steps", "bench,gpu")
    assert proc.returncode == 2 and "--steps: gpu" in proc.stderr
    proc = check("--dry-run", "--model", "/nonexistent")
    assert proc.returncode != 0 and "no config.json" in proc.stderr
    proc = check("--dry-run", "--gpu-share", "0.6")
    assert proc.returncode == 2 and "--gpu-share 0.6" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_a_real_run_fails_at_once_saying_so() -> None:
    proc = check("--steps", "bench")
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr


def _standin_wheel(folder: Path, payload_bytes: int) -> Path:
    """A real wheel of a tiny package (`gpu_kit_standin`), with a payload to split."""
    name, version = "gpu_kit_standin", "1.0"
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"VALUE = 42\n",
        f"{name}/payload.bin": os.urandom(payload_bytes),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                            .encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                         b"Tag: py3-none-any\n",
    }
    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = [f"{path},sha256={digest(data)},{len(data)}" for path, data in files.items()]
    files[f"{dist}/RECORD"] = ("\n".join([*record, f"{dist}/RECORD,,"]) + "\n").encode()
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for path, data in files.items():
            z.writestr(path, data)
    return wheel


def test_parts_are_sized_received_reassembled_and_installed(tmp_path: Path) -> None:
    wheels, model, parts, kit = (tmp_path / d for d in ("wheels", "model", "parts", "kit"))
    wheels.mkdir()
    model.mkdir()
    _standin_wheel(wheels, 100_000)
    (model / "config.json").write_bytes((KIT / "llama-3b-shape.json").read_bytes())
    chunk = 16_384
    proc = subprocess.run([sys.executable, str(KIT / "stage.py"), "bundle", "--wheels",
                           str(wheels), "--model", str(model), "--out", str(parts),
                           "--chunk-bytes", str(chunk)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    made = json.loads(proc.stdout)
    folders = sorted(parts.glob("part-*"))
    assert made["parts"] == len(folders) == -(-made["bytes"] // chunk) >= 7
    sizes = [next(f.glob("bundle.tar.*")).stat().st_size for f in folders]
    assert max(sizes) <= chunk and sum(sizes) == made["bytes"]

    env = {"DUALPATH_GPU_KIT": str(kit)}
    bad = tmp_path / "bad-part"
    bad.mkdir()
    for f in folders[0].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    damaged = next(bad.glob("bundle.tar.*"))
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    proc = run("receive", str(bad), env=env)
    assert proc.returncode != 0 and "bundle.tar.00: sha256 differs" in proc.stderr
    for i, folder in enumerate(folders[:-1]):
        proc = run("receive", str(folder), env=env)
        assert proc.returncode == 0 and f"{i + 1} of {len(folders)} parts" in proc.stdout

    install = [sys.executable, str(KIT / "stage.py"), "install", "--kit", str(kit), "--cross",
               "--target", str(tmp_path / "site")]
    proc = subprocess.run(install, capture_output=True, text=True)
    last = f"bundle.tar.{len(folders) - 1:02d}"
    assert proc.returncode != 0 and f"missing or damaged parts: {last}" in proc.stderr
    assert run("receive", str(folders[-1]), env=env).returncode == 0
    proc = subprocess.run(install, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["wheels"] == ["gpu_kit_standin-1.0-py3-none-any.whl"]
    assert (kit / "bundle" / "model" / "config.json").read_bytes() == \
        (KIT / "llama-3b-shape.json").read_bytes()
    proc = subprocess.run([sys.executable, "-c", "import gpu_kit_standin as m; print(m.VALUE)"],
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert proc.stdout.strip() == "42", proc.stderr


def test_a_part_fits_a_device_transfer_beside_the_working_tree() -> None:
    stage = _stage_module()
    limit = stage.chunk_limit()
    assert limit + stage.tree_bytes() + stage.MARGIN_BYTES <= 64 << 20
    assert limit >= 8 << 20 and limit % (1 << 20) == 0


def _check_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_kit_check", KIT / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pd_steps_rates_and_load_checks_come_from_the_demos_summary(tmp_path: Path
                                                                       ) -> None:
    """A 16-token block of the kit's model is 28 layers x K and V x 8 heads x 128 x 2 bytes x
    16; each path's rate is the hit's bytes over its prefill request; a path that loaded
    nothing fails its check."""
    gc = _check_module()
    (tmp_path / "config.json").write_bytes((KIT / "llama-3b-shape.json").read_bytes())
    assert gc.block_bytes(str(tmp_path), 16, "float16") == 28 * 2 * 8 * 128 * 2 * 16 \
        == 1_835_008
    summary = {"hit_blocks": 40, "block_size": 16,
               "runs": {"recompute": {"prefill_s": 0.5, "prefill_cached": 0},
                        "pe": {"prefill_s": 0.2, "prefill_cached": 640},
                        "de": {"prefill_s": 0.4, "prefill_cached": 640}},
               "pulls": [{"ok": 40, "blocks": 40}]}
    out = gc.pd_result(summary, 1_835_008)
    assert out["gb_per_s"] == {"pe": round(40 * 1_835_008 / 0.2 / 1e9, 2),
                               "de": round(40 * 1_835_008 / 0.4 / 1e9, 2)}
    assert all(out["extra_checks"].values())
    summary["pulls"] = [{"ok": 0, "blocks": 40}]
    summary["runs"]["pe"]["prefill_cached"] = 0
    assert not any(gc.pd_result(summary, 1_835_008)["extra_checks"].values())
