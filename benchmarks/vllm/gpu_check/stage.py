"""Stage CUDA vLLM 0.26 and what the GPU image lacks for the GPU check, in transfers that the
device machine takes (at most 64 MiB each, the working tree included).

The GPU image has torch 2.11.0+cu130 and no vLLM; vLLM 0.26.0 pins torch 2.11.0, so only vLLM's
wheel and the pure-Python or small packages the image lacks travel (no torch, no weights: the
check's model has random weights). Steps (`gpu_check.sh` runs them):

    stage    (here, with network) resolve and fetch the wheels (sha256 of each checked against
             PyPI's), add the model folder (the repo's Llama-shaped config and SmolLM2's
             tokenizer), pack it all into one tar and split that into parts, each with the
             manifest; reassemble them here and install them into a temporary target, as the
             GPU machine will; print the device calls
    bundle   the packing and splitting alone, from given wheels and model folder
    receive  (GPU machine, one call per part) keep a part in the kit folder, its hash checked
    install  (GPU machine) reassemble, check every hash, unpack, `pip install --no-index
             --no-deps --target` every wheel

Each step's command line: `stage.py STEP --help`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
CACHE = REPO / ".cache" / "dualpath" / "gpu-kit"
KIT = Path(os.environ.get("DUALPATH_GPU_KIT", "/tmp/dualpath-gpu-kit"))
"""The GPU machine's kit folder (kept between calls while the machine stays warm)."""
MODEL_CONFIG = HERE / "llama-3b-shape.json"
LOCK = HERE / "kit-lock.json"
"""The wheels staged, pinned with their sha256 (`stage --resolve` writes it anew)."""
IMAGE = HERE / "image_packages.txt"
TRANSFER_BYTES = 64 << 20
"""What one device call may carry: the working tree and the carried paths together."""
MARGIN_BYTES = 4 << 20
VLLM = "vllm==0.26.0"
EXTRA = ("crc32c==2.9.post0", "httpx2==2.16.2", "nixl==1.5.1", "nixl-cu13==1.5.1")
"""What dualpath needs beside vLLM there: the store's checksums, the router's client, NIXL."""
_OTHER_KERNELS = ("flashinfer-python", "tilelang", "nvidia-cutlass-dsl", "quack-kernels",
                  "tokenspeed-mla", "humming-kernels", "pynvvideocodec", "torchcodec",
                  "fastsafetensors", "nvidia-cudnn-frontend", "nvtx")
NOT_CARRIED = {
    **dict.fromkeys(_OTHER_KERNELS, "other attention backends, kernels and media: vLLM 0.26 "
                                    "imports them in those modules only"),
    "mistral-common": "Mistral tokenizers only (imported where one is used); it needs numpy "
                      "< 2.4, the image has 2.5.2",
    "nixl-cu12": "NIXL's CUDA 12 build (the image is CUDA 13: nixl-cu13 travels)"}
"""vLLM's requirements left out, and why: the transfers stay few."""
IMAGE_KEEPS = {"numba": "vLLM pins 0.65.0, which needs an older numpy than the image's 2.5.2; "
                        "only the n-gram speculative decoder imports it"}
"""Requirements of vLLM the image's own version stands for."""
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
          *(f"--platform={p}" for p in (
              "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
              "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
              "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64",
              "linux_x86_64", "any"))]
"""The GPU image's interpreter (CPython 3.12, x86-64 Linux) for pip here."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def image_packages(path: Path = IMAGE) -> dict[str, str | None]:
    """The GPU image's packages: name -> version (None where not known)."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[norm(name)] = version or None
    return out


def tree_bytes(repo: Path = REPO) -> int:
    """What a device call sends besides carried paths: tracked files and untracked ones git
    does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=repo, capture_output=True, check=True).stdout.split(b"\0")
    return sum((repo / n.decode()).stat().st_size for n in names
               if n and (repo / n.decode()).is_file())


def chunk_limit(repo: Path = REPO) -> int:
    """The largest part one device call can carry beside the working tree (MiB-aligned)."""
    free = TRANSFER_BYTES - tree_bytes(repo) - MARGIN_BYTES
    if free < (8 << 20):
        raise SystemExit(f"stage: the working tree leaves {free >> 20} MiB of a transfer's 64 "
                         "MiB for a part")
    return free >> 20 << 20


# -- resolving and fetching (here) ---------------------------------------------------------
def _fake_wheel(folder: Path, name: str, version: str) -> None:
    """An empty wheel that stands for a package the image has, so the resolver takes it as
    given (its local label sorts it above the same release on the index)."""
    dist = f"{name.replace('-', '_')}-{version}+image"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}+image\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: stage\n"
                   "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")


def resolve(image: dict[str, str | None]) -> list[dict[str, Any]]:
    """vLLM 0.26 and `EXTRA` with what they need, less what the image has and `NOT_CARRIED`:
    [{name, version, url, sha256}] from pip's resolver for the GPU image's interpreter."""
    with tempfile.TemporaryDirectory(prefix="dualpath-stage-") as tmp:
        fakes = Path(tmp) / "image"
        fakes.mkdir()
        pins = []
        for name, version in image.items():
            if version:
                _fake_wheel(fakes, name, version)
                pins.append(f"{name}=={version}")
        constraints = Path(tmp) / "image-constraints.txt"
        constraints.write_text("\n".join(pins) + "\n")
        # NOT_CARRIED by a constraint no release meets would fail: resolve without them by
        # giving vLLM's other requirements by hand.
        reqs = _requirements_without(VLLM, set(NOT_CARRIED) | set(IMAGE_KEEPS)
                                     | {"torch", "torchaudio", "torchvision"})
        report = Path(tmp) / "report.json"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
             "--report", str(report), "--target", str(Path(tmp) / "t"), *TARGET,
             "--find-links", str(fakes), "-c", str(constraints), *reqs, *EXTRA],
            capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit("stage: pip could not resolve the packages:\n" + proc.stderr[-3000:])
        picked = json.loads(report.read_text())["install"]
    out = []
    for item in picked:
        name, version = norm(item["metadata"]["name"]), item["metadata"]["version"]
        if name in image or name in NOT_CARRIED or "+image" in version:
            continue
        info = item["download_info"]
        out.append({"name": name, "version": version, "url": info["url"],
                    "sha256": info["archive_info"]["hashes"]["sha256"]})
    out.append(_vllm_entry())
    return sorted(out, key=lambda x: x["name"])


def _vllm_entry() -> dict[str, Any]:
    """vLLM 0.26.0's x86-64 wheel on PyPI: its URL and the index's sha256."""
    name, version = VLLM.split("==")
    req = urllib.request.Request(f"https://pypi.org/simple/{name}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.loads(r.read())["files"]
    f = next(f for f in files if f["filename"].startswith(f"{name}-{version}-")
             and f["filename"].endswith("manylinux_2_28_x86_64.whl"))
    return {"name": name, "version": version, "url": f["url"].split("#")[0],
            "sha256": f["hashes"]["sha256"]}


def _vllm_wheel() -> Path:
    return fetch([_vllm_entry()], CACHE / "wheels")[0]


def _requirements_without(spec: str, drop: set[str]) -> list[str]:
    """The requirement strings of `spec`'s wheel that do not name a package in `drop`."""
    with zipfile.ZipFile(_vllm_wheel()) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist: ") or "extra ==" in line:
            continue
        req = line.split(": ", 1)[1]
        name = norm(req.split(";")[0].split("[")[0].split("<")[0].split(">")[0]
                    .split("=")[0].split("!")[0].split("~")[0].strip())
        if name not in drop:
            out.append(req)
    return out


def fetch(items: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Each item's wheel in `folder` (downloaded once), its sha256 checked."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for item in items:
        path = folder / item["url"].rsplit("/", 1)[1].split("#")[0]
        if not path.is_file() or sha256(path) != item["sha256"]:
            tmp = path.with_suffix(".part")
            try:
                urllib.request.urlretrieve(item["url"], tmp)
            except OSError:  # a local mirror's file:// URL elsewhere: the index has the file
                with tempfile.TemporaryDirectory() as d:
                    subprocess.run([sys.executable, "-m", "pip", "download", "-q",
                                    "--no-deps", *TARGET, "-d", d,
                                    f"{item['name']}=={item['version']}"], check=True)
                    shutil.move(str(Path(d) / path.name), tmp)
            if sha256(tmp) != item["sha256"]:
                raise SystemExit(f"stage: {path.name}: sha256 differs from the index's")
            tmp.replace(path)
        paths.append(path)
    return paths


def model_folder(out: Path) -> Path:
    """The check's model: the repo's Llama-shaped config and SmolLM2's tokenizer (the
    weights are vLLM's dummy ones, made on the GPU)."""
    from dualpath.runtime.model.weights import smollm2_folder

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODEL_CONFIG, out / "config.json")
    shutil.copy(Path(smollm2_folder()) / "tokenizer.json", out / "tokenizer.json")
    return out


# -- packing, splitting and reassembling ---------------------------------------------------
def bundle(wheels: list[Path], model: Path, parts: Path, chunk_bytes: int) -> dict[str, Any]:
    """One tar of `wheels/` and `model/`, split into `parts/part-NN/bundle.tar.NN` of at most
    `chunk_bytes`, each part with the manifest (`parts.json`)."""
    if parts.exists():
        shutil.rmtree(parts)
    parts.mkdir(parents=True)
    tar_path = parts / "bundle.tar"
    files = {}
    with tarfile.open(tar_path, "w") as tar:
        for w in sorted(wheels):
            tar.add(w, f"wheels/{w.name}")
            files[f"wheels/{w.name}"] = sha256(w)
        for f in sorted(model.iterdir()):
            tar.add(f, f"model/{f.name}")
            files[f"model/{f.name}"] = sha256(f)
    size = tar_path.stat().st_size
    chunks = []
    with tar_path.open("rb") as src:
        for i in range(-(-size // chunk_bytes)):
            data = src.read(chunk_bytes)
            folder = parts / f"part-{i:02d}"
            folder.mkdir()
            (folder / f"bundle.tar.{i:02d}").write_bytes(data)
            chunks.append({"name": f"bundle.tar.{i:02d}", "bytes": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"bundle_sha256": sha256(tar_path), "bundle_bytes": size, "chunks": chunks,
                "files": files}
    tar_path.unlink()
    for i in range(len(chunks)):
        (parts / f"part-{i:02d}" / "parts.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def receive(part: Path, kit: Path) -> str:
    """Keep `part`'s chunk in `kit` (its hash checked against the manifest it came with)."""
    manifest = json.loads((part / "parts.json").read_text())
    kit.mkdir(parents=True, exist_ok=True)
    (kit / "parts.json").write_text(json.dumps(manifest, indent=1))
    names = [p.name for p in part.glob("bundle.tar.*")]
    if len(names) != 1:
        raise SystemExit(f"receive: {part}: expected one bundle.tar.NN, found {names}")
    want = next(c for c in manifest["chunks"] if c["name"] == names[0])
    if sha256(part / names[0]) != want["sha256"]:
        raise SystemExit(f"receive: {names[0]}: sha256 differs from the manifest's")
    shutil.copy(part / names[0], kit / names[0])
    have = sorted(c["name"] for c in manifest["chunks"] if (kit / c["name"]).is_file())
    return f"{names[0]}: ok; {len(have)} of {len(manifest['chunks'])} parts in {kit}"


def reassemble(kit: Path) -> Path:
    """`kit/bundle/` from the chunks in `kit`, every hash checked; each missing or damaged
    chunk is named."""
    manifest = json.loads((kit / "parts.json").read_text())
    bad = [c["name"] for c in manifest["chunks"]
           if not (kit / c["name"]).is_file() or sha256(kit / c["name"]) != c["sha256"]]
    if bad:
        raise SystemExit(f"install: missing or damaged parts: {', '.join(bad)} (receive them "
                         "again)")
    tar_path = kit / "bundle.tar"
    with tar_path.open("wb") as out:
        for c in manifest["chunks"]:
            out.write((kit / c["name"]).read_bytes())
    if sha256(tar_path) != manifest["bundle_sha256"]:
        raise SystemExit("install: the reassembled bundle's sha256 differs from the manifest's")
    folder = kit / "bundle"
    if folder.exists():
        shutil.rmtree(folder)
    with tarfile.open(tar_path) as tar:
        tar.extractall(folder, filter="data")
    tar_path.unlink()
    bad = [name for name, digest in manifest["files"].items()
           if sha256(folder / name) != digest]
    if bad:
        raise SystemExit(f"install: unpacked files differ from the manifest: {', '.join(bad)}")
    return folder


def install(folder: Path, target: Path, cross: bool) -> list[str]:
    """`pip install --no-index --no-deps --target` of every wheel in `folder/wheels`; `cross`:
    for the GPU image's interpreter, from this one (the dry run here)."""
    wheels = sorted(str(w) for w in (folder / "wheels").glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target),
           *(TARGET if cross else []), *wheels]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit("install: pip failed:\n" + proc.stderr[-3000:])
    return [Path(w).name for w in wheels]


def unmet(target: Path) -> list[str]:
    """vLLM's requirements that the target and this interpreter's packages do not meet (less
    `NOT_CARRIED` and `IMAGE_KEEPS`): what to carry next time, or why vLLM may not start."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    path = [str(target), *sys.path]
    dist = next(iter(md.distributions(name="vllm", path=[str(target)])), None)
    if dist is None:
        return ["vllm: not installed"]
    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        name = norm(req.name)
        if (req.marker and not req.marker.evaluate({"extra": ""})) or name in NOT_CARRIED \
                or name in IMAGE_KEEPS:
            continue
        found = next(iter(md.distributions(name=req.name, path=path)), None)
        if found is None:
            out.append(f"{req}: not installed")
        elif not req.specifier.contains(found.version, prereleases=True):
            out.append(f"{req}: {found.version} installed")
    return out


def device_calls(parts: Path, repo: Path = REPO) -> list[dict[str, Any]]:
    """The device calls that move the parts and run the check: carry and command of each."""
    rel = parts.resolve().relative_to(repo.resolve())
    script = HERE.relative_to(repo) / "gpu_check.sh"
    folders = sorted(p.name for p in parts.iterdir() if p.name.startswith("part-"))
    calls = [{"carry": [f"{rel}/{name}"], "command": f"{script} receive {rel}/{name}"}
             for name in folders]
    calls[-1]["command"] += f" && {script} run"
    return calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    st = sub.add_parser("stage", help="resolve, fetch, pack, split, check here")
    st.add_argument("--out", type=Path, default=CACHE / "parts")
    st.add_argument("--resolve", action="store_true", help="resolve the packages anew and "
                    "rewrite kit-lock.json (default: the lock's)")
    st.add_argument("--chunk-mib", type=int, help="part size (default: what a transfer "
                    "leaves beside this working tree)")
    bd = sub.add_parser("bundle", help="pack and split given wheels and a model folder")
    bd.add_argument("--wheels", type=Path, required=True)
    bd.add_argument("--model", type=Path, required=True)
    bd.add_argument("--out", type=Path, required=True)
    bd.add_argument("--chunk-bytes", type=int, required=True)
    rc = sub.add_parser("receive", help="keep one part in the kit folder")
    rc.add_argument("part", type=Path)
    rc.add_argument("--kit", type=Path, default=KIT)
    ins = sub.add_parser("install", help="reassemble, check and install the kit")
    ins.add_argument("--kit", type=Path, default=KIT)
    ins.add_argument("--target", type=Path, help="(default: KIT/site)")
    ins.add_argument("--cross", action="store_true", help="install for the GPU image's "
                     "interpreter (CPython 3.12) from this one")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.step == "receive":
        print(receive(args.part, args.kit))
        return 0
    if args.step == "install":
        folder = reassemble(args.kit)
        target = args.target or args.kit / "site"
        names = install(folder, target, args.cross)
        print(json.dumps({"installed": len(names), "wheels": names,
                          "model": str(folder / "model"),
                          # vLLM's requirements this interpreter does not meet (not here:
                          # --cross installs for another interpreter)
                          **({} if args.cross else {"unmet": unmet(target)}),
                          "s": round(time.perf_counter() - t0, 1)}))
        return 0
    if args.step == "bundle":
        if args.chunk_bytes < 1:
            ap.error(f"--chunk-bytes {args.chunk_bytes}: must be >= 1")
        manifest = bundle(sorted(args.wheels.glob("*.whl")), args.model, args.out,
                          args.chunk_bytes)
        print(json.dumps({"parts": len(manifest["chunks"]),
                          "bytes": manifest["bundle_bytes"]}))
        return 0
    chunk = (args.chunk_mib << 20) if args.chunk_mib else chunk_limit()
    if chunk > chunk_limit():
        ap.error(f"--chunk-mib {args.chunk_mib}: a transfer leaves {chunk_limit() >> 20} MiB "
                 "beside this working tree")
    if args.resolve or not LOCK.is_file():
        LOCK.write_text(json.dumps(resolve(image_packages()), indent=1) + "\n")
    items = json.loads(LOCK.read_text())
    wheels = fetch(items, CACHE / "wheels")
    with tempfile.TemporaryDirectory(prefix="dualpath-stage-") as tmp:
        model = model_folder(Path(tmp) / "model")
        manifest = bundle(wheels, model, args.out, chunk)
        kit = Path(tmp) / "kit"
        for part in sorted(args.out.glob("part-*")):
            receive(part, kit)
        installed = install(reassemble(kit), Path(tmp) / "site", cross=True)
    calls = device_calls(args.out)
    (args.out / "calls.json").write_text(json.dumps(calls, indent=1))
    print(json.dumps({
        "packages": [f"{i['name']}=={i['version']}" for i in items],
        "wheel_bytes": sum(w.stat().st_size for w in wheels),
        "parts": [c["bytes"] for c in manifest["chunks"]], "chunk_limit_bytes": chunk,
        "checked_here": f"{len(installed)} wheels reassembled, hashes checked, installed "
                        "into a temporary target for CPython 3.12",
        "device_calls": calls, "s": round(time.perf_counter() - t0, 1)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
