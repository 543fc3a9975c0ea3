"""The Workhorse of every PPO role: one rank of the policy, critic, reference or reward model.

The PPO driver (`stages/ppo/__init__.py`) places each role on a `ModelGroup` of these actors and calls
them by name; this file is what runs inside one rank. A rank holds its model under DeepSpeed
(ZeRO 0-3 from the role's YAML section; trainable roles get an AdamW optimizer, frozen ones are
wrapped without one, so ZeRO-3 still shards them), and answers:

    setup(spec)              load the role's model from an HF directory
    logprobs(batch)          policy / reference: log p of each response token
    ref_logprobs(batch)      policy: the reference's log-probs (its adapter off, or the colocated copy)
    values(batch)            critic: V(s) before each response token
    scores(pairs)            reward model: a score per head for each (prompt, response)
    train_policy / train_critic   PPO epochs over this rank's share of the rollouts
    export_weights()         full weights into the object store once (rank 0 returns the ref)
    connect_engines(), send_weights()   or over NCCL into each engine (rollout.sync_transport: nccl)
    save / load              DeepSpeed checkpoints (optimizer included) for resuming
    save_hf(dir)             the trained policy as an HF directory (a LoRA policy merged)
    save_adapter(dir)        a LoRA policy's adapter alone

Batches are dicts of tensors built by the driver (`stages.ppo.make_batch`): prompts left-padded
to one width `P`, responses right-padded, so every response token t sits at column P + t and its
logit at column P + t - 1 for every row alike.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pipeline.events import timed
from stages.ppo.groups import Workhorse


def _response_slice(batch: dict, x):
    """Columns that predict the response tokens: logits/hidden states at P-1 ... P+T-2."""
    p, t = batch["prompt_width"], batch["response_mask"].shape[1]
    return x[:, p - 1 : p - 1 + t]


def _micro_batches(batch: dict, size: int, generator, device):
    """Shuffled micro-batches of `size` rows (tensor entries sliced, scalars kept), each on `device`: the driver's
    batches are CPU tensors, the model's device may be a GPU (stages/common/devices.py)."""
    import torch

    from stages.common.devices import to_device

    n = batch["input_ids"].shape[0]
    order = torch.randperm(n, generator=generator)
    for i in range(0, n - size + 1, size):
        idx = order[i : i + size]
        yield to_device({k: (v[idx] if torch.is_tensor(v) else v) for k, v in batch.items()}, device)


class PPOWorker(Workhorse):
    """One rank of one PPO role (see the module docstring for its calls); a layout's rank class adds how it
    generates (stages/ppo/layouts/)."""

    # --------------------------------------------------------------- set-up

    def setup(self, spec: dict) -> int:
        """spec: role, kind ('causal' | 'value' | 'reward'), model_dir, ds_config, trainable, pad_id, seed,
        lora (a `LoraSection` dict, or None: full fine-tuning), and storage (the run's `RunStorage`: where to
        pull the model from and push checkpoints to)."""
        from stages.common.startup import import_deepspeed, lean_imports
        from pipeline.upstream.deepspeed_loads import safe_checkpoint_loads

        t0 = time.time()
        # A frozen role that ZeRO-3 does not shard (reward model, reference of its own) needs no DeepSpeed: a plain
        # module in eval mode computes the same forward passes without DeepSpeed's import and engine build.
        plain = not spec["trainable"] and spec["ds_config"].get("zero_optimization", {}).get("stage", 0) < 3
        deepspeed = None if plain else import_deepspeed()  # lean: without the optional imports no rank uses
        lean_imports()
        import torch

        from stages.common import lora
        from stages.common.devices import process_device
        from stages.common.models import count_parameters, load_model, load_tokenizer, saved_heads, single_head

        t1 = time.time()

        torch.manual_seed(spec["seed"] + self.rank)
        self.storage = spec["storage"]
        spec = {**spec, "model_dir": str(self.storage.localize(spec["model_dir"]))}  # pulled if this node lacks it
        self.spec, self.kind = spec, spec["kind"]
        self.generator = torch.Generator().manual_seed(spec["seed"] * 1000 + self.rank)
        heads = 1 if self.kind == "causal" else saved_heads(spec["model_dir"])
        model = load_model(spec["model_dir"], self.kind, None if self.kind == "causal" else spec["pad_id"], heads)
        if self.kind == "value" and heads > 1:  # a critic from an ensemble reward model: one value head
            # (the heads' mean; zeroed just below under critic_zero_init, the default, keeping the backbone)
            single_head(model)
        if spec.get("zero_head"):  # critic: values start at 0, not at the reward model's logit scale
            torch.nn.init.zeros_(model.score.weight)
        if spec.get("activation_checkpointing"):
            model.gradient_checkpointing_enable()
        if spec.get("lora"):  # after zero_head: the trained copy of the score head starts from the zeros
            model = lora.wrap(model, lora.LoraSection.model_validate(spec["lora"]),
                              "causal" if self.kind == "causal" else "sequence", spec.get("activation_checkpointing"))
        if self.kind == "reward":
            self.tokenizer = load_tokenizer(spec["model_dir"])
        self.reference = None  # reference.colocate: a frozen copy of the SFT policy beside the trained one
        if spec.get("reference_dir"):  # on the rank's device, as the policy is (a no-op on a CPU)
            self.reference = load_model(spec["reference_dir"], "causal", None).requires_grad_(False).eval().to(
                process_device())
        t2 = time.time()
        if spec["trainable"]:
            from stages.common.deepspeed import for_device

            trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA: the adapter (+ head)
            config = for_device(spec["ds_config"], process_device())  # no compiler needed on a GPU
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
        elif plain:
            bf16 = spec["ds_config"].get("bf16", {}).get("enabled", False)  # what DeepSpeed would have cast it to
            dtype = torch.bfloat16 if bf16 else model.dtype
            self.engine = model.requires_grad_(False).to(process_device(), dtype).eval()
        else:
            model.requires_grad_(False)
            self.engine, *_ = deepspeed.initialize(model=model, config=spec["ds_config"])
            self.engine.eval()
        if not plain:
            safe_checkpoint_loads(self.engine)
        self.startup.update(imports=t1 - t0, model=t2 - t1, deepspeed=time.time() - t2)
        return count_parameters(model)

    # --------------------------------------------------------------- forward passes

    def _forward(self, batch: dict, model=None):
        return (model or self.engine)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                      position_ids=batch["position_ids"])

    def _logprobs(self, batch: dict, with_entropy: bool = False, model=None):
        from stages.ppo.rl import entropy_from_logits, logprobs_from_logits

        logits = _response_slice(batch, self._forward(batch, model).logits)
        logp = logprobs_from_logits(logits, batch["response_ids"])
        return (logp, entropy_from_logits(logits)) if with_entropy else logp

    def _values(self, batch: dict):
        # A sequence classifier pools its score head at the last token; the critic needs it at
        # every position, so run the backbone and apply the head to all hidden states.
        from stages.common.lora import base_of

        module = base_of(self.engine.module)  # a LoRA critic: the backbone with its adapter, the trained head
        hidden = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              position_ids=batch["position_ids"]).last_hidden_state
        return _response_slice(batch, module.score(hidden)).squeeze(-1).float()

    def logprobs(self, batch: dict, micro: int, model=None):
        """log p(response token) under this model (or `model`), (B, T), on the CPU; no gradient."""
        import torch

        from stages.common.devices import device_of, to_cpu

        device = device_of(model or self.engine)
        with torch.no_grad():
            return to_cpu(torch.cat([self._logprobs(b, model=model) for b in _chunks(batch, micro, device)]))

    def ref_logprobs(self, batch: dict, micro: int):
        """The reference's log-probs computed on a policy rank: with the colocated copy, or on a LoRA policy
        with its adapter off (the SFT policy is this model without it)."""
        if self.reference is not None:
            return self.logprobs(batch, micro, model=self.reference)
        with self.engine.module.disable_adapter():
            return self.logprobs(batch, micro)

    def values(self, batch: dict, micro: int):
        """V(s) before each response token, (B, T), on the CPU; no gradient."""
        import torch

        from stages.common.devices import device_of, to_cpu

        device = device_of(self.engine)
        with torch.no_grad():
            return to_cpu(torch.cat([self._values(b) for b in _chunks(batch, micro, device)]))

    def scores(self, pairs: list[tuple[str, str]], micro: int) -> list[list[float]]:
        """Reward-model scores of each (prompt, response), formatted as in its training data: one per head."""
        from stages.common.training import reward_scores

        return reward_scores(self.engine, self.tokenizer, pairs, micro)  # it moves its CPU batches to the model

    # --------------------------------------------------------------- training

    def train_policy(self, batch: dict, hp: dict) -> dict[str, float]:
        """`hp['epochs']` passes of clipped-PPO updates over this rank's rollouts."""
        from stages.common.devices import device_of
        from stages.ppo.losses import policy_loss
        from stages.ppo.rl import kl_penalty, masked_mean

        self.engine.train()
        stats: dict[str, list[float]] = {"policy_loss": [], "clip_frac": [], "approx_kl": [], "entropy": []}
        timing: dict[str, float] = {}
        with timed(timing, "policy_train_s"):
            for _ in range(hp["epochs"]):
                for mb in _micro_batches(batch, hp["micro"], self.generator, device_of(self.engine)):
                    mask = mb["response_mask"]
                    logp, entropy = self._logprobs(mb, with_entropy=True)
                    # group estimators: the KL to the reference in the loss (k3, per token), not in the reward
                    kl = kl_penalty(logp, mb["ref_logprobs"], "k3") if hp["kl_loss_coef"] else None
                    loss, s = policy_loss(logp, mb["old_logprobs"], mb["advantages"], mask, hp["clip_eps"],
                                          weights=mb.get("tis_weights"), agg=hp["agg"], max_len=hp["max_len"],
                                          clip_eps_high=hp["clip_eps_high"], level=hp["level"], kl=kl,
                                          kl_coef=hp["kl_loss_coef"], tokens=hp["tokens_per_row"] * hp["micro"],
                                          kl_weighted=hp["kl_weighted"])
                    ent = masked_mean(entropy, mask)
                    loss = loss - hp["entropy_coef"] * ent
                    self.engine.backward(loss)
                    self.engine.step()
                    stats["policy_loss"].append(loss.item())
                    stats["clip_frac"].append(s["clip_frac"])
                    stats["approx_kl"].append(s["approx_kl"])
                    stats["entropy"].append(ent.item())
        return {**{k: sum(v) / max(len(v), 1) for k, v in stats.items()}, **timing}

    def train_critic(self, batch: dict, hp: dict) -> dict[str, float]:
        from stages.common.devices import device_of
        from stages.ppo.losses import value_loss

        self.engine.train()
        losses, clipped, timing = [], [], {}
        with timed(timing, "critic_train_s"):
            for _ in range(hp["epochs"]):
                for mb in _micro_batches(batch, hp["micro"], self.generator, device_of(self.engine)):
                    loss, s = value_loss(self._values(mb), mb["old_values"], mb["returns"], mb["response_mask"],
                                         hp["value_clip"])
                    self.engine.backward(loss)
                    self.engine.step()
                    losses.append(loss.item())
                    clipped.append(s["value_clip_frac"])
        return {"value_loss": sum(losses) / max(len(losses), 1),
                "value_clip_frac": sum(clipped) / max(len(clipped), 1), **timing}

    # --------------------------------------------------------------- weights and checkpoints

    def export_weights(self) -> list | None:
        """Full weights as numpy into the object store, once (collective under ZeRO-3: gathered a chunk at a time,
        stages/ppo/weight_chunks.py, so the device holds one chunk beyond the rank's shard, never the model).

        Rank 0 returns `[ref, bytes]`: the ref wrapped in a list so the driver receives the ref itself and hands
        it on to the engines, instead of Ray resolving (copying) the weights into the driver.
        """
        import ray

        from stages.common.engines import nbytes, weights_to_numpy
        from stages.ppo.weight_chunks import weight_chunks

        zero3 = self.engine.zero_optimization_stage() == 3
        if self.rank != 0 and not zero3:  # nothing to gather with: rank 0 has all of it
            return None
        weights: dict = {}
        for chunk in weight_chunks(self.engine.module, zero3):
            if self.rank == 0:  # a LoRA policy's chunks come merged, base untouched
                weights.update(weights_to_numpy(chunk))
        return [ray.put(weights), nbytes(weights)] if self.rank == 0 else None

    def connect_engines(self, handles: dict, world_size: int) -> None:
        """`rollout.sync_transport: nccl`: join each engine's NCCL group (stages/ppo/nccl_sync.py)."""
        from stages.ppo.nccl_sync import Senders

        if getattr(self, "senders", None) is None:
            self.senders = Senders(self.engine.module, self.engine.zero_optimization_stage() == 3, self.rank)
        self.senders.connect(handles, world_size)

    def send_weights(self, indices: list[int]) -> list | None:
        """The weights over NCCL into the engines at `indices` (rank 0 returns [seconds, bytes])."""
        return self.senders.send(indices)

    def save(self, directory: str) -> None:
        import deepspeed.comm as dist

        from stages.common.training import save_checkpoint

        save_checkpoint(self.engine, Path(directory), self.rank)  # with LoRA: the adapter, no base weights
        dist.barrier()  # every rank's files are complete before any rank uploads what it sees
        self.storage.push_path(directory)  # with an object store: the ranks' shards meet in the bucket

    def load(self, directory: str) -> None:
        self.storage.pull_path(directory)  # with an object store: the shards other nodes wrote
        from stages.common.training import load_checkpoint

        load_checkpoint(self.engine, Path(directory))

    def save_hf(self, directory: str) -> None:
        from stages.common.training import save_hf

        save_hf(self.engine, Path(directory), self.rank)  # a LoRA policy merged
        if self.rank == 0:
            self.storage.push_path(directory)  # the driver, maybe on another node, pulls it from the bucket

    def save_adapter(self, directory: str) -> None:
        """A LoRA policy's adapter alone (safetensors), for serving it on the SFT model."""
        from stages.common.lora import save_adapter

        if self.rank == 0:
            save_adapter(self.engine.module, Path(directory))
            self.storage.push_path(directory)


def _chunks(batch: dict, size: int, device):
    """Consecutive row chunks of `size` (order kept, last one may be short), each on `device`."""
    import torch

    from stages.common.devices import to_device

    n = batch["input_ids"].shape[0]
    for i in range(0, n, size):
        yield to_device({k: (v[i : i + size] if torch.is_tensor(v) else v) for k, v in batch.items()}, device)


def shard_batch(batch: dict, n: int) -> list[dict]:
    """Split a batch's rows into `n` contiguous shares (the data-parallel split)."""
    import torch

    from stages.common.training import split_bounds

    bounds = split_bounds(batch["input_ids"].shape[0], n)
    return [{key: (v[bounds[r] : bounds[r + 1]] if torch.is_tensor(v) else v) for key, v in batch.items()}
            for r in range(n)]


def concat(parts: list[Any]):
    import torch

    return torch.cat(parts)
