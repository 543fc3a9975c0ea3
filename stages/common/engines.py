"""vLLM engines as Ray actors, and zero-copy weight sync through the object store.

The ppo stage's rollouts and SFT's held-out greedy answers (`accuracy_engine: vllm`) both come
from here; it lives in `stages/common` so that editing PPO does not change SFT's cache key.

    pool = EnginePool(model_dir, EngineSpec(...), num_engines=2)   # N engines, one Ray actor each
    pool.sync(weights_ref)             # every engine loads the policy's weights from one ray.put
    ray.get(pool.engines[0].generate.remote(prompt_ids, sampling))  # any rank can call any engine

Why these choices (docs/architecture.md, facts 4 and 8):
- Each engine runs `LLM(..., distributed_executor_backend="uni")` with `VLLM_ENABLE_V1_MULTIPROCESSING=0`,
  so the model lives inside the actor process and weights handed to it cross no other process boundary
  (an engine of `tensor_parallel_size` N > 1 runs "mp": each sync is pickled to its N shard processes).
- Weights travel as a dict of numpy arrays put into the Ray object store once
  (`weights_to_numpy` + `ray.put`). Each engine receives the ref as a task argument: Ray maps the
  arrays read-only from shared memory on the same node, and `torch.from_numpy` wraps them without
  a copy, instead of pickling the state dict to each engine (ratio in bench/RESULTS.md).
- The load goes through a `worker_extension_cls` method doing vLLM's layerwise reload
  (`initialize_layerwise_reload` / `load_weights` / `finalize_layerwise_reload`): a plain
  `load_weights` fails on the CPU worker (`Parameter has no attribute weight_loader`). It is not
  named `update_weights`, which the CPU worker already has. The prefix cache is then cleared, so
  no KV block computed with old weights is reused.
- bf16 has no numpy dtype: such tensors travel as their int16 bit pattern, viewed back as bf16 (zero-copy).
- The same code runs on a GPU (vLLM CUDA build, `EngineSpec.gpus()` per engine): only `EngineSpec` changes;
  `rollout.sync_transport: nccl` sends the weights over vLLM's own weight transfer instead (stages/ppo/nccl_sync.py).

Calls that run the user's code on an engine (multi-turn episodes) are followed (stages/common/followed.py);
`EnginePool.retrying` restarts an engine killed there.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from stages.common.followed import EngineStalled, kill_engine, trouble

EXTENSION = "stages.common.engines.WeightSyncExtension"
BF16_TAG = "__bf16__"


# --------------------------------------------------------------------------- weights as numpy


def distinct(state_dict: dict) -> dict[str, Any]:
    """A state dict's tensors, detached, each storage once (tied weights, lm_head = embed_tokens: sent once)."""
    out, seen = {}, set()
    for name, t in state_dict.items():
        if not (t.numel() and t.data_ptr() in seen):
            seen.add(t.data_ptr())
            out[name] = t.detach()
    return out


def weights_to_numpy(state_dict: dict) -> dict[str, Any]:
    """A torch state dict -> {name: numpy array} for `ray.put` (tied duplicates dropped, bf16 as int16 bits)."""
    import torch

    out: dict[str, Any] = {}
    for name, t in distinct(state_dict).items():
        t = t.cpu().contiguous()
        bf16 = t.dtype == torch.bfloat16
        out[name + BF16_TAG if bf16 else name] = (t.view(torch.int16) if bf16 else t).numpy()
    return out


def numpy_to_tensors(weights: dict[str, Any]):
    """{name: numpy array} -> iterator of (name, tensor) sharing the arrays' memory (no copy). Tensors pass
    through as they are: a colocated rank hands its engine the trainer's own state dict (same process)."""
    import warnings

    import torch

    for name, arr in weights.items():
        if isinstance(arr, torch.Tensor):
            yield name, arr
            continue
        with warnings.catch_warnings():  # object-store arrays are read-only; vLLM only reads them
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
        if name.endswith(BF16_TAG):
            yield name.removesuffix(BF16_TAG), t.view(torch.bfloat16)
        else:
            yield name, t


def nbytes(weights: dict[str, Any]) -> int:
    return int(sum(a.nbytes for a in weights.values()))


# --------------------------------------------------------------------------- inside vLLM's worker


class WeightSyncExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); runs where the model lives.

    A sync is vLLM's layerwise reload: begun once, fed one or more chunks (each `model.load_weights` call
    adds to every layer's loaded count, so a layer may span chunks), finished once; a layer is processed
    when all its weights have arrived. Chunks keep the sender's memory to one chunk
    (stages/ppo/weight_chunks.py)."""

    def begin_weight_sync(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def load_weight_chunk(self, weights: dict[str, Any]) -> int:
        self.model_runner.get_model().load_weights(weights=numpy_to_tensors(weights))
        return len(weights)

    def finish_weight_sync(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.model_config)
        _refresh_tied_head(model)

    def load_synced_weights(self, weights: dict[str, Any]) -> int:
        self.begin_weight_sync()
        loaded = self.load_weight_chunk(weights)
        self.finish_weight_sync()
        return loaded


def _refresh_tied_head(model) -> None:
    """Re-pack a tied LM head from the freshly loaded embedding.

    With tied embeddings the checkpoint has no `lm_head.weight`, so the layerwise reload never reprocesses the
    head ("ParallelLMHead: Failed to load weights" in vLLM's log). Its storage is the embedding's and so already
    holds the new values, but on CPU the head multiplies through a oneDNN handle packed from the *old* weights at
    start-up: without this, logits come from the old policy. Re-running its `process_weights_after_loading`
    re-packs it (a no-op on GPU)."""
    import torch

    by_storage: dict[int, list] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.numel():
            by_storage.setdefault(weight.data_ptr(), []).append(module)
    for modules in by_storage.values():
        if len(modules) < 2:  # not tied
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)


# --------------------------------------------------------------------------- the engine actor


@dataclass(frozen=True)
class EngineSpec:
    """How to build one engine (plain data, shipped to the actor)."""

    max_model_len: int
    seed: int = 0
    dtype: str = "float32"
    gpu: bool = False
    gpu_share: float = 1.0  # of one GPU, each engine asks Ray for (on GPUs; a fraction packs several on one)
    kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.3
    num_cpus: float = 1.0
    env: dict[str, str] = field(default_factory=dict)
    storage: Any = None  # the run's pipeline.run_storage.RunStorage, for an engine that pulls its model (None: local)
    # "uni": an engine actor of its own; "external_launcher": an engine inside a training rank (the colocated
    # layout, stages/ppo/layouts/colocated.py), which joins the rank's torch process group as TRL's colocate mode does
    backend: str = "uni"
    sleep_mode: bool = False  # inside a rank on a GPU: release the engine's memory while the rank trains
    sleep_level: int = 2  # with sleep_mode: 2 discards the weights asleep, 1 keeps them in CPU memory (ppo/sleep.py)
    max_num_batched_tokens: int | None = None  # vLLM's scheduler budget per step (None: vLLM's default)
    tensor_parallel_size: int = 1  # GPUs an engine of its own shards over (gpu_share of each; vLLM's "mp" executor)
    weight_transfer: str | None = None  # vLLM's weight-transfer backend ("nccl": stages/ppo/nccl_sync.py), or none

    def gpus(self) -> float:
        """What the engine asks Ray for: its share of a GPU per shard (none on the CPU)."""
        return self.gpu_share * self.tensor_parallel_size if self.gpu else 0

    def runtime_env(self) -> dict:
        # Read by vLLM at import and engine start, so they must be in the actor's environment.
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false", **self.env}
        if self.backend == "uni":  # inside a rank, llm_kwargs sizes it in bytes (vLLM's CPU platform lets this win)
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(self.kv_cache_gb)))
        if not self.gpu and "LD_PRELOAD" not in env and tcmalloc():
            # vLLM's CPU backend asks for tcmalloc: 2.25x -> 2.78x HF generate's tokens/s at 33.7M parameters
            # (bench/RESULTS.md, rollouts). Ray starts the actor's process with this environment.
            env["LD_PRELOAD"] = tcmalloc()
        return {"env_vars": env}


def tcmalloc() -> str | None:
    """The tcmalloc library's name if this machine has it (scripts/setup.sh installs it with apt)."""
    import ctypes.util

    return ctypes.util.find_library("tcmalloc_minimal")


def llm_kwargs(model: str, spec: EngineSpec, index: int) -> dict:
    """vLLM's `LLM(...)` arguments for one engine: what the device and the layout decide (tested without vLLM).

    - On CPU: eager execution, and no chunked prefill: a request split by chunked prefill has its sampled token
      discarded, and vLLM then rewinds the request's seeded generator, which a CPU generator cannot do ("CPU
      Generator does not use offset"); every seeded batch larger than the token budget (the held-out
      evaluation) failed. Whole prompts per step avoid the rewind.
    - Inside a training rank (`backend` external_launcher): on CPU the KV cache is sized in bytes here, not by
      the environment's whole GiB, since the trainer shares the process's memory; on a GPU `sleep_mode` lets
      the engine release its weights and cache while the rank trains, and `gpu_memory_utilization` is the
      share of the rank's GPU the engine may take.
    """
    kwargs = dict(model=model, dtype=spec.dtype, seed=spec.seed + index, max_model_len=spec.max_model_len,
                  distributed_executor_backend=spec.backend, enforce_eager=not spec.gpu,
                  gpu_memory_utilization=spec.gpu_memory_utilization, worker_extension_cls=EXTENSION,
                  enable_prefix_caching=True, load_format="safetensors",  # never pickle weights (they can run code)
                  enable_chunked_prefill=spec.gpu)
    # its shards as processes of the actor, on the GPUs Ray gave the actor
    if spec.tensor_parallel_size > 1 and spec.backend == "uni":
        kwargs.update(tensor_parallel_size=spec.tensor_parallel_size, distributed_executor_backend="mp")
    if spec.max_num_batched_tokens is not None:  # vLLM wants it >= max_num_seqs (its default 256, 1024 on H100s)
        kwargs.update(max_num_batched_tokens=spec.max_num_batched_tokens,
                      max_num_seqs=min(spec.max_num_batched_tokens, 256))
    if spec.weight_transfer:  # the engine's workers then take weights over vLLM's own transfer engine
        kwargs["weight_transfer_config"] = {"backend": spec.weight_transfer}
    if spec.backend == "external_launcher":
        if spec.gpu:
            kwargs["enable_sleep_mode"] = spec.sleep_mode
        else:
            kwargs["kv_cache_memory_bytes"] = int(spec.kv_cache_gb * 2**30)
    return kwargs


class RolloutEngine:
    """One vLLM engine: generates token ids, loads synced weights. A Ray actor of its own (`EnginePool`), or an
    object inside a colocated training rank (stages/ppo/layouts/colocated.py)."""

    def __init__(self, model_dir: str, spec: EngineSpec, index: int):
        born = time.time()
        from pipeline import events
        from stages.common.startup import lean_imports

        events.record_start("vllm_engines", detail=f"engine {index}")

        lean_imports()  # before vLLM loads transformers (stages/common/startup.py)
        import torch
        from vllm import LLM

        imported = time.time()

        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        if not spec.gpu and spec.backend == "uni":
            # One engine per logical CPU slot; let its matmuls use the cores Ray gave it.
            torch.set_num_threads(max(1, int(spec.num_cpus)))
            threads = torch.get_num_threads()
        self.index, self.version = index, 0  # version: policy updates in the loaded weights (0: the model's own)
        self.llm = LLM(**llm_kwargs(str(spec.storage.localize(model_dir) if spec.storage is not None else model_dir),
                                    spec, index))
        # vLLM's CPU worker replaces torch.set_num_threads process-wide by a function that only warns: a trainer in
        # the same process (the colocated layout) could no longer set its threads. The original comes back, with
        # the count the process had.
        torch.set_num_threads = set_threads
        set_threads(threads)
        self.startup = {"born": born, "imports": imported - born, "engine": time.time() - imported}

    def timings(self) -> dict[str, float]:
        """This engine's start-up: `born` (a wall-clock time), then its imports and engine build in seconds."""
        return self.startup

    def generate(self, prompt_ids: list[list[int]], sampling: dict) -> list[list[dict]]:
        """For each prompt, `sampling['n']` samples: [{'ids': [...], 'finished': bool, 'version': int}, ...]
        (`version`: that of the weights that generated them, as given to `load_weights`).

        With `sampling['logprobs']` set (0 is enough), each sample also carries `logprobs`: the
        engine's log-probability of each sampled token, before temperature and top-p (vLLM's
        default `raw_logprobs`), i.e. what the trainer computes from the same weights.
        """
        from vllm import SamplingParams

        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], SamplingParams(**sampling),
                                 use_tqdm=False)
        return [[{**_sample(c), "version": self.version} for c in o.outputs] for o in outs]

    def load_weights(self, weights: dict[str, Any] | Iterable[dict[str, Any]], version: int | None = None) -> float:
        """Load the policy's weights, whole (a ref resolved by Ray: zero-copy numpy) or as chunks of tensors
        (a colocated rank's `weight_chunks`, each loaded before the next is gathered); returns seconds taken.
        `version` (the policy updates they include) tags what the engine generates from now on."""
        t0 = time.time()
        if isinstance(weights, dict):
            self.llm.collective_rpc("load_synced_weights", args=(weights,))
        else:
            self.llm.collective_rpc("begin_weight_sync")
            try:
                for chunk in weights:
                    self.llm.collective_rpc("load_weight_chunk", args=(chunk,))
            finally:  # also after a failed chunk: no layer is left on vLLM's meta device for the next sync
                self.llm.collective_rpc("finish_weight_sync")
        self.llm.reset_prefix_cache()
        self.version = self.version + 1 if version is None else version
        return time.time() - t0

    def ping(self) -> int:
        return os.getpid()


def _sample(completion) -> dict:
    out = {"ids": list(completion.token_ids), "finished": completion.finish_reason == "stop"}
    if completion.logprobs is not None:
        out["logprobs"] = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
    return out


class EnginePool:
    """`num_engines` RolloutEngine actors; restarts dead ones and brings them to the current weights."""

    def __init__(self, model_dir: str, spec: EngineSpec, num_engines: int, strategy: str = "SPREAD",
                 engine_cls: type = RolloutEngine, wait: bool = True):
        """With `wait=False` the engines start in the background (the ppo stage starts its roles
        meanwhile); `ready()` waits for them."""
        from ray.util.placement_group import placement_group

        self.model_dir, self.spec, self.restarts, self.engine_cls = model_dir, spec, 0, engine_cls
        bundle = {"CPU": spec.num_cpus, **({"GPU": spec.gpus()} if spec.gpu else {})}
        self.pg = placement_group([bundle] * num_engines, strategy=strategy)
        self.engines = [self._start(i) for i in range(num_engines)]  # they wait for the placement group
        self.weights_ref, self.version = None, None  # the last synced weights, to bring a restarted engine up to date
        self.resync = None  # or what brings restarted engines (their indices) up to date (stages/ppo/nccl_sync.py)
        if wait:
            self.ready()

    def ready(self, timeout: float = 120) -> None:
        """Wait until the engines' CPUs (GPUs) are reserved (within `timeout`) and every engine answers."""
        import ray

        ray.get(self.pg.ready(), timeout=timeout)
        ray.get([e.ping.remote() for e in self.engines])

    def _start(self, index: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = ray.remote(self.engine_cls).options(
            num_cpus=self.spec.num_cpus, num_gpus=self.spec.gpus(),
            runtime_env=self.spec.runtime_env(),
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
            name=None, max_concurrency=1,
        )
        return actor.remote(self.model_dir, self.spec, index)

    def sync(self, weights_ref, version: int | None = None) -> float:
        """Every engine loads the weights behind `weights_ref` (one object, read in place) as `version`;
        returns the longest engine's load seconds."""
        import ray

        self.weights_ref, self.version = weights_ref, version
        try:
            return max(ray.get([e.load_weights.remote(weights_ref, version) for e in self.engines]))
        except ray.exceptions.RayActorError:
            # An engine died before or during the load: revive() restarts it and loads weights_ref into it;
            # if none was found dead the error was something else, and it is raised.
            if not self.revive():
                raise
            return 0.0

    def kill(self, index: int, timeout: float = 60) -> None:
        """Fault drills: kill engine `index` and return once Ray reports it dead."""
        kill_engine(self.engines[index], timeout)

    def revive(self) -> list[int]:
        """Restart every engine that no longer answers, and re-sync it; returns the restarted indices."""
        import ray

        dead = []
        for i, engine in enumerate(self.engines):
            try:
                ray.get(engine.ping.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(i)
        for i in dead:
            try:
                ray.kill(self.engines[i])
            except Exception:  # already gone
                pass
            self.engines[i] = self._start(i)
            self.restarts += 1
        if dead:
            ray.get([self.engines[i].ping.remote() for i in dead])
            if self.resync is not None:
                self.resync(dead)
            elif self.weights_ref is not None:
                ray.get([self.engines[i].load_weights.remote(self.weights_ref, self.version) for i in dead])
        return dead

    def retrying(self, call, say=print, attempts: int = 3, since: int | None = None):
        """`call()`, again (up to `attempts` times in all) after an engine died or was killed during it
        (`EngineStalled`): dead engines are restarted with the last synced weights first. `since`: the
        pool's `restarts` when the request `call` collects was sent (default: now); an engine restarted
        since then (by a weight sync in between) also makes it worth sending again. The last failure, or
        one with no engine restarted, is raised."""
        import ray

        since = self.restarts if since is None else since
        for attempt in range(attempts):
            try:
                return call()
            except (ray.exceptions.RayError, EngineStalled) as exc:
                restarted = self.revive()
                if (not restarted and self.restarts == since) or attempt == attempts - 1:
                    raise
                since = self.restarts
                say(f"rollout engine(s) {restarted} restarted and re-synced after {trouble(exc)}; retrying"
                    if restarted else f"{trouble(exc)}; a rollout engine was restarted since the request went out, "
                                      f"sending it again")

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for e in self.engines:
            try:
                ray.kill(e)
            except Exception:
                pass
        remove_placement_group(self.pg)
