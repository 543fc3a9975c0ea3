"""Upstream gap: Ray Serve LLM has no public name for five things the serve stage needs, so they are imported from
`ray.llm._internal`, here and nowhere else.

- `CallbackBase`: the base class of `LLMConfig.callback_config`'s callbacks, which Ray documents but does not export
  (the serve stage's `LocalModel` skips the per-node download task for a local model directory);
- `global_id_manager`, `DiskMultiplexConfig`: what a multiplexed LoRA loader returns (`LocalAdapters`: adapters
  from local directories; Serve LLM loads them only from cloud storage);
- `ingress_init` (`ingress.init`) and `to_model_metadata`: the LLM ingress's own FastAPI app and model cards, since
  there is no public hook for middleware on the ingress (the serve stage's API-key and limits guard).

Targets: Ray 2.60 (the module paths below). No upstream issue filed from here.
Removable, name by name, when `ray.serve.llm` exports it; the test that says so is
`tests/test_upstream.py::test_ray_serve_llm_still_lacks_public_names_for_what_serve_uses` (it also fails when a
path below moves, which is the moment to look for the public name again).
"""

from __future__ import annotations

import importlib

# name here -> (private module, its name there); imported on first use (a replica needs only some of them)
PRIVATE = {
    "CallbackBase": ("ray.llm._internal.common.callbacks.base", "CallbackBase"),
    "global_id_manager": ("ray.llm._internal.common.models", "global_id_manager"),
    "DiskMultiplexConfig": ("ray.llm._internal.serve.core.configs.llm_config", "DiskMultiplexConfig"),
    "ingress_init": ("ray.llm._internal.serve.core.ingress.ingress", "init"),
    "to_model_metadata": ("ray.llm._internal.serve.core.configs.openai_api_models", "to_model_metadata"),
}


def __getattr__(name: str):
    if name not in PRIVATE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = PRIVATE[name]
    return getattr(importlib.import_module(module), attribute)
