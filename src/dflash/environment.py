"""`dflash env`: what this machine and install give dflash, without loading a model: versions, the CPU and the
instruction sets our kernels use, whether our C kernels built (and if not, why), which of their paths run here, the
GPU, the cache and the registry models already in it. For bug reports, and for "why is it slower here?"."""

from __future__ import annotations

import argparse
import json
import os
import platform


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")


def describe() -> dict:
    import torch
    import transformers

    from . import __version__
    from .hub import REGISTRY, cache_dir, converted_dir
    from .models import native
    from .models.kernels import plan_cache_file

    info = {
        "dflash": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "platform": platform.platform(), "cpu": native.cpu_description(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "native_kernels": native.build_id(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cache": str(cache_dir()), "kernel_plans": str(plan_cache_file()) if plan_cache_file().exists() else None,
        "registry_models_cached": [name for name in REGISTRY if (converted_dir(name) / "config.json").exists()],
    }
    if native.library() is None:
        info["native_kernels_missing_because"] = native.why_not
    return info


def run(args) -> int:
    info = describe()
    if args.json:
        print(json.dumps(info))
        return 0
    cpu = info.pop("cpu")
    info = {"cpu": f"{cpu['model']} (family {cpu['family']} model {cpu['model_number']}; {' '.join(cpu['isa'])})",
            **info}
    width = max(len(key) for key in info)
    for key, value in info.items():
        shown = ", ".join(value) if isinstance(value, list) else "-" if value is None else value
        print(f"{key:<{width}}  {shown}")
    return 0
